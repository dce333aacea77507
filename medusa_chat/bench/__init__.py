"""The benchmark: prompts through the engine vs the plain loop (and llama.cpp where installed)."""
