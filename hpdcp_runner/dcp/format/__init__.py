"""Layer 1: the on-disk format: metadata (JSON), safetensors I/O, object codec, key renames."""
