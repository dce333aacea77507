"""`medusa-chat export-draft`: a shipped or trained draft written in the layout a serving engine loads (llama.cpp's
EAGLE-3 GGUF, vLLM's speculators and Medusa folders, SGLang's EAGLE-3 folder)."""
