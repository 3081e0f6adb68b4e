"""A chat turn that asks a remembered problem again is answered from its verified solution.

Free decoding with the entry grafted is what `chat` does for any routed question, and a small model
misreads the entry it was given (issue 48: the embedded SmolLM2 answered "The answer is 2." for 43 with
the right entry grafted). A **recurrence** is a last user turn routed to a verified solution (not a note,
not stored unverified) that writes the same values as its problem (memory/quantities.py) and asks what
it asked (memory/asks.py). Its reply is `KVMemory.answer_from(question, [that entry],
answer_prefix="The answer is", choices="numbers")`: the answer chosen among the numbers of the verified
working, the entry's own answer `DEFAULT_PRIOR` nats ahead, the same as `answer(..., choices="numbers")`
gives that question, so chat is never worse than it. Any other turn (another ask, other numbers, a
note, nothing routed) is decoded freely as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmemory.memory.asks import asks_differ
from kvmemory.memory.quantities import numbers_agree
from kvmemory.memory.verifiers import is_note

ANSWER_PREFIX = "The answer is"


def recurring_hit(question: str, hits: Sequence):
    """The first routed hit whose verified problem `question` asks again, or None."""
    for h in hits:
        e = h.entry
        if (e.verified and not is_note(e) and e.answer is not None and numbers_agree(question, e.problem)
                and asks_differ(question, e.problem) is None):
            return h
    return None


def answer(mem, question: str, hits: Sequence, store_blocks: bool | None = None):
    """`KVMemory.answer_from`'s answer to a recurrence of a routed problem, or None when `question` is
    not one (then the caller decodes freely). `store_blocks`: answer_from's (None: the memory's policy)."""
    hit = recurring_hit(question, hits)
    if hit is None:
        return None
    return mem.answer_from(question, [hit], answer_prefix=ANSWER_PREFIX, choices="numbers", store_blocks=store_blocks)
