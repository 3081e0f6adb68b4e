"""The numbers a question writes, however it writes them: what routing compares to tell a rewording of a
stored problem (the same numbers) from a sibling (other numbers).

`question_numbers(text)` is the set of values in `text`, read the same way whether they are digits or
words, with or without notation:

- digits, thousands separators, decimals, fractions, currency and percent signs, unit exponents, as
  `values.find_values` reads them ("1,200 L" and "1200 liters" are 1200; "$9.00" is 9; "cm^2" writes
  no 2; "3/4" is 0.75);
- number words, also where `find_values` leaves them: glued to a noun by a hyphen ("a ten-dollar
  bill", "a four-hundred-meter track"), in lists ("seventy-eight, eighty-five and ninety-two"), a bare
  "hundred" ("every hundred kilometres"), decimals said aloud ("three point six"), halves and quarters
  ("two and a half" is 2.5, "one quarter" is 1/4), "twice", "a dozen";
- money in cents ("ten cents" is 0.10 dollars, "three dollars and fifty cents" 3.50);
- a unit after a slash ("6 L/100 km": 100);
- clock times as times of day ("10 pm", "22:00" and "ten p.m." are the same time; "6:30 am" is not 6 and 30).

Signs are dropped (a rewording writes "minus four degrees" or "falls 4 degrees" or "-4 °C" for the same
fact) and so is the value 1 (English writes it as an article: "one lap" and "a lap", "per chocolate" and
"the cost of one chocolate"). A sibling changes a value, so its set differs all the same.
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvmemory.memory.values import find_values, normalise

__all__ = ["question_numbers", "numbers_agree"]

_UNITS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                      "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9}
_NUMBER_WORDS = {*_UNITS, *_TENS, "hundred", *_SCALES}
_TOKEN = re.compile(r"[A-Za-z]+|\d+(?:[.,]\d+)*")


class _Num:
    """A number being read from words: its value so far and the group rules of English numbers."""

    def __init__(self) -> None:
        self.total = 0  # the part before the last scale word (thousand, million)
        self.group = 0  # below a thousand
        self.last = ""  # "unit" (1-9), "teen" (0, 10-19), "tens", "hundred", "scale"

    @property
    def value(self) -> int:
        return self.total + self.group

    def take(self, w: str) -> bool:
        """Add word `w` when it continues this number ("twenty" + "four"), else False (a new number)."""
        last = self.last
        if w in _UNITS:
            n = _UNITS[w]
            kind = "unit" if 1 <= n <= 9 else "teen"
            if last == "" or (last == "tens" and kind == "unit") or last in ("hundred", "scale"):
                self.group += n
                self.last = kind
                return True
            return False
        if w in _TENS:
            if last in ("", "hundred", "scale"):
                self.group += _TENS[w]
                self.last = "tens"
                return True
            return False
        if w == "hundred":
            if last == "" or (last in ("unit", "teen") and 0 < self.group < 100):
                self.group = (self.group or 1) * 100
                self.last = "hundred"
                return True
            return False
        if w in _SCALES:
            if last == "scale":
                return False
            self.total += (self.group or 1) * _SCALES[w]
            self.group = 0
            self.last = "scale"
            return True
        return False


def _words_to_digits(text: str) -> str:
    """`text` with its number words written as digits (and the phrasings the module docstring lists)."""
    toks = [(m.group(0), m.start(), m.end()) for m in _TOKEN.finditer(text)]
    out: list[str] = []
    pos = 0
    i = 0
    low = [t[0].lower() for t in toks]

    def sep_ok(a: int, b: int) -> bool:  # only spaces or one hyphen between tokens a and b
        gap = text[toks[a][2]:toks[b][1]]
        return gap.strip() in ("", "-")

    while i < len(toks):
        w = low[i]
        value: Fraction | None = None
        j = i
        if w in _NUMBER_WORDS:
            num = _Num()
            num.take(w)
            j = i + 1
            while j < len(toks):
                if low[j] == "and" and num.last in ("hundred", "scale") and j + 1 < len(toks) and \
                        low[j + 1] in _NUMBER_WORDS and sep_ok(j - 1, j) and sep_ok(j, j + 1):
                    probe = _Num()
                    probe.__dict__.update(num.__dict__)
                    if probe.take(low[j + 1]):
                        num = probe
                        j += 2
                        continue
                    break
                if low[j] in _NUMBER_WORDS and sep_ok(j - 1, j) and num.take(low[j]):
                    j += 1
                    continue
                break
            value = Fraction(num.value)
            # "three point six"
            if j + 1 < len(toks) and low[j] == "point" and low[j + 1] in _UNITS and _UNITS[low[j + 1]] < 10:
                digits = ""
                k = j + 1
                while k < len(toks) and low[k] in _UNITS and _UNITS[low[k]] < 10 and sep_ok(k - 1, k):
                    digits += str(_UNITS[low[k]])
                    k += 1
                value = Fraction(f"{num.value}.{digits}")
                j = k
            # "two and a half", "one and three quarters"
            if j + 2 < len(toks) and low[j] == "and" and low[j + 1] in ("a", "one") and low[j + 2] in ("half", "quarter"):
                value += Fraction(1, 2) if low[j + 2] == "half" else Fraction(1, 4)
                j += 3
            elif j + 2 < len(toks) and low[j] == "and" and low[j + 1] in _UNITS and low[j + 2] in ("quarters", "thirds"):
                value += Fraction(_UNITS[low[j + 1]], 4 if low[j + 2] == "quarters" else 3)
                j += 3
            # "one quarter", "three quarters", "one half", "two thirds" (not "the third day": a count comes first)
            elif j < len(toks) and low[j] in ("half", "halves", "quarter", "quarters", "third", "thirds") and \
                    sep_ok(j - 1, j) and (num.value > 1 or low[j] in ("half", "quarter", "third")):
                den = {"half": 2, "halves": 2, "quarter": 4, "quarters": 4, "third": 3, "thirds": 3}[low[j]]
                value = Fraction(num.value, den)
                j += 1
            elif j < len(toks) and low[j] in ("dozen", "dozens") and sep_ok(j - 1, j):
                value = Fraction(num.value * 12)
                j += 1
        elif w in ("a", "an") and i + 1 < len(toks) and low[i + 1] in ("half", "quarter", "dozen", "hundred", "thousand"):
            value = {"half": Fraction(1, 2), "quarter": Fraction(1, 4), "dozen": Fraction(12),
                     "hundred": Fraction(100), "thousand": Fraction(1000)}[low[i + 1]]
            j = i + 2
        elif w == "half" and i + 1 < len(toks) and low[i + 1] in ("of", "as", "the", "a", "an"):
            value, j = Fraction(1, 2), i + 1
        elif w == "twice":
            value, j = Fraction(2), i + 1
        elif w == "thrice":
            value, j = Fraction(3), i + 1
        elif w == "dozen":
            value, j = Fraction(12), i + 1
        if value is None:
            i += 1
            continue
        out.append(text[pos:toks[i][1]])
        out.append(_fmt(value))
        pos = toks[j - 1][2]
        i = j
    out.append(text[pos:])
    return "".join(out)


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


_MONEY_CENTS = re.compile(r"(?<![\w.])\$?(\d+)\s*(?:-\s*)?dollars?\s+and\s+(\d{1,2})\s*(?:-\s*)?cents?\b", re.I)
_CENTS = re.compile(r"(?<![\w.$/])(\d+(?:\.\d+)?)\s*(?:-\s*)?(?:cents?|¢)(?!\w)", re.I)
_PER_UNIT = re.compile(r"(?<=[A-Za-z%])/(?=\d)")  # "6 L/100 km": a slash between a unit and a number
_AMPM = r"(?:a\.\s?m\.?|p\.\s?m\.?|am|pm)"
_TIME_12 = re.compile(r"(?<![\w.:,/])(\d{1,2})(?:[:.\s](\d{2}))?\s*(" + _AMPM + r")(?![A-Za-z])", re.I)
_TIME_24 = re.compile(r"(?<![\w.:,/])(\d{1,2}):(\d{2})(?![\d:])")


def _times(text: str) -> tuple[str, set]:
    """Clock times taken out of `text`, as ("time", minutes after midnight)."""
    found: set = set()

    def t12(m: re.Match) -> str:
        h, mm, ap = int(m.group(1)), int(m.group(2) or 0), m.group(3).lower()
        if not (1 <= h <= 12 and mm < 60):
            return m.group(0)
        found.add(("time", (h % 12 + (12 if ap.startswith("p") else 0)) * 60 + mm))
        return " "

    def t24(m: re.Match) -> str:
        h, mm = int(m.group(1)), int(m.group(2))
        if not (h < 24 and mm < 60):
            return m.group(0)
        found.add(("time", h * 60 + mm))
        return " "

    text = _TIME_12.sub(t12, text)
    text = _TIME_24.sub(t24, text)
    return text, found


def question_numbers(text: str) -> frozenset:
    """The values `text` writes (the module docstring says how): Fractions without sign, the value 1
    left out, and clock times as ("time", minutes). Empty when it writes none."""
    t = normalise(text or "")
    t = _words_to_digits(t)
    t = _MONEY_CENTS.sub(lambda m: f"${int(m.group(1)) + Fraction(int(m.group(2)), 100)} ", t)
    t = _CENTS.sub(lambda m: f"${Fraction(m.group(1)) / 100} ", t)
    t = _PER_UNIT.sub(" per ", t)
    t, found = _times(t)
    for v in find_values(t):
        x = abs(v.value)
        if x != 1:
            found.add(x)
    return frozenset(found)


def numbers_agree(question: str, problem: str) -> bool | None:
    """True when `question` writes the same values as `problem` (some), False when other values, None when
    either writes none (nothing to compare)."""
    q, p = question_numbers(question), question_numbers(problem)
    if not q or not p:
        return None
    return q == p
