"""A fixed, general rewording of English word problems, for measuring routing on data kvmemory's own
generator did not write.

`problems.reword` was written together with kvmemory's problem generator and knows its templates; a
router measured with it is measured on phrasings it was built around. This rewording knows nothing
about any dataset: it asks the question (or the "Calculate ..." instruction) first, then states the
facts, and swaps common verbs and phrases for synonyms from one general table. The numbers are all
kept (a rewording asks the same problem, so its stored answer stays right), though reordering the
sentences may change their order.

The table and the rules were written before any result was measured with them and are not tuned on
results (a change here must say so in BENCHMARKS.md). Three changes were made after reading the first
rewordings, before any routing or accuracy figure existed: two entries broke grammar ("each" -> "every"
in "the twins each found", "total" -> "overall" in "in total") and were replaced, and instructions
("Calculate the total ...") now count as the question, as they left some problems unchanged.
"""

from __future__ import annotations

import re

from kvmemory.memory.verifiers import numbers_in

# General English substitutions (word-bounded, first letter's case kept). Only forms whose grammar
# survives any context: "buys" -> "purchases" works wherever "buys" does.
_SYNONYMS = [
    ("buys", "purchases"), ("bought", "purchased"), ("buy", "purchase"),
    ("gets", "receives"), ("got", "received"),
    ("gives", "hands"), ("gave", "handed"),
    ("needs", "requires"), ("wants to", "would like to"),
    ("starts", "begins"), ("started", "began"),
    ("in total", "altogether"), ("how long", "how much time"),
    ("large", "big"), ("quickly", "fast"),
    ("However", "But"), ("makes", "produces"), ("made", "produced"),
    ("uses", "utilizes"), ("finds", "discovers"),
]
_PATTERNS = [(re.compile(rf"\b{re.escape(a)}\b", re.IGNORECASE), b) for a, b in _SYNONYMS]
_SENTENCES = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


# A sentence that asks: a question, or an instruction to work something out ("Calculate the ...").
_ASKING = re.compile(r"^(?:Calculate|Compute|Determine|Find|Work out|Figure out|Estimate)\b")


def _asks(sentence: str) -> bool:
    return sentence.endswith("?") or bool(_ASKING.match(sentence))


def _swap(text: str) -> str:
    for pat, repl in _PATTERNS:
        text = pat.sub(lambda m: repl[0].upper() + repl[1:] if m.group(0)[0].isupper() else repl, text)
    return text


def paraphrase(text: str) -> str:
    """The question asked first, then the facts, with general synonyms; the numbers unchanged."""
    sentences = [s.strip() for s in _SENTENCES.split(text.strip()) if s.strip()]
    questions = [s for s in sentences if _asks(s)]
    facts = [s for s in sentences if not _asks(s)]
    if questions and facts:
        out = " ".join(questions) + " Here is what we know: " + " ".join(facts)
    else:
        out = " ".join(sentences)
    out = _swap(out)
    # Reordering moves whole sentences, so the numbers may come in another order; none may be lost.
    if sorted(numbers_in(out)) != sorted(numbers_in(text)):
        raise AssertionError(f"paraphrase changed the numbers of {text!r}")
    return out
