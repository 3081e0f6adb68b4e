"""What `KVMemory.answer(choices=...)` offers the model, and which offered number a routed entry verified.

`choices="numbers"` offers every number written in the routed entries' solutions (inputs, intermediate
results, answers), in order of first appearance, each once. A routed entry that is a verified solution
(not a note, not stored unverified) also knows its answer: `verified_answers` gives those values, and
`is_known` says whether an offered number is one of them (compared as exact rationals, so "12.0",
"12" and "$12" are the same answer). `answers.choose` adds its `prior` to those choices' scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from kvmemory.errors import InvalidInput
from kvmemory.memory.inputs import check_text
from kvmemory.memory.prompts import solution_text
from kvmemory.memory.verifiers import extract_value, is_note, numbers_in


def offered(choices: str | Sequence[str] | None, entries: Sequence) -> list[str]:
    """The choices `answer` scores: `choices` itself (stripped, each once) or, for "numbers", the numbers
    of the entries' solutions; [] when `choices` is None."""
    if choices is None:
        return []
    if isinstance(choices, str):
        if choices != "numbers":
            raise InvalidInput(f'choices must be "numbers" or a list of strings, got {choices!r}')
        return list(dict.fromkeys(n for e in entries for n in numbers_in(solution_text(e.solution, e.answer))))
    out = [check_text("choice", c) for c in choices]
    if not out:
        raise InvalidInput("choices is empty")
    return list(dict.fromkeys(c.strip() for c in out))


def verified_answers(entries: Sequence) -> set[Fraction]:
    """The answers the verified solutions among `entries` concluded, as exact values."""
    out = set()
    for e in entries:
        if e.verified and not is_note(e) and e.answer is not None and (v := extract_value(str(e.answer))) is not None:
            out.add(v)
    return out


def is_known(choice: str, known: set[Fraction]) -> bool:
    """Whether the offered `choice` has one of the `known` values."""
    return extract_value(choice) in known
