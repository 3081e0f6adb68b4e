"""Typed errors the framework adapters raise (all of them kvmemory errors too).

Each says what happened and what to do; bad input is refused before it reaches the model or the store.
"""

from __future__ import annotations

from kvmemory.errors import InvalidInput, KVMemoryError


class UnsupportedContent(InvalidInput):
    """A message block the model cannot read (an image, audio, a file): the embedded model is text-only."""


class ToolChoiceError(InvalidInput):
    """A `tool_choice` that names no bound tool, or a forced tool call with no tools bound."""


class GuidedDecodingError(KVMemoryError):
    """The model's output for a schema-guided value could not be read as that value's type."""


class UnknownOption(InvalidInput, TypeError):
    """An option (a constructor field or a call's keyword argument) the adapter does not know: refused
    rather than ignored, so a misspelt option is an error. A TypeError too, as Python's own for an
    unexpected keyword argument."""
