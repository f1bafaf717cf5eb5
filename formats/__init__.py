"""The colibri on-disk layout: encodings, manifest, reader and writer (see spec.md)."""
