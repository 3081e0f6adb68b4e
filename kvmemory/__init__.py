"""kvmemory: exact KV-cache grafting memory for agents on frozen Hugging Face models."""

__version__ = "0.1.0"
