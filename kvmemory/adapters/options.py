"""Checks of a call's options, shared by the LangChain and LlamaIndex integrations (and the CLI), so
bad input is refused the same way everywhere: a typed `InvalidInput` naming the option and the value,
never a silent default.

Sampling options (`temperature`, `top_p`, `top_k`, `seed`) are checked where `Sampling` is built
(`kvmemory.engine.runner.Sampling`); these are the rest.
"""

from __future__ import annotations

from typing import Any

from kvmemory.engine.runner import Sampling
from kvmemory.errors import InvalidInput

__all__ = ["max_tokens_option", "prompt_text", "sampling_option"]


def max_tokens_option(value: Any, name: str = "max_tokens") -> int:
    """A positive token budget (an int, or an integral float from a JSON config), else InvalidInput."""
    if isinstance(value, bool) or value is None:
        raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or value < 1:
        raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
    return value


def prompt_text(value: Any, name: str = "prompt") -> str:
    """A prompt or message text: a string (empty is allowed: a chat may end on an empty turn)."""
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidInput(f"{name} contains a NUL character")
    return value


def sampling_option(temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = 0) -> Sampling:
    """`Sampling` from a framework's options; None means the default (frameworks pass None through)."""
    return Sampling(temperature=0.0 if temperature is None else temperature,
                    top_p=1.0 if top_p is None else top_p, top_k=0 if top_k is None else top_k,
                    seed=0 if seed is None else seed)
