"""Verifier bench: how often the verifiers refuse a correct solution and accept a wrong one.

Correct sets (every refusal is a false refusal):

- `gsm-marked`: GSM-Symbolic worked solutions as the dataset writes them, ending "#### N" (what
  `kvmemory bench recurring --dataset gsm-symbolic` stores), `--problems` of them drawn from all 85
  usable templates in turn (`gsm_symbolic.draw_solutions`);
- `gsm-unmarked`: the same solutions with the "#### N" line removed, so that the working's own last
  sentence (written by GSM8K's authors, e.g. "She can invite 6 friends because 7 - 1 = 6") concludes;
- `gsm-sentence`: the same solutions with "#### N" replaced by a concluding sentence
  (`conclude_in_sentence`: one of 20 phrasings, 4 of them with another number of the question beside
  the answer; the number plain, with thousands separators, as money or in words; the question's noun
  as a unit or not; all chosen by a seed);
- `handwritten`: `verifier_cases.HAND_CASES`, written for this bench alongside the verifier;
- `handwritten-heldout`: `verifier_cases.HELDOUT_CASES`, written after it (its first run is in
  BENCHMARKS.md: one refusal, fixed since, so it is no longer held out).

Wrong sets (every acceptance is a false acceptance), two per correct set:

- `<set>/wrong-conclusion`: the conclusion changed to another number (half of the time one the
  working writes, so "the answer appears somewhere" does not pass), the expected answer kept;
- `<set>/wrong-expected`: the solution kept, the expected answer changed (the same way).

Both verifiers that check an answer run on every set: `exact-answer` (what `remember` uses with an
answer) and `arithmetic`. `--verifiers-file` measures another implementation of them (a verifiers.py
from another commit) on the same sets. Run as `python -m kvmemory.bench.verifier [--json]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

__all__ = ["Case", "conclude_in_sentence", "build_sets", "measure", "main"]

_NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                 "sixteen seventeen eighteen nineteen").split()
_TENS_WORDS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
# How a concluding sentence may be phrased: {n} is the number as written, {u} " <noun>" or "".
SENTENCES = (
    "So the answer is {n}{u}.",
    "That makes {n}{u} in total.",
    "Therefore, {n}.",
    "So {n}{u}.",
    "The final answer is {n}.",
    "Answer: {n}{u}",
    "The answer is \\boxed{{{n}}}.",
    "In total, that is {n}{u}.",
    "So we get {n}{u} altogether.",
    "Hence the result is {n}{u}.",
    "This gives {n}{u}.",
    "We end up with {n}{u}.",
    "{N}{u} is the answer.",
    "All in all, the result is {n}{u}.",
    "Thus there are {n}{u}.",
    "So, in the end, {n}{u}.",
    # with another number of the question beside the answer ({k}), which the conclusion must not be read as
    "So, counting all {k} of them, the total is {n}{u}.",
    "After the {k} we started from, we end up with {n}{u}.",
    "That is {n}{u} for the {k} in the question.",
    "Starting from {k}, the result is {n}{u}.",
)
_AUX = {"do", "does", "did", "are", "is", "was", "were", "will", "can", "could", "would", "should", "has", "have",
        "had", "must", "came", "come", "remain", "remained", "left", "in", "of", "on", "that", "does", "for"}


@dataclass(frozen=True, slots=True)
class Case:
    set: str
    id: str
    problem: str
    solution: str
    answer: str
    must_accept: bool


def _words(n: int) -> str | None:
    if 0 <= n < 20:
        return _NUMBER_WORDS[n]
    if 20 <= n < 100:
        return _TENS_WORDS[n // 10 - 2] + ("" if n % 10 == 0 else "-" + _NUMBER_WORDS[n % 10])
    return None


def _money_sign(problem: str, solution: str) -> str | None:
    m = re.search(r"[$£€]", problem + solution)
    return m.group(0) if m else None


def _noun(question: str) -> str:
    """The noun a "How many X ..." question counts, as a unit for the concluding sentence ("" if none)."""
    m = re.search(r"\bhow many ((?:[a-z]+\s+){0,2}[a-z]+)", question, re.IGNORECASE)
    if not m:
        return ""
    words = []
    for w in m.group(1).split():
        if w.lower() in _AUX:
            break
        words.append(w)
    return " " + " ".join(words) if words else ""


def _render(value: Fraction, style: str, money: str | None) -> str:
    if value.denominator != 1:
        text = f"{float(value):.2f}" if money else f"{float(value):g}"
        return f"{money}{text}" if money and style == "money" else text
    n = value.numerator
    if style == "words" and (w := _words(n)) is not None:
        return w
    if style == "money" and money:
        return f"{money}{n:,}" if abs(n) >= 1000 else f"{money}{n}"
    if style == "thousands" and abs(n) >= 1000:
        return f"{n:,}"
    return str(n)


def conclude_in_sentence(solution: str, question: str, value: Fraction, rng: random.Random,
                         written: Fraction | None = None) -> str:
    """`solution` with its "#### N" line replaced by a concluding sentence for `value`.

    The phrasing, the number's style (plain, thousands separators, money, words) and whether the
    question's noun follows it are drawn from `rng`; `written` (default `value`) is the number the
    sentence writes, so that a wrong twin takes the same phrasing with another number."""
    body = _strip_marker(solution)
    template = rng.choice(SENTENCES)
    style = rng.choice(["plain", "plain", "thousands", "money", "words"])
    money = _money_sign(question, solution)
    unit = _noun(question) if rng.random() < 0.6 and not (style == "money" and money) else ""
    n = _render(value if written is None else written, style, money)
    others = [t for t in re.findall(r"(?<![\w.])\d+(?![\d.,]\d)", question) if Fraction(t) != value]
    if "{k}" in template and not others:
        template = SENTENCES[0]
    k = rng.choice(others) if others else ""
    sentence = template.format(n=n, N=n[:1].upper() + n[1:], k=k, u="" if "\\boxed" in template else unit)
    return body + "\n" + sentence


def _strip_marker(solution: str) -> str:
    return re.sub(r"\n?####[^\n]*\s*$", "", solution).rstrip()


_PLAIN_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def _plain_value(token: str) -> Fraction | None:
    try:
        return Fraction(token.replace(",", ""))
    except ValueError:
        return None


def _wrong_value(value: Fraction, solution: str, rng: random.Random) -> Fraction:
    """Another value: half of the time a number the working writes (the hard case), else a near miss."""
    written = [v for t in _PLAIN_NUMBER.findall(_strip_marker(solution)) if (v := _plain_value(t)) is not None
               and v != value]
    if written and rng.random() < 0.5:
        return rng.choice(written)
    return rng.choice([v for v in (value + 1, value - 1, value * 10, value + 10) if v != value])


def _replace_last_answer(body: str, value: Fraction, other: Fraction) -> str | None:
    """`body` with every number of its last line that equals `value` written as `other` (every one: "for
    168 minutes because 84 x 2 = 168" must not keep one of them), or None when that line has none."""
    head, _, last = body.rpartition("\n")
    if not any(_plain_value(m.group(0)) == value for m in _PLAIN_NUMBER.finditer(last)):
        return None
    new_last = _PLAIN_NUMBER.sub(lambda m: _render(other, "plain", None) if _plain_value(m.group(0)) == value
                                 else m.group(0), last)
    return (head + "\n" if head else "") + new_last


def _gsm_sets(problems: int, seed: int) -> list[Case]:
    from kvmemory.bench.gsm_symbolic import draw_solutions

    cases: list[Case] = []
    for p in draw_solutions(problems, seed):
        rng = random.Random(f"{seed}:{p.id}")  # one stream per problem: a sample is a prefix of the whole
        wrong = _wrong_value(p.value, p.solution, rng)
        wrong_answer = _render(wrong, "plain", None)
        body = _strip_marker(p.solution)
        sentence_state = rng.getstate()
        sentence = conclude_in_sentence(p.solution, p.question, p.value, rng)
        rng.setstate(sentence_state)  # the same phrasing and style, another number
        sentence_wrong = conclude_in_sentence(p.solution, p.question, p.value, rng, written=wrong)
        unmarked_wrong = _replace_last_answer(body, p.value, wrong)
        marked_wrong = re.sub(r"####[^\n]*\s*$", "#### " + wrong_answer, p.solution)
        for name, right, wrong_sol in (("gsm-marked", p.solution, marked_wrong),
                                       ("gsm-unmarked", body, unmarked_wrong),
                                       ("gsm-sentence", sentence, sentence_wrong)):
            cases.append(Case(name, p.id, p.question, right, p.answer, True))
            if wrong_sol is not None:
                cases.append(Case(f"{name}/wrong-conclusion", p.id, p.question, wrong_sol, p.answer, False))
            cases.append(Case(f"{name}/wrong-expected", p.id, p.question, right, wrong_answer, False))
    return cases


def _hand_sets() -> list[Case]:
    from kvmemory.bench.verifier_cases import HAND_CASES, HELDOUT_CASES

    cases = []
    for name, hand in (("handwritten", HAND_CASES), ("handwritten-heldout", HELDOUT_CASES)):
        for i, c in enumerate(hand):
            cid = f"{name}-{i:02d}"
            cases.append(Case(name, cid, c.problem, c.solution, c.answer, True))
            cases.append(Case(f"{name}/wrong-conclusion", cid, c.problem, c.wrong_solution, c.answer, False))
            cases.append(Case(f"{name}/wrong-expected", cid, c.problem, c.solution, c.wrong_answer, False))
    return cases


def build_sets(problems: int = 340, seed: int = 0) -> list[Case]:
    """Every case of the bench: the GSM-Symbolic sets over `problems` draws, then the hand-written ones."""
    return _gsm_sets(problems, seed) + _hand_sets()


_REASONS = [("mismatch", r"!= expected"), ("ambiguous", r"does not say which|marks different|ends in an expression"),
            ("no number", r"no final|writes no number"), ("wrong arithmetic", r"wrong arithmetic"),
            ("not the last result", r"not the last result"), ("no equations", r"no equations"),
            ("expected not a number", r"is not (?:one|a) number")]


def _reason(detail: str) -> str:
    return next((name for name, pat in _REASONS if re.search(pat, detail)), "other")


def measure(cases: Sequence[Case], verifiers: dict[str, Any], examples: int = 3) -> dict[str, Any]:
    """Per set and verifier: cases, accepted, false refusals / acceptances and their rate, the reasons
    for refusals, and the first `examples` errors."""
    out: dict[str, Any] = {}
    for case in cases:
        for vname, verifier in verifiers.items():
            r = verifier(case.problem, case.solution, case.answer)
            row = out.setdefault(case.set, {}).setdefault(vname, {
                "cases": 0, "accepted": 0, "refused": 0, "errors": 0, "refusal_reasons": Counter(), "examples": []})
            row["cases"] += 1
            row["accepted" if r.ok else "refused"] += 1
            if not r.ok:
                row["refusal_reasons"][_reason(r.detail)] += 1
            if r.ok != case.must_accept:
                row["errors"] += 1
                if len(row["examples"]) < examples:
                    row["examples"].append({"id": case.id, "answer": case.answer, "end": case.solution[-160:],
                                            "detail": r.detail})
    for set_name, per in out.items():
        for row in per.values():
            kind = "false_acceptances" if "/wrong-" in set_name else "false_refusals"
            row[kind] = row.pop("errors")
            row["rate"] = round(row[kind] / row["cases"], 4) if row["cases"] else 0.0
            row["refusal_reasons"] = dict(row["refusal_reasons"])
    return out


def _load_verifiers(path: str | None) -> dict[str, Any]:
    if path is None:
        from kvmemory.memory.verifiers import ArithmeticVerifier, ExactAnswerVerifier
    else:
        spec = importlib.util.spec_from_file_location("_bench_verifiers", path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"cannot load verifiers from {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        ExactAnswerVerifier, ArithmeticVerifier = mod.ExactAnswerVerifier, mod.ArithmeticVerifier
    return {f"{v.name} v{v.version}": v for v in (ExactAnswerVerifier(), ArithmeticVerifier())}


def run(problems: int = 340, seed: int = 0, verifiers_file: str | None = None) -> dict[str, Any]:
    """The whole bench as a JSON-able dict."""
    verifiers = _load_verifiers(verifiers_file)
    cases = build_sets(problems, seed)
    return {"bench": "verifier", "problems": problems, "seed": seed,
            "verifiers": list(verifiers), "verifiers_file": verifiers_file,
            "sets": measure(cases, verifiers)}


def _table(result: dict[str, Any]) -> str:
    lines = ["| set | verifier | cases | accepted | false refusals | false acceptances |",
             "|---|---|---:|---:|---:|---:|"]
    for set_name, per in result["sets"].items():
        for vname, row in per.items():
            fr = row.get("false_refusals")
            fa = row.get("false_acceptances")
            fmt = lambda k: "-" if k is None else f"{k} ({100 * k / row['cases']:.1f} %)"  # noqa: E731
            lines.append(f"| {set_name} | {vname} | {row['cases']} | {row['accepted']} | {fmt(fr)} | {fmt(fa)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmemory.bench.verifier", description=__doc__.split("\n")[0])
    p.add_argument("--problems", type=int, default=340, help="GSM-Symbolic problems (85 templates x 4 by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verifiers-file", default=None,
                   help="a verifiers.py to measure instead of this one "
                        "(e.g. `git show REV:kvmemory/memory/verifiers.py > FILE`)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON (with examples of errors)")
    args = p.parse_args(argv)
    result = run(args.problems, args.seed, args.verifiers_file)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
