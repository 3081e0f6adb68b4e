"""LlamaIndex memory block over kvmemory: gets and puts verified solutions for `Memory`."""

from llama_index.memory.kvmemory.base import KVMemoryBlock, Rejected

__all__ = ["KVMemoryBlock", "Rejected"]
