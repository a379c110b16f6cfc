"""The model's GGUF file and the files made beside it: reading its metadata, tokens, synthetic and inflated models, routing traces."""
