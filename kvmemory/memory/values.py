"""Numbers as people write them in worked solutions, read into exact values with their positions.

`find_values(text)` lists every value a (normalised) text writes: integers, thousands separators
("1,250"), decimals ("3.5", ".5"), fractions ("3/4") and mixed numbers ("1 1/2"), a currency sign
before ("$1,250.00", "-$5", "£3") or a percent sign after ("45%": the value 45), a scale word after
("1.2 million"), and numbers written as words ("twelve", "twenty-four", "one hundred and five").
`parse_value(text)` reads a whole given answer ("$1,250", "12 cows", "3/4", "twelve") as one value.
`normalise(text)` is applied first by both: LaTeX and Markdown markup, Unicode minus and fractions,
unit exponents ("cm^2"), so that the number-finding rules stay plain.

What is *not* a value, on purpose: digits glued to a word ("CO2", "m2", "x3"), ordinals ("1st",
"3rd"), clock times ("3:30"), and "one" where it is a pronoun ("one of them", "each one", "the one",
"one by one"); "only one box", "that is one" are the value 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Value", "normalise", "find_values", "parse_value"]


@dataclass(slots=True, frozen=True)
class Value:
    """A value written in a text: its exact value and where it is (`start`/`end` index the text as given)."""

    value: Fraction
    start: int
    end: int
    text: str
    word: bool = False  # written as words ("twelve")


# ---------------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------------

_VULGAR = {"½": "1/2", "⅓": "1/3", "⅔": "2/3", "¼": "1/4", "¾": "3/4", "⅕": "1/5", "⅖": "2/5", "⅗": "3/5",
           "⅘": "4/5", "⅙": "1/6", "⅚": "5/6", "⅛": "1/8", "⅜": "3/8", "⅝": "5/8", "⅞": "7/8"}
_SUBS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"[\u00a0\u2009\u202f\u2007]"), " "),  # non-breaking and thin spaces
    (re.compile(r"[\u2212\u2012\u2013](?=\s?[$£€¥₹]?\d)"), "-"),  # a Unicode minus or dash before a number
    (re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*([\d.,]+)\s*\}"), r"\1/\2"),
    (re.compile(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}"), r"\1"),
    (re.compile(r"(?<=\d)\\[,!;: ](?=\d{3})"), ""),  # LaTeX thin space as a thousands separator: 1\,250
    (re.compile(r"(?<=\d)\{,\}(?=\d{3})"), ","),  # 1{,}250
    (re.compile(r"\\([$%])"), r"\1"),
    (re.compile(r"\\(?:left|right)(?=[()\[\]|])|\\[()\[\]]|\\[,!;:]|\\quad|\\qquad"), " "),
    (re.compile(r"\\times|\\cdot|[×·∙]"), "*"),
    (re.compile(r"÷|\\div"), "/"),
    (re.compile(r"≈|\\approx"), "="),
    (re.compile(r"\*\*|__"), ""),  # Markdown bold; a single * stays multiplication
    (re.compile(r"(?<=[A-Za-z])(?:\^\{?[23]\}?|[²³])"), ""),  # a unit's exponent: cm^2, m³
    (re.compile(r"⁄"), "/"),
]


def normalise(text: str) -> str:
    """`text` with markup and typography rewritten to plain ASCII arithmetic (see the module docstring).

    Positions in the result do not map back to the input; callers work on the normalised text."""
    if not text:
        return ""
    for ch, frac in _VULGAR.items():
        # "1½" is the mixed number 1 1/2; a lone "½" is 1/2
        text = re.sub(r"(?<=\d)" + ch, " " + frac, text).replace(ch, frac)
    for pat, rep in _SUBS:
        text = pat.sub(rep, text)
    return text


# ---------------------------------------------------------------------------------------------------
# Digits
# ---------------------------------------------------------------------------------------------------

_CUR = r"[$£€¥₹]"
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_DIGITS_RE = re.compile(
    r"(?<![\w.:,/\\])"  # not glued to a word ("CO2"), a decimal point, a clock ("3:30") or a fraction bar
    r"(?P<neg>-\s?)?(?P<cur>" + _CUR + r"\s?)?(?P<neg2>-)?"
    r"(?:(?P<whole>\d+)\s+(?=\d+/\d))?"  # the whole part of a mixed number: "1 1/2"
    r"(?P<num>" + _NUMBER + r")"
    r"(?:/(?P<den>\d+(?:\.\d+)?))?"  # a fraction written without spaces: "3/4" (not "3 / 4": that is a division)
    r"(?P<pct>\s?%)?"
    r"(?:\s+(?P<scale>thousand|million|billion|trillion)\b)?"
    r"(?![\d]|[.,]\d|:\d|(?:st|nd|rd|th)\b)"  # not the start of a longer number, a clock, or an ordinal
)


def _sign_allowed(text: str, at: int) -> bool:
    """A '-' at `at` is a sign (not a subtraction) when nothing value-like stands right before it."""
    before = text[:at].rstrip()
    if not before:
        return True
    if before[-1].isdigit() or before[-1] in ")%":
        return False  # "5 - 3", "(2+3) - 1", "50% - 25%": an operator
    return True


def _digit_values(text: str) -> list[Value]:
    out = []
    for m in _DIGITS_RE.finditer(text):
        if len(m.group("num")) > 60 or len(m.group("den") or "") > 60:
            continue  # nobody writes such a number; Python refuses to convert very long digit strings
        start = m.start()
        neg = False
        if m.group("neg") or m.group("neg2"):
            if _sign_allowed(text, m.start()):
                neg = True
            elif m.group("neg"):
                start = m.start("cur") if m.group("cur") else m.start("num")  # the minus is an operator
                if m.group("whole"):
                    start = m.start("whole")
        num = Fraction(m.group("num").replace(",", ""))
        if m.group("den"):
            den = Fraction(m.group("den"))
            if den == 0:
                continue
            num /= den
        if m.group("whole"):
            num += int(m.group("whole"))
        if m.group("scale"):
            num *= _SCALES[m.group("scale")]
        out.append(Value(-num if neg else num, start, m.end(), text[start:m.end()]))
    return out


# ---------------------------------------------------------------------------------------------------
# Words
# ---------------------------------------------------------------------------------------------------

_UNITS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                      "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_WORD = "|".join(sorted([*_UNITS, *_TENS, "hundred", *_SCALES], key=len, reverse=True))
_WORDS_RE = re.compile(r"(?<![\w-])(?P<neg>negative\s+|minus\s+(?=(?:" + _WORD + r")\b))?"
                       r"(?P<w>(?:" + _WORD + r")(?:(?:\s+and\s+|[\s-]+)(?:" + _WORD + r"))*)\b(?!-\w)",
                       re.IGNORECASE)


def _words_value(words: list[str]) -> int | None:
    """The integer that a run of number words names ("two thousand five hundred and six"), or None."""
    total, current, last = 0, None, None
    for w in words:
        if w in _UNITS or w in _TENS:
            n = _UNITS.get(w, _TENS.get(w))
            if current is None:
                current = n
            elif last in _TENS and w in _UNITS and 0 < n < 10:
                current += n  # twenty-four
            elif last == "hundred" or last in _SCALES:
                current = (current or 0) + n if last == "hundred" else n
            else:
                return None  # "two three": two numbers, not one
        elif w == "hundred":
            if current is None or current % 100 == 0 and current >= 100:
                return None
            current = current * 100
        else:  # thousand, million, ...
            if current is None:
                return None
            total += current * _SCALES[w]
            current = None
        last = w
    return total + (current or 0)


# "one" is a pronoun after these words or before these ("the one", "each one", "one of them", "one by one").
_PRONOUN_BEFORE = re.compile(r"\b(?:the|each|every|this|that|which|no|any|some|another|other|a|an|one)\s+$",
                             re.IGNORECASE)
_PRONOUN_AFTER = re.compile(r"^\s*(?:of|another|by|or|'s|who|which|that)\b|^'s", re.IGNORECASE)


def _word_values(text: str) -> list[Value]:
    out = []
    for m in _WORDS_RE.finditer(text):
        words = [w.lower() for w in re.split(r"(?:\s+and\s+|[\s-]+)", m.group("w")) if w]
        if words == ["one"] and (_PRONOUN_BEFORE.search(text[:m.start()]) or _PRONOUN_AFTER.match(text[m.end():])):
            continue  # a pronoun, not a number
        if words[0] in _SCALES or words[0] == "hundred":
            continue  # "thousands of": no count
        n = _words_value(words)
        if n is None:
            continue
        if m.group("neg") and m.group("neg").lower().startswith("minus") and not _sign_allowed(text, m.start()):
            continue
        out.append(Value(Fraction(-n if m.group("neg") else n), m.start(), m.end(), m.group(0), word=True))
    return out


# ---------------------------------------------------------------------------------------------------
# Public readers
# ---------------------------------------------------------------------------------------------------


def find_values(text: str) -> list[Value]:
    """Every value written in `text` (already normalised), in order; digits win over an overlapping word."""
    digits = _digit_values(text)
    words = [w for w in _word_values(text)
             if not any(d.start < w.end and w.start < d.end for d in digits)]
    return sorted(digits + words, key=lambda v: v.start)


# What may surround a given answer's single value: a unit or a noun ("12 cows", "3.5 km", "cm^2").
_ANSWER_REST = re.compile(r"[\s\w.,/^()'%-]*")


def parse_value(text: str | int | float | Fraction) -> Fraction | None:
    """A given answer as one exact value, or None when it does not write exactly one.

    Accepts what `find_values` reads, with units or a noun around it ("12 cows", "$1,250.00",
    "3.5 km", "1 1/2", "twelve", "45%"). A float goes through its shortest repr (1903.5, not its
    binary value). "3 or 4" and "about half" are not one value: None."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, Fraction)):
        return Fraction(text)
    if isinstance(text, float):
        text = repr(text)
    s = normalise(str(text)).strip().rstrip(".")
    s = re.sub(r"(?<=\d)\s+/\s+(?=\d)", "/", s)  # an answer "-7 / 2" is the fraction, as a division would be
    values = find_values(s)
    if len(values) != 1:
        return None
    v = values[0]
    if not _ANSWER_REST.fullmatch(s[:v.start] + " " + s[v.end:]):
        return None
    return v.value
