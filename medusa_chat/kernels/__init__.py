"""The C kernels and their Python side: the GGUF block formats, block linears, the numeric-path choice."""
