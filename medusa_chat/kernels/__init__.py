"""The C kernels and their Python side: the GGUF block formats, block products and the build of the C library."""
