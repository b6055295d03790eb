"""Loaders that turn model files (HF directories, GGUF) into kvinfer objects."""
