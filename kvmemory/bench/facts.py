"""Facts told in a chat and asked back: how `KVMemory.add` + `answer` answer them (issue 48).

`kvmemory/bench/data/facts.json` holds three hand-written sets: "tuning" (what the note answer and the
word floor, memory/notes.py, were designed with), "report" (written separately before any tuning, but its
scores were looked at when the word floor was chosen) and "heldout" (written after the rule was fixed,
never tuned on). Each chat's user message is added with
`KVMemory.add` into a namespace of its own (one user's memory); each question about it is asked with
`KVMemory.answer` (defaults: a question routed to notes only is answered with the routed note's
sentence nearest the question, memory/answers.py `from_note`) and counts as right when `Answer.source`
is "note" and the answer contains the expected word (case-insensitive). Every unrelated question is
routed (`KVMemory.route`, what `answer` routes to) in every chat's namespace and counts as right when
no note is routed.

Run as `python -m kvmemory.bench.facts [--json] [--set tuning|report|heldout|all]`. Needs the embedded
model (KV of each note computed and proven) and the MiniLM router; CPU is enough (about 2 minutes).
Measured (CPU, SmolLM2-135M, all-MiniLM-L6-v2): facts answered right 19/20 tuning ("What is my job?"
against "I work as a dentist in Porto." scores 0.35 and shares no word: not routed), 19/19 report,
17/17 heldout; unrelated questions routed to a note 0/48, 0/48, 0/40.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from importlib import resources

from kvmemory.errors import InvalidInput

SETS = ("tuning", "report", "heldout")


def load(name: str | None = None) -> dict:
    """The data file's sets ({"tuning": ..., "report": ...}), or one of them by name."""
    data = json.loads(resources.files("kvmemory.bench").joinpath("data/facts.json").read_text(encoding="utf-8"))
    if name is None:
        return {k: data[k] for k in SETS}
    if name not in SETS:
        raise InvalidInput(f"set must be one of {SETS}, got {name!r}")
    return data[name]


def run_set(mem, data: dict, *, prefix: str = "facts", max_new_tokens: int = 16) -> dict:
    """One set on `mem` (a `KVMemory`): each chat added into namespace f"{prefix}-{i}", its questions
    answered, the unrelated questions routed in each namespace. Returns the counts and every miss."""
    asked = right = 0
    misses: list[dict] = []
    namespaces = []
    for i, chat in enumerate(data["chats"]):
        ns = f"{prefix}-{i}"
        namespaces.append(ns)
        mem.add([{"role": "user", "content": chat["user"]}, {"role": "assistant", "content": "Noted!"}], namespace=ns)
        for question, expected in chat["questions"]:
            ans = mem.answer(question, namespace=ns, max_new_tokens=max_new_tokens)
            asked += 1
            ok = ans.source == "note" and expected.lower() in ans.text.lower()
            right += ok
            if not ok:
                misses.append({"namespace": ns, "question": question, "expected": expected, "answer": ans.text,
                               "source": ans.source, "scores": [round(s, 4) for s in ans.scores]})
    routed = 0
    wrong_routes: list[dict] = []
    for q in data["unrelated"]:
        for ns in namespaces:
            hits = mem.route(q, namespace=ns, number_check=mem.number_check)
            if hits:
                routed += 1
                wrong_routes.append({"namespace": ns, "question": q, "note": hits[0].entry.problem,
                                     "score": round(hits[0].score, 4)})
    n_unrelated = len(data["unrelated"]) * len(namespaces)
    return {"facts_asked": asked, "facts_right": right, "facts_right_rate": round(right / asked, 4) if asked else None,
            "unrelated_asked": n_unrelated, "unrelated_routed_to_a_note": routed,
            "unrelated_no_note_rate": round(1 - routed / n_unrelated, 4) if n_unrelated else None,
            "misses": misses, "unrelated_routes": wrong_routes}


def run(which: str = "all", *, store: str | None = None, mem=None) -> dict:
    """The sets named by `which` ("tuning", "report" or "all"), each on a fresh store (or `mem`)."""
    names = SETS if which == "all" else (which,)
    data = load()
    for n in names:
        if n not in SETS:
            raise InvalidInput(f"set must be one of {SETS} or 'all', got {which!r}")
    out: dict = {}
    if mem is not None:
        for n in names:
            out[n] = run_set(mem, data[n], prefix=f"facts-{n}")
        return out
    from kvmemory.memory.facade import KVMemory

    with tempfile.TemporaryDirectory(prefix="kvmemory-facts-") as tmp:
        m = KVMemory(store=store or tmp, device="cpu")
        for n in names:
            out[n] = run_set(m, data[n], prefix=f"facts-{n}")
        m.flush()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmemory.bench.facts", description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="all", choices=[*SETS, "all"])
    ap.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = ap.parse_args(argv)
    res = run(args.set)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for n, r in res.items():
            print(f"{n}: facts answered right {r['facts_right']}/{r['facts_asked']}; unrelated questions routed "
                  f"to a note {r['unrelated_routed_to_a_note']}/{r['unrelated_asked']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
