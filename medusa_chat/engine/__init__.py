"""The decoding engine: KV cache, drafters, acceptance, stop-string text, and MedusaEngine."""
