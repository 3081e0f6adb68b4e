"""Token counting for LlamaIndex through the model's own tokenizer, offline.

LlamaIndex counts tokens with a callable `text -> list of token ids`: `Settings.tokenizer`, the
`tokenizer_fn` of `ChatMemoryBuffer` / `Memory` (their `token_limit`), `TokenCountingHandler`. Its
default is tiktoken's GPT-3.5 encoding, which counts a different model's tokens. `KVGraftTokenizer` is
that callable for a kvmemory model: `kvmemory.encode_text`, the ids the engine reads for a text (no
special tokens added), from the tokenizer files alone (read once per process from the local folder the
loader uses, never from the network; the weights are not loaded).
"""

from __future__ import annotations

from typing import Any

from kvmemory import DEFAULT_MODEL, encode_text, tokenizer_for


class KVGraftTokenizer:
    """`text -> token ids` for `model` (an HF id, a local folder, the embedded default, or a loaded
    tokenizer: `KVGraftLLM.tokenizer` passes its engine's own)."""

    def __init__(self, model: Any = None):
        self.model = DEFAULT_MODEL if model is None else model
        tokenizer_for(self.model)  # fail here, typed (InvalidInput), not at the first count

    def __call__(self, text: str) -> list[int]:
        return encode_text(self.model, text)

    def __repr__(self) -> str:
        name = self.model if isinstance(self.model, str) else getattr(self.model, "name_or_path", "tokenizer")
        return f"KVGraftTokenizer({name!r})"


def kvgraft_tokenizer(model: Any = None) -> KVGraftTokenizer:
    """The tokenizer hook for `model` (default: the embedded SmolLM2), e.g.
    `Settings.tokenizer = kvgraft_tokenizer()` or `ChatMemoryBuffer.from_defaults(token_limit=...,
    tokenizer_fn=kvgraft_tokenizer())`."""
    return KVGraftTokenizer(model)
