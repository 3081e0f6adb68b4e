"""Is the contrast worth its compute? An offline study of `answer(choices="numbers")`'s scoring.

A recurrence's answer scores its choices twice: after the prompt with the routed entry grafted (s) and,
for the contrast, after the question alone (bq, ~55 more tokens computed). This script records, for every
question of a hand-written rewordings set (originals, rewordings, other asks), s, bq, the scores after
the answer prefix alone (b0: a contrast that costs no question tokens) and which choices are the routed
verified answer (the prior's), then `--eval` replays the decision for several rules without the model:

- "question": today's rule, s - 0.5 bq + prior (memory/answers.py);
- "none": s + prior, no contrast;
- "known": no contrast where the prior favours an offered verified answer, else today's;
- "prefix": s - 0.5 b0 + prior.

    PYTHONPATH=. python scripts/contrast_study.py record --set calibration --out study-calibration.json
    PYTHONPATH=. python scripts/contrast_study.py eval study-calibration.json study-report.json

Measured 2026-12-07 (Zen 2, SmolLM2-135M, q8 linears at 7b77c9b; BENCHMARKS.md "Serving", AVX2): with the
prior's own calibration rule the "known" rule keeps every calibration answer but answers 116 instead of
119 of 120 report-set rewordings right, so the contrast stays.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from fractions import Fraction

RULES = ("question", "none", "known", "prefix")


def record(which: str, out: str, problems: int | None = None) -> None:
    from kvmemory.bench import rewordings as RW
    from kvmemory.bench import rewordings_other_asks
    from kvmemory.memory import answers
    from kvmemory.memory import choices as CH
    from kvmemory.memory.facade import KVMemory

    rows, current = [], {}
    plain_choose = answers.choose

    def choose(mem, prompt, offered, end, answer_prefix, hits, query, contrast, prior, other=None):
        eng = mem.engine
        tok = [eng.encode(f"{' ' if answer_prefix else ''}{c}{end}") for c in offered]
        entries = [h.entry for h in hits]
        scores = {}
        for name, layout in (("s", prompt), ("bq", mem.question_layout(query, (), answer_prefix)),
                             ("b0", mem.question_layout("", (), answer_prefix))):
            scores[name] = eng.choose(layout.ids, tok, cuts=layout.cuts)[1]
        known = CH.verified_answers([e for e in entries if e.id not in (other or {})])
        rows.append(dict(current, offered=list(offered), **scores, other=bool(other), entries=[e.id for e in entries],
                         known=[bool(known) and bool(CH.is_known(c, known)) for c in offered]))
        return plain_choose(mem, prompt, offered, end, answer_prefix, hits, query, contrast, prior, other)

    answers.choose = choose
    s = RW.load_set(which)
    with tempfile.TemporaryDirectory() as tmp:
        mem = KVMemory(store=f"{tmp}/store", namespace=f"contrast-study-{which}")
        probs = s.PROBLEMS[:problems]
        ids = [mem.remember(p[0], p[1], answer=p[2]).id for p in probs]
        qs = []
        for i, p in enumerate(probs):
            qs.append(("original", i, p[0], p[2]))
            qs += [(k, i, p[3][k], p[2]) for k in RW.KINDS if p[3] and k in p[3]]
        asks = getattr(s, "OTHER_ASKS", None) or getattr(rewordings_other_asks, which.upper())
        qs += [("other", i, q, right) for i, q, right in asks if i < len(probs)]
        for kind, i, q, expected in qs:
            current = dict(kind=kind, problem=i, question=q, expected=str(expected), stored=str(s.PROBLEMS[i][2]),
                           entry=ids[i])
            n = len(rows)
            ans = mem.answer(q, answer_prefix=RW.ANSWER_PREFIX, choices="numbers", max_new_tokens=12, stop=["\n"],
                             nothing_to_choose="decode")
            if len(rows) == n:  # nothing chosen (no entry routed): the model's own answer
                rows.append(dict(current, offered=None))
            rows[-1]["text"] = ans.text
    with open(out, "w") as f:
        json.dump({"set": which, "rows": rows}, f)


def decide(row: dict, rule: str, prior: float, weight: float = 0.5) -> str:
    base = {"question": "bq", "none": None, "prefix": "b0",
            "known": None if any(row["known"]) else "bq"}[rule]
    b = row[base] if base else [0.0] * len(row["s"])
    scores = [s - weight * x + (prior if k else 0.0) for s, x, k in zip(row["s"], b, row["known"])]
    return row["offered"][max(range(len(scores)), key=lambda i: (scores[i], -i))]


def evaluate(path: str, rule: str, prior: float) -> dict:
    from kvmemory.memory.verifiers import extract_value

    data = json.load(open(path))
    out: dict = {}
    for row in data["rows"]:
        kind = {"other": "other asks", "original": "originals"}.get(row["kind"], "rewordings")
        d = out.setdefault(kind, {"questions": 0, "right": 0, "given_stored_answer": 0})
        d["questions"] += 1
        routed = row["offered"] is not None and row["entry"] in row["entries"]
        got = extract_value(decide(row, rule, prior)) if row["offered"] is not None else extract_value(row["text"])
        d["right"] += int(got is not None and got == Fraction(row["expected"]))
        if kind == "other asks":
            d["given_stored_answer"] += int(routed and got is not None and got == Fraction(row["stored"]))
    return {"set": data["set"], "rule": rule, "prior": prior, "kinds": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--set", default="calibration", choices=("report", "calibration", "fresh", "fresh2"))
    r.add_argument("--out", required=True)
    r.add_argument("--problems", type=int, default=None, help="only the first N problems (default: all)")
    e = sub.add_parser("eval")
    e.add_argument("files", nargs="+")
    e.add_argument("--priors", default="2,2.5,3,4,5")
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.set, args.out, args.problems)
        return
    for path in args.files:
        for rule in RULES:
            for prior in (float(p) for p in args.priors.split(",")):
                print(json.dumps(evaluate(path, rule, prior)))


if __name__ == "__main__":
    main()
