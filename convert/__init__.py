"""colibri-convert: Hugging Face checkpoints and GGUF files → the colibri layout (see formats/spec.md)."""
