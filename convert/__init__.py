"""colibri-convert: Hugging Face (and later GGUF) checkpoints → the colibri layout."""
