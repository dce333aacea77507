"""Where a model comes from: which one (registry, hub, embedded, a GGUF file), its files (heads, chat template,
the quantized cache), the numeric path and device it runs with, and loading it into a LoadedModel."""
