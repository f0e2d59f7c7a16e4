"""Reading a source checkpoint: its config, its safetensors headers, and where its files are."""
