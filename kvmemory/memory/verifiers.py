"""Verifiers: what decides whether a solution may enter the store, and reading answers out of text.

`remember` runs a verifier before it computes a single block: `exact-answer` checks that what the
solution concludes is the given answer, `arithmetic` also re-checks every equation the solution writes
(exact rational arithmetic, units and all: memory/equations.py), `none` accepts anything (the entry is then marked unverified unless a
verifier said yes). What a solution concludes is read by `conclusion.read_conclusion`: a marked answer
("#### N", "The answer is N", "\\boxed{N}"), else its concluding sentence ("..., so 12 cows."); a
conclusion that is ambiguous is refused with the reason. Answers are compared as exact rationals:
"1903.5", "$1,903.50", "3807/2", "1 1/2", "twelve" are values (`values.parse_value`).

`extract_answer` / `extract_value` read the final number out of *model output* (a free decode that may
ramble, where the last number written is the best guess); `numbers_in` lists the numbers a text writes
(the facade's number check and its `choices="numbers"` use it). They are not what the verifiers use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Protocol, runtime_checkable

from kvmemory.errors import InvalidInput
from kvmemory.memory.conclusion import ConclusionError, fmt_value, quote, read_conclusion
from kvmemory.memory.equations import find_equations
from kvmemory.memory.values import parse_value

__all__ = [
    "extract_answer",
    "extract_value",
    "find_equations",
    "numbers_in",
    "VerifierResult",
    "Verifier",
    "ExactAnswerVerifier",
    "ArithmeticVerifier",
    "NoneVerifier",
    "NoteVerifier",
    "is_note",
    "kind_of",
    "verifier_by_name",
    "VERIFIERS",
]

# ---------------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------------

# A number: thousands groups with commas, or plain digits; optional decimals; a minus only when it is not
# the minus of a subtraction ("5-3" gives 5 and 3, "= -3" gives -3).
_NUM = r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<=\w)(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUM_RE = re.compile(_NUM)
_MONEY = r"\$?\s*"
# An answer's value: a number, or a fraction of two ("3/4", "-7 / 2"); "12/4 = 3" reads as its result.
_VALUE = r"((?:" + _NUM + r")(?:\s*/\s*\d+(?!\d|\.\d))?)"
_ANSWER_PATTERNS = [
    re.compile(r"answer\s*(?:is|:|=|was)\s*[:=]?\s*(?:\*\*)?\s*" + _MONEY + _VALUE, re.IGNORECASE),
    re.compile(r"\\boxed\{\s*" + _MONEY + _VALUE + r"\s*\}"),
    re.compile(r"####\s*" + _MONEY + _VALUE),
    re.compile(r"\*\*\s*" + _MONEY + _VALUE + r"\s*\*\*"),
    re.compile(r"=\s*" + _MONEY + _VALUE),
]


def _to_value(s: str) -> Fraction | None:
    num, _, den = s.replace(",", "").replace(" ", "").partition("/")
    value = Fraction(num)
    if den:
        if Fraction(den) == 0:
            return None
        value /= Fraction(den)
    return value


def extract_value(text: str) -> Fraction | None:
    """The final answer in model output as an exact rational, or None.

    Tried in order, last occurrence wins within a rule: "The answer is N" / "Answer: N", "\\boxed{N}",
    "#### N", "**N**", "= N", then the last number in the text. N may be an integer, a decimal (1903.5)
    or a fraction (3/4); commas and a leading "$" are accepted.
    """
    if not isinstance(text, str) or not text:
        return None
    for pat in _ANSWER_PATTERNS:
        hits = pat.findall(text)
        if hits:
            return _to_value(hits[-1])
    nums = _NUM_RE.findall(text)
    return _to_value(nums[-1]) if nums else None


def extract_answer(text: str) -> int | None:
    """The final integer answer in model output, or None (see `extract_value`); a non-integral final
    answer (3.5, 3/4) gives None rather than a wrong integer."""
    value = extract_value(text)
    return int(value) if value is not None and value.denominator == 1 else None


def numbers_in(text: str) -> list[str]:
    """The numbers written in `text`, in order of first appearance, without thousands commas."""
    return list(dict.fromkeys(n.replace(",", "") for n in _NUM_RE.findall(text or "")))


# ---------------------------------------------------------------------------------------------------
# Verifiers
# ---------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class VerifierResult:
    ok: bool
    detail: str


@runtime_checkable
class Verifier(Protocol):
    """Decides whether a solution may be stored as verified. `name`/`version` are recorded per entry."""

    name: str
    version: str

    def __call__(self, problem: str, solution: str, answer: str | None) -> VerifierResult: ...


def _parse_given_answer(answer: str | int | float | Fraction | None) -> Fraction | None:
    return None if answer is None else parse_value(answer)


def _no_answer(answer) -> bool:
    return answer is None or (isinstance(answer, str) and not answer.strip())


class ExactAnswerVerifier:
    """OK when what the solution concludes (`conclusion.read_conclusion`) equals the expected answer,
    which must be given, as exact rationals: 1903.5 = 1903.50 = 3807/2. Refused, with the reason: another
    value, no number, or a conclusion that does not single one value out."""

    name = "exact-answer"
    # 1 compared integers only and refused decimal / fractional answers; 2 read the last equation's
    # result ("= 31, so they are 30, 31, 32. Largest is 32." gave 31); 3 reads the conclusion.
    version = "3"

    def __call__(self, problem: str, solution: str, answer: str | None) -> VerifierResult:
        if _no_answer(answer):
            return VerifierResult(False, "exact-answer verifier needs the expected answer; none was given")
        want = _parse_given_answer(answer)
        if want is None:
            return VerifierResult(False, f"expected answer {quote(str(answer), 40)} is not one number")
        try:
            got = read_conclusion(solution or "")
        except ConclusionError as e:
            return VerifierResult(False, str(e))
        if got.value != want:
            return VerifierResult(False, f"solution's final answer {fmt_value(got.value)} != expected "
                                         f"{fmt_value(want)} (read from {quote(got.text)})")
        return VerifierResult(True, f"final answer {fmt_value(got.value)} matches (read from {quote(got.text)})")


class ArithmeticVerifier:
    """OK when every "a op b = c" in the solution is right and its conclusion is the expected answer.

    With no expected answer the conclusion must be the last equation's result: nothing else ties it to
    the working. A solution with no equations is refused: there is nothing to check, so it cannot be
    called verified.
    """

    name = "arithmetic"
    # 1 read integer final answers only; 2 took the last equation's result as the final answer;
    # 3 reads the conclusion, and needs it to be the last result only when no answer is given;
    # 4 reads equations with units inside them and compact fractions (memory/equations.py).
    version = "4"

    def __call__(self, problem: str, solution: str, answer: str | None) -> VerifierResult:
        eqs = find_equations(solution or "")
        if not eqs:
            return VerifierResult(False, "no equations to check in the solution")
        for e in eqs:
            if not e.correct:
                return VerifierResult(False, f"wrong arithmetic: {e.expression} = {_fmt(e.stated)}"
                                             f" (it is {_fmt(e.actual)})")
        try:
            final = read_conclusion(solution).value
        except ConclusionError as e:
            return VerifierResult(False, str(e))
        if _no_answer(answer):
            last = eqs[-1].stated
            if final != last:
                return VerifierResult(False, f"final answer {fmt_value(final)} is not the last result {_fmt(last)}"
                                             " (give the expected answer to verify a conclusion the last"
                                             " equation does not state)")
        else:
            want = _parse_given_answer(answer)
            if want is None:
                return VerifierResult(False, f"expected answer {quote(str(answer), 40)} is not one number")
            if want != final:
                return VerifierResult(False, f"final answer {fmt_value(final)} != expected {fmt_value(want)}")
        return VerifierResult(True, f"{len(eqs)} equations correct; final answer {fmt_value(final)}")


class NoneVerifier:
    """Never verifies: used when a caller stores a solution without a verifier (it is marked unverified)."""

    name = "none"
    version = "1"

    def __call__(self, problem: str, solution: str, answer: str | None) -> VerifierResult:
        return VerifierResult(False, "no verifier: unverified")


class NoteVerifier:
    """What a note (a statement remembered without a solution: memory/notes.py) is stored with: nothing
    verifies a statement, so a note is always unverified, and its entry says it is a note. Not in
    `VERIFIERS` (it is not a choice for a solution); `verifier_by_name("note")` finds it, so `update`
    of a note keeps it one."""

    name = "note"
    version = "1"

    def __call__(self, problem: str, solution: str, answer: str | None) -> VerifierResult:
        return VerifierResult(False, "a note: a statement kept as it was said; nothing verifies it")


def is_note(entry) -> bool:
    """Whether an entry (an EntryRecord) is a note: stored with the note verifier (memory/notes.py)."""
    return (getattr(entry, "verifier", None) or {}).get("name") == NoteVerifier.name


def kind_of(entry) -> str:
    """An entry's kind: "note" or "solution"."""
    return "note" if is_note(entry) else "solution"


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"


VERIFIERS: dict[str, Callable[[], Verifier]] = {
    ExactAnswerVerifier.name: ExactAnswerVerifier,
    ArithmeticVerifier.name: ArithmeticVerifier,
    NoneVerifier.name: NoneVerifier,
}


def verifier_by_name(name: str) -> Verifier:
    """A fresh verifier of that name: "exact-answer", "arithmetic" or "none" (or "note": a note's)."""
    if name == NoteVerifier.name:
        return NoteVerifier()
    try:
        return VERIFIERS[name]()
    except KeyError:
        raise InvalidInput(f"unknown verifier {name!r}; known: {', '.join(sorted(VERIFIERS))}") from None
