"""Typed errors of the LangChain integration (all of them are kvmemory errors too).

Each says what happened and what to do; bad input is refused before it reaches the model or the store.
The ones every framework adapter raises are kvmemory's own (`kvmemory.UnsupportedContent`,
`ToolChoiceError`, `GuidedDecodingError`), named here too.
"""

from __future__ import annotations

from kvmemory import GuidedDecodingError, InvalidInput, ToolChoiceError, UnsupportedContent


class InvalidNamespace(InvalidInput):
    """A LangGraph namespace that cannot be mapped to a kvmemory namespace."""


__all__ = ["GuidedDecodingError", "InvalidNamespace", "ToolChoiceError", "UnsupportedContent"]
