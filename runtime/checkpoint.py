"""A Hugging Face model folder on disk: its file names, and tensor access through one safetensors reader."""

from __future__ import annotations

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
