"""The model: which one (registry, hub, embedded), loading it, and its forwards (lean, native C, CUDA graph)."""
