"""The text of a decode as it grows one token at a time, as deltas that never show half a character.

A byte-level BPE tokenizer can split one character's UTF-8 bytes across two tokens (common for CJK
text and emoji). Decoding the tokens so far then ends in U+FFFD, the replacement character, until the
next token completes the bytes. A stream that forwarded that U+FFFD could never take it back, so the
text a client assembled from the deltas would differ from the final answer. `TokenText` holds back a
trailing U+FFFD until the next token settles it, and `rest()` releases what is still held when the
decode ends (a U+FFFD the model really produced is then shown, as it is in the final text).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

_REPLACEMENT = "\ufffd"


class TokenText:
    """Deltas of `decode(tokens so far)`: `add(token)` returns the newly settled text."""

    def __init__(self, decode: Callable[[Sequence[int]], str], skip: Collection[int] = ()):
        self._decode = decode
        self._skip = set(skip)  # tokens left out of the text (e.g. EOS)
        self.tokens: list[int] = []
        self.text = ""  # the decoded text of every token so far (may end in U+FFFD)
        self.shown = ""  # what the deltas have added up to

    def _delta(self, settled: str) -> str:
        # Decoding a longer sequence only appends to a settled prefix; if a tokenizer ever rewrote
        # it, nothing is shown until the text continues what was shown again (the final answer,
        # which consumers take from the result, is unaffected).
        if len(settled) <= len(self.shown) or not settled.startswith(self.shown):
            return ""
        delta, self.shown = settled[len(self.shown):], settled
        return delta

    def add(self, token: int) -> str:
        self.tokens.append(token)
        if token in self._skip:
            return ""
        self.text = self._decode([t for t in self.tokens if t not in self._skip])
        return self._delta(self.text.rstrip(_REPLACEMENT))

    def rest(self) -> str:
        """What is still held back once the decode has ended."""
        return self._delta(self.text)
