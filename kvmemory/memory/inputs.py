"""Checks of what a caller hands the memory (texts, counts, choices, thresholds, ids), each raising
`InvalidInput` with a message that says what to give instead.

They need neither the model nor the store, so the CLI runs them before it loads the model (a bad
argument fails in milliseconds, not after 25 s of loading) and `KVMemory` runs them before any
compute: bad input never reaches the tokenizer, the router or the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmemory.errors import InvalidInput

MAX_TEXT_CHARS = 200_000
# Entries one call may route to. Far past any useful k (answer places them all in the prompt, which the
# model's positions bound anyway), low enough that no index is asked for 2**70 neighbours.
MAX_K = 1000
# Tokens one call may decode. The engine refuses more than the model's positions; this bound only
# keeps absurd integers (2**70) from reaching it.
MAX_NEW_TOKENS = 1 << 20
CHOICE_MODES = ("numbers",)


def check_encodable(name: str, text: str) -> str:
    """Text that UTF-8 can hold. A lone surrogate cannot be encoded (tokenizers raise TypeError, SQLite
    UnicodeEncodeError); Python makes one from command-line bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{name} is not valid text: character {exc.start} is a lone surrogate "
                           f"({text[exc.start]!r}), which UTF-8 cannot hold (bytes that are not UTF-8 on a "
                           "command line become one); give the text as UTF-8") from None
    return text


def check_text(name: str, text: object, required: bool = True) -> str | None:
    """A text field: a str, non-blank when `required`, at most MAX_TEXT_CHARS, no NUL, valid UTF-8."""
    if text is None:
        if required:
            raise InvalidInput(f"{name} is required")
        return None
    if not isinstance(text, str):
        raise InvalidInput(f"{name} must be text, got {type(text).__name__}")
    if required and not text.strip():
        raise InvalidInput(f"{name} is empty")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidInput(f"{name} is {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
    if "\x00" in text:
        raise InvalidInput(f"{name} contains a NUL character")
    return check_encodable(name, text)


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not namespace.strip() or "\x00" in namespace:
        raise InvalidInput(f"namespace must be a non-empty string, got {namespace!r}")
    return check_encodable("namespace", namespace)


def check_entry_id(entry_id: object) -> str:
    if not isinstance(entry_id, str) or not entry_id.strip() or "\x00" in entry_id:
        raise InvalidInput(f"entry_id must be a non-empty string, got {entry_id!r}")
    return check_encodable("entry_id", entry_id)


def check_count(name: str, value: object, *, minimum: int = 1, maximum: int) -> int:
    """An integer in [minimum, maximum] (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise InvalidInput(f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


def check_threshold(threshold: object) -> float | None:
    """A cosine threshold: None (the embedder's calibrated one) or a number in [-1, 1]."""
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold) \
            or not -1.0 <= threshold <= 1.0:
        raise InvalidInput(f"threshold must be a cosine similarity in [-1, 1] (or None for the calibrated one), "
                           f"got {threshold!r}")
    return float(threshold)


def check_choices(choices: object) -> str | list[str] | None:
    """What `answer(choices=...)` takes: None, "numbers", or a non-empty list of texts."""
    if choices is None:
        return None
    if isinstance(choices, str):
        if choices not in CHOICE_MODES:
            raise InvalidInput(f'choices must be "numbers" or a list of strings, got {choices!r}')
        return choices
    if not isinstance(choices, Sequence):
        raise InvalidInput(f'choices must be "numbers" or a list of strings, got {type(choices).__name__}')
    out = [check_text("choice", c) for c in choices]
    if not out:
        raise InvalidInput("choices is empty")
    return out


MAX_PRIOR = 100.0  # nats: far past any log-likelihood gap between two short numbers


def check_contrast(contrast: object) -> float:
    if isinstance(contrast, bool) or not isinstance(contrast, (int, float)) or not 0.0 <= contrast <= 1.0:
        raise InvalidInput(f"contrast must be a number in [0, 1], got {contrast!r}")
    return float(contrast)


def check_prior(prior: object) -> float:
    if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0.0 <= prior <= MAX_PRIOR:
        raise InvalidInput(f"prior must be a number in [0, {MAX_PRIOR:g}] (nats), got {prior!r}")
    return float(prior)


def check_answer_options(*, k: object = 1, max_new_tokens: object = 1, threshold: object = None,
                         choices: object = None, contrast: object = 0.0, prior: object = 0.0) -> None:
    """What `answer` / `ask` / `chat` take besides their texts, checked before anything is computed."""
    check_count("k", k, maximum=MAX_K)
    check_count("max_new_tokens", max_new_tokens, maximum=MAX_NEW_TOKENS)
    check_threshold(threshold)
    check_choices(choices)
    check_contrast(contrast)
    check_prior(prior)
