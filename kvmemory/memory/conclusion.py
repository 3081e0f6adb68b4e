"""Reading what a worked solution concludes: the one value it gives as its answer, or why there is none.

`read_conclusion(solution)` is what the verifiers compare with an expected answer. It never looks at
the expected answer (so it cannot be steered towards it), and it reads the solution as a person does:

1. **A marked answer** anywhere: "#### N", "\\boxed{N}", "The (final) answer is N", "Answer: N". Every
   marked answer must agree; two different ones are ambiguous, not "the last wins".
2. Otherwise **the concluding sentence**: the last sentence that writes a number (a "Check: ..."
   sentence after it does not count), split into clauses at commas, semicolons, colons and words
   such as "so", "which", "because". The concluding clause is the last one that is not a reason
   ("because 7 - 1 = 6", "since ...") or a trailing circumstance (", from 7 boxes"), unless it says
   it concludes ("for a total of 12").
3. In that clause: the result of its last "=" ("so 24 / 2 = 12 cows"); else its one number that is not
   a modifier ("12 cows" in "so she needs 12 cows for 3 fields": "for 3" modifies); else the number a
   verb of result introduces ("the total is 56 apples from 7 boxes"). A list ("30, 31, 32"), an
   expression left unevaluated ("= 4 * 3") or two candidates with nothing to choose between them are
   refused as ambiguous, naming what was found: the verifier then says why it refused.

Values are read by `values.find_values` (separators, decimals, fractions, mixed numbers, units,
currency, percent, number words). Errors are typed: `NoConclusion`, `AmbiguousConclusion`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from kvmemory.errors import InvalidInput
from kvmemory.memory.values import Value, find_values, normalise

__all__ = ["Conclusion", "ConclusionError", "NoConclusion", "AmbiguousConclusion", "read_conclusion", "fmt_value",
           "quote"]


@dataclass(slots=True, frozen=True)
class Conclusion:
    """The value a solution concludes, how it was found ("marker", "equation", "single", "verb") and the
    text it was read from (the marked phrase, or the concluding clause)."""

    value: Fraction
    how: str
    text: str


class ConclusionError(InvalidInput):
    """The solution does not conclude with one value."""


class NoConclusion(ConclusionError):
    """The solution writes no number to conclude with."""


class AmbiguousConclusion(ConclusionError):
    """The conclusion writes several values and does not say which one is the answer."""

    def __init__(self, message: str, candidates: tuple[Fraction, ...] = ()):
        super().__init__(message)
        self.candidates = candidates


def fmt_value(x: Fraction) -> str:
    """A value as a person writes it: 12, 3.5, 3/4 (a fraction when its decimal would not end)."""
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    return f"{float(x):g}" if d == 1 and len(f"{float(x):g}") <= 12 else str(x)


def quote(text: str, limit: int = 80) -> str:
    """`text` quoted for a message, its end kept when it is long (a conclusion's value is at its end)."""
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else "..." + text[-(limit - 3):])


# ---------------------------------------------------------------------------------------------------
# Marked answers
# ---------------------------------------------------------------------------------------------------

_MARKERS = [
    # The rest of the line is read in a lookahead, so that a second marker on the same line is found too.
    re.compile(r"####\s*(?=(?P<rest>[^\n]*))"),
    re.compile(r"\\boxed\s*\{(?P<rest>[^{}]*(?:\{[^{}]*\}[^{}]*)*)\}"),
    re.compile(r"\b(?:final\s+|correct\s+)?answer(?:\s+(?:to|for)\s+[^.\n]{1,60}?)?\s*"
               r"(?:is|was|would\s+be|will\s+be|should\s+be|equals|=|:|-|\u2014)\s*(?=(?P<rest>[^\n]*))",
               re.IGNORECASE),
]
# Words that may stand between a marker or a verb of result and its value ("is therefore 12",
# "is a total of 56", "is: $12").
_FILLER = {"a", "an", "the", "total", "sum", "of", "now", "only", "exactly", "about", "around", "approximately",
           "roughly", "just", "still", "then", "left", "with", "altogether", "all", "in", "together", "therefore",
           "thus", "so", "hence", "equal", "to", "worth", "at", "least", "most", "simply", "clearly", "indeed",
           "be", "is", "are", "will", "would", "final", "answer", "result", "overall", "precisely"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)|\n")


def _only_fillers(text: str) -> bool:
    words = re.findall(r"[A-Za-z']+", text)
    rest = re.sub(r"[A-Za-z'\s:=,$£€¥₹(]+", "", text)
    return not rest and all(w.lower() in _FILLER for w in words)


def _marked(text: str) -> list[tuple[Fraction, str]]:
    """Every marked answer in `text` with the phrase it was read from, in order."""
    hits: list[tuple[int, Fraction, str]] = []
    for pat in _MARKERS:
        for m in pat.finditer(text):
            # the value stands right after the marker: a bounded look keeps a long line from costing n^2
            rest = _SENTENCE_END.split(m.group("rest")[:400], maxsplit=1)[0]
            phrase = (text[m.start():m.end()] + rest).strip()
            if "=" in rest:
                rest = rest.rpartition("=")[2]  # "The answer is 31 + 1 = 32": its result
            values = find_values(rest)
            if not values or not _only_fillers(rest[:values[0].start]):
                continue  # "the answer is the number of cows": no value marked here
            first = values[0]
            _refuse_list_or_expression(rest, values, first, phrase)
            hits.append((m.start(), first.value, phrase))
    return [(v, t) for _, v, t in sorted(hits, key=lambda h: h[0])]


# ---------------------------------------------------------------------------------------------------
# The concluding sentence and clause
# ---------------------------------------------------------------------------------------------------

_CHECK = re.compile(r"^\W*(?:check|checking|verify|verifying|verification|double[- ]check|sanity check|"
                    r"to check|we can check)\b", re.IGNORECASE)
_CLAUSE_SPLIT = re.compile(r";|:\s|,\s+(?![\d$£€¥₹-])|\s+(?=(?:so|thus|therefore|hence|because|since|which|"
                           r"meaning|giving|leaving|then)\b)", re.IGNORECASE)
# A clause that gives a reason is not the conclusion ("because 7 - 1 = 6"); nor is a trailing
# circumstance after a comma (", from 7 boxes", ", after 3 days"), unless it says it concludes.
_REASON = re.compile(r"^\W*(?:because|since|as|given|if|when|while|although|though|whereas)\b", re.IGNORECASE)
_CIRCUMSTANCE = re.compile(r"^\W*(?:from|for|with|in|on|at|by|per|after|before|out\s+of|of|than|over|within|"
                           r"during|excluding|including|not\s+counting|compared)\b", re.IGNORECASE)
_CUE = re.compile(r"\b(?:total|totals|altogether|in\s+all|overall|answer|result|so|thus|therefore|hence|means|"
                  r"finally|sum)\b", re.IGNORECASE)
# A value after one of these modifies something else ("12 boxes of 6", "for 3 days", "more than 5").
_PREPS = {"of", "for", "from", "per", "in", "on", "at", "by", "with", "after", "before", "than", "over", "within",
          "each", "every", "among", "across", "into", "during", "out", "between", "without", "except", "besides"}
# Words that may stand between such a preposition and its number ("without the 4 broken ones").
_DETERMINERS = {"the", "a", "an", "all", "these", "those", "his", "her", "their", "its", "our", "my", "your", "other",
                "another", "first", "last", "next", "remaining", "extra", "additional", "only"}
_NOT_MODIFYING = re.compile(r"\b(?:total|sum|product|difference|all)\s+of\s*$", re.IGNORECASE)
_VERBS = re.compile(r"\b(?:is|are|was|were|be|been|equals?|makes?|made|gives?|gave|comes?\s+to|came\s+to|totals?|"
                    r"has|have|had|gets?|got|costs?|earns?|earned|pays?|paid|spends?|spent|needs?|needed|"
                    r"leaves?|remains?|remained|becomes?|became|amounts?\s+to|amounted\s+to|adds?\s+up\s+to|"
                    r"is\s+left|are\s+left)\b|'s\b", re.IGNORECASE)
_LIST_GAP = re.compile(r"\s*(?:,|,?\s*\b(?:and|or|to)\b|-)\s*[$£€¥₹]?\s*$", re.IGNORECASE)
_OPERATOR_AFTER = re.compile(r"^\s*[-+*/x]\s*[$£€¥₹(]?\s*\d")


def _refuse_list_or_expression(text: str, values: list[Value], v: Value, where: str) -> None:
    i = values.index(v)
    if _OPERATOR_AFTER.match(text[v.end:]):
        raise AmbiguousConclusion(f"the conclusion {quote(where)} ends in an expression ({quote(text[v.start:], 40)}), "
                                  "not a value")
    group = [v]
    for j in range(i + 1, len(values)):  # "30, 31, 32", "3 or 4", "30 to 40"
        if not _LIST_GAP.fullmatch(text[values[j - 1].end:values[j].start]):
            break
        group.append(values[j])
    for j in range(i - 1, -1, -1):
        if not _LIST_GAP.fullmatch(text[values[j].end:values[j + 1].start]):
            break
        group.insert(0, values[j])
    if len(group) > 1:
        raise AmbiguousConclusion(f"the conclusion {quote(where)} lists {', '.join(fmt_value(g.value) for g in group)} "
                                  "and does not say which one is the answer",
                                  tuple(g.value for g in group))


def _is_modifier(clause: str, v: Value) -> bool:
    parens = clause.count("(", 0, v.start) > clause.count(")", 0, v.start)
    before = clause[max(0, v.start - 60):v.start]  # the few words before the number decide
    after = clause[v.end:v.end + 30]
    if _NOT_MODIFYING.search(before):
        return False  # "a total of 56"
    if re.search(r"[A-Za-z]+[\s$£€¥₹]*$", before):  # a word right before the number, not an operator or a comma
        words = [w.lower() for w in re.findall(r"[A-Za-z]+", before[-40:])]
        while words and words[-1] in _DETERMINERS:
            words.pop()
        if words and words[-1] in _PREPS:
            return True
    if re.match(r"-[A-Za-z]", after) or re.match(r"\s*(?:times|x)\b", after, re.IGNORECASE):
        return True  # "a 40-minute episode", "3 times as many"
    return parens  # an aside in parentheses


def _clause_value(clause: str) -> Conclusion:
    """The value a concluding clause gives (see the module docstring, step 3)."""
    if "=" in clause:
        tail_at = clause.rfind("=") + 1
        tail = clause[tail_at:]
        values = find_values(tail)
        if values and _only_fillers(tail[:values[0].start]):
            _refuse_list_or_expression(tail, values, values[0], clause.strip())
            return Conclusion(values[0].value, "equation", clause.strip())
    values = find_values(clause)
    if len(values) == 1:
        _refuse_list_or_expression(clause, values, values[0], clause.strip())
        return Conclusion(values[0].value, "single", clause.strip())
    main = [v for v in values if not _is_modifier(clause, v)]
    if len(main) == 1:
        _refuse_list_or_expression(clause, values, main[0], clause.strip())
        return Conclusion(main[0].value, "single", clause.strip())
    # Several candidates: the one a verb of result introduces ("the total is 56 apples from 7 boxes").
    for verb in reversed(list(_VERBS.finditer(clause))):
        after = [v for v in values if v.start >= verb.end()]
        if after and _only_fillers(clause[verb.end():after[0].start]):
            _refuse_list_or_expression(clause, values, after[0], clause.strip())
            return Conclusion(after[0].value, "verb", clause.strip())
    cands = tuple(dict.fromkeys(v.value for v in (main or values)))
    raise AmbiguousConclusion(f"the conclusion {quote(clause)} writes "
                              f"{', '.join(fmt_value(c) for c in cands)} and does not say which one is the answer",
                              cands)


def _clauses(sentence: str) -> list[str]:
    parts, at = [], 0
    for m in _CLAUSE_SPLIT.finditer(sentence):
        parts.append(sentence[at:m.start()])
        at = m.end() if m.group(0).strip() else m.start()
    parts.append(sentence[at:])
    return [p for p in parts if p.strip()]


def _concluding_clause(sentence: str) -> str:
    with_values = [(i, c) for i, c in enumerate(_clauses(sentence)) if find_values(c)]
    strong = [c for i, c in with_values
              if _CUE.search(c) or not (_REASON.match(c) or (i > 0 and _CIRCUMSTANCE.match(c)))]
    return (strong or [c for _, c in with_values])[-1]


def read_conclusion(solution: str) -> Conclusion:
    """The value `solution` concludes (see the module docstring).

    Raises `NoConclusion` when it writes no number, `AmbiguousConclusion` when its conclusion does not
    single one out (a list, an expression, two marked answers that differ, two candidates)."""
    text = normalise(solution or "")
    marked = _marked(text)
    if marked:
        values = list(dict.fromkeys(v for v, _ in marked))
        if len(values) > 1:
            raise AmbiguousConclusion(
                "the solution marks different answers: "
                + ", ".join(f"{fmt_value(v)} ({quote(t, 40)})" for v, t in dict((v, t) for v, t in marked).items()),
                tuple(values))
        return Conclusion(marked[-1][0], "marker", marked[-1][1])
    sentences = [s for s in _SENTENCE_END.split(text) if s.strip() and find_values(s)]
    if not sentences:
        raise NoConclusion("no final answer found: the solution writes no number")
    # A checking sentence after the conclusion is not the conclusion ("So 12 cows. Check: 12 * 4 = 48 legs.").
    concluding = next((s for s in reversed(sentences) if not _CHECK.match(s)), sentences[-1])
    return _clause_value(_concluding_clause(concluding))
