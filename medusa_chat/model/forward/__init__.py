"""How a model computes: the backbone's forwards (lean PyTorch, native C, CUDA int4, the CUDA-graph step), the KV
cache they write, and the drafts' networks (Medusa / Hydra heads, EAGLE)."""
