"""The equations a worked solution writes, and whether each is right: what the `arithmetic` verifier checks.

An equation is "expression = result" where the expression holds at least one operator (+ - * / x × ÷,
parentheses). It is evaluated over exact rationals and compared with the stated result; a stated
decimal is right when it is the true value rounded to the digits shown ("10 / 3 = 3.33"), and a result
written with 6 or more decimals (a float printed by a program: "16.083333333333336") when it is within
1e-9 of the true value.

Solutions write units inside their working ("15 balls * £8/ball = £120", "91 plants needed - 29 owned =
62", "159.25 meters / 1.75 meters per plant = 91"). A unit is up to three words right after a number or
a closing parenthesis, or "/word" right after a number (a rate's "per"); it is left out of the
expression. Any other word ends the expression: it starts after it ("she is sure of her 20 questions x
95/100 = 19" is "20 * 95/100"). A fraction written without spaces ("2/5") is one number, so "12 ÷ 2/5"
is 30, as a reader takes it. Currency signs are dropped. Chained "a = b + c = d" is split at each "=".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

MAX_UNIT_WORDS = 3  # "plants needed", "meters per plant"; more words than this are a sentence
FLOAT_DECIMALS = 6  # a result printed with this many decimals or more is a float's
FLOAT_TOLERANCE = Fraction(1, 10**9)

_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_LEX = re.compile(r"\s*(?:(?P<frac>\d+/\d+)(?![\d.,/])|(?P<num>" + _NUMBER + r")|(?P<op>[-+*/()])"
                  r"|(?P<word>[A-Za-z][A-Za-z'’-]*))")
# A stated result: a number, a compact fraction ("1/4"), or a percentage ("50.0%": a hundredth of it).
_RHS_RE = re.compile(r"\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?)(?:(/\d+)(?![\d.])|\s*(%))?")
# Where an expression cannot reach back over: sentence punctuation (a "." or "," not inside a number).
_BOUNDARY = re.compile(r"[;:!?\n\"“”%]|\.(?!\d)|(?<!\d)\.|,(?!\d{3})|(?<!\d),")


@dataclass(slots=True, frozen=True)
class Equation:
    """One "expression = result" found in a solution, with what the expression really evaluates to."""

    expression: str
    stated: Fraction
    actual: Fraction
    decimals: int
    floats: bool = False  # an operand printed with FLOAT_DECIMALS decimals or more

    @property
    def correct(self) -> bool:
        if self.floats or self.decimals >= FLOAT_DECIMALS:
            return abs(self.actual - self.stated) <= FLOAT_TOLERANCE * max(1, abs(self.stated))
        if self.decimals == 0:
            return self.actual == self.stated
        # A stated decimal is right when it is the true value rounded to the digits shown (10/3 = 3.33).
        return abs(self.actual - self.stated) <= Fraction(1, 2 * 10**self.decimals)


def _normalise(text: str) -> str:
    text = text.replace("\u2212", "-").replace("\\times", "*").replace("\\cdot", "*")
    text = text.replace("\u00d7", "*").replace("\u00b7", "*")
    text = text.replace("\u00f7", " / ")  # spaced, so that "12÷2/5" divides by the fraction 2/5
    text = re.sub(r"(?<=\d)\s*[xX]\s*(?=[$£€]?\d)", " * ", text)  # "3 x 4", "3x4"
    text = re.sub(r"(?<=[A-Za-z)])\s+[xX]\s+(?=[$£€]?\d)", " * ", text)  # "20 questions x 95/100"
    return re.sub(r"[$£€]", "", text)


def _lex(text: str) -> list[tuple[str, str, int, int]] | None:
    """(kind, text, start, end) tokens of `text`, or None where something else is written."""
    pos, out = 0, []
    text = text.rstrip()
    while pos < len(text):
        m = _LEX.match(text, pos)
        if not m:
            return None
        kind = m.lastgroup
        out.append((kind, m.group(kind), m.start(kind), m.end()))
        pos = m.end()
    return out


def _without_units(tokens: list[tuple[str, str, int, int]]) -> list[str] | None:
    """The expression's tokens with its units left out and implicit products made explicit ("2(3+4)");
    None when a word is not a unit: a sentence, or a variable written against a number ("2x + 160")."""
    out: list[str] = []
    words = 0  # unit words in a row after a number or ")"
    i = 0
    while i < len(tokens):
        kind, tok, start, _ = tokens[i]
        after_value = bool(out) and out[-1] not in "+-*/("
        if kind == "word":
            attached = tokens[i - 1][3] == start and tokens[i - 1][0] in ("num", "frac")
            if not after_value or words >= MAX_UNIT_WORDS or (attached and len(tok) == 1 and tok in "xyzn"):
                return None
            words += 1
        elif kind == "op" and tok == "-" and words and i + 1 < len(tokens) and tokens[i + 1][2] == tokens[i][3] \
                and tokens[i - 1][3] < start:
            return None  # "25 m more gives -40": after words, a minus against its number is a sign
        elif kind == "op" and tok == "/" and after_value and i + 1 < len(tokens) and tokens[i + 1][0] == "word":
            i += 1  # "£8/ball", "km/h": a rate's unit
            words += 1
        else:
            if after_value and (kind in ("num", "frac") or tok == "("):
                if tok != "(" or words:
                    return None  # two values in a row ("5 apples 3"), or "5 apples (..."
                out.append("*")  # "2(91+78)": a product
            out.append(tok)
            words = 0
        i += 1
    return out


class _Parser:
    """Recursive-descent evaluation of + - * / and parentheses over Fractions (exact)."""

    def __init__(self, tokens: list[str]):
        self.t, self.i = tokens, 0

    def parse(self) -> Fraction | None:
        try:
            v = self.expr()
        except (IndexError, ZeroDivisionError, ValueError):
            return None
        return v if self.i == len(self.t) else None

    def expr(self) -> Fraction:
        v = self.term()
        while self.i < len(self.t) and self.t[self.i] in "+-":
            op = self.t[self.i]
            self.i += 1
            r = self.term()
            v = v + r if op == "+" else v - r
        return v

    def term(self) -> Fraction:
        v = self.factor()
        while self.i < len(self.t) and self.t[self.i] in "*/":
            op = self.t[self.i]
            self.i += 1
            r = self.factor()
            v = v * r if op == "*" else v / r
        return v

    def factor(self) -> Fraction:
        tok = self.t[self.i]
        self.i += 1
        if tok == "-":
            return -self.factor()
        if tok == "(":
            v = self.expr()
            if self.t[self.i] != ")":
                raise ValueError("unbalanced")
            self.i += 1
            return v
        if tok in "+*/)":
            raise ValueError("operator where a number belongs")
        return Fraction(tok.replace(",", ""))


def _expression(left: str) -> tuple[list[str], Fraction, bool] | None:
    """The longest whole expression (with an operator) that `left` ends with, its value, and whether an
    operand was printed as a float (FLOAT_DECIMALS decimals or more)."""
    cut = 0
    for m in _BOUNDARY.finditer(left):
        cut = m.end()
    tail = left[cut:]
    tokens = None
    for j in range(len(tail) + 1):  # stray characters ("'s", a bullet) before it: drop until it lexes
        tokens = _lex(tail[j:])
        if tokens is not None:
            break
    if not tokens:
        return None
    for j in range(len(tokens)):
        kind, tok, _, end = tokens[j]
        if kind == "word" or (kind == "op" and tok in "+*/)"):
            continue  # an expression starts with a number, "(" or a minus
        if tok == "-" and (j + 1 == len(tokens) or tokens[j + 1][2] != end):
            continue  # "- 64 plants": a dash or a bullet, not the sign of 64
        sub = _without_units(tokens[j:])
        if sub is None or not any(t in "+-*/" or "/" in t for t in sub):
            continue
        val = _Parser(sub).parse()
        if val is not None:
            floats = any(len(t.partition(".")[2]) >= FLOAT_DECIMALS for t in sub)
            return sub, val, floats
    return None


def _stated(rhs: re.Match) -> tuple[Fraction, int]:
    """A result as written after "=", and its decimals (a percentage's are two more)."""
    number, dec, over, percent = rhs.groups()
    value = Fraction(number.replace(",", ""))
    decimals = len(dec) if dec else 0
    if over:
        return value / int(over[1:]), 0
    if percent:
        return value / 100, decimals + 2
    return value, decimals


def find_equations(solution: str) -> list[Equation]:
    """Every "a op b (op c ...) = r" in `solution`, in order (the module docstring says how it is read)."""
    text = _normalise(solution)
    out: list[Equation] = []
    prev = 0
    for m in re.finditer(r"=", text):
        left = text[prev:m.start()]
        prev = m.end()
        rhs = _RHS_RE.match(text, m.end())
        if rhs is None:
            continue
        found = _expression(left)
        if found is None:
            continue
        sub, val, floats = found
        stated, decimals = _stated(rhs)
        out.append(Equation(" ".join(sub), stated, val, decimals, floats))
    return out
