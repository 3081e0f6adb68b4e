"""kvmemory: exact KV-cache grafting memory for agents on frozen Hugging Face models.

Public surface: `KVMemory` (the facade), `Engine` (canonical logits, grafted or not), `LocalStore`,
`Sampling`, and the typed errors in `kvmemory.errors`. Imports are lazy so `kvmemory --help` is quick.
"""

__version__ = "0.1.0"

__all__ = ["KVMemory", "Engine", "LocalStore", "Sampling", "load_model", "__version__"]


def __getattr__(name: str):
    if name == "KVMemory":
        from .memory import KVMemory

        return KVMemory
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "LocalStore":
        from .store import LocalStore

        return LocalStore
    if name == "Sampling":
        from .runner import Sampling

        return Sampling
    if name == "load_model":
        from .models import load_model

        return load_model
    raise AttributeError(name)
