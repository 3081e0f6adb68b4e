"""A model's tokenizer, without the Python copy of its vocabulary that its class keeps after building it.

transformers' BPE tokenizer classes (GemmaTokenizer, Qwen2Tokenizer, LlamaTokenizer, GPT2Tokenizer ...)
build their Rust tokenizer from a vocab dict and a merges list and keep both as `_vocab` / `_merges`,
which nothing reads after `__init__` (the Rust tokenizer holds its own). For Gemma 3's 262,144 tokens and
514,906 merges that is ~140 MB of Python objects, a fifth of the 270M model's resident memory (issue 46's
bound: 1.3x the GGUF's size + 300 MB); Qwen2.5's 151,665 tokens, ~70 MB. They are dropped; `Engine.open`
hands the freed heap back to the system once the engine is built (gguf_model.release_freed_memory).
"""

from __future__ import annotations

from typing import Any

_BUILD_COPIES = ("_vocab", "_merges")  # set in the classes' __init__, read nowhere else (transformers 5)


def drop_build_copies(tokenizer: Any) -> Any:
    """`tokenizer` without `_vocab` / `_merges` where it is a tokenizers-backed class holding them; returns it."""
    if getattr(tokenizer, "_tokenizer", None) is None:  # a slow (Python) tokenizer encodes with its vocab
        return tokenizer
    for name in _BUILD_COPIES:
        if isinstance(tokenizer.__dict__.get(name), (dict, list)):
            setattr(tokenizer, name, None)
    return tokenizer


def load(path: str, **kwargs) -> Any:
    """`AutoTokenizer.from_pretrained(path, **kwargs)`, lean (drop_build_copies)."""
    from transformers import AutoTokenizer

    return drop_build_copies(AutoTokenizer.from_pretrained(path, **kwargs))
