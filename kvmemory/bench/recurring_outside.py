"""`kvmemory bench recurring --dataset gsm-symbolic`: the recurring-problem headline on outside data.

The seeds' recurring bench asks problems kvmemory's own generator wrote, reworded by kvmemory's own
rewording. This one takes GSM-Symbolic's problems and worked solutions (gsm_symbolic.py, from the
reasoning-gym package) and asks each problem three ways:

(a) verbatim, as a recurring problem recurs;
(b) reworded by `paraphrase.paraphrase`, a general rewording not written for (or tuned on) the data;
(c) a sibling: the same template with other numbers, whose right answer is NOT the stored one.

Each question goes to the model alone (free decode, `base_budget` tokens, no memory, every token
computed: not even a stored prefix is grafted) and to kvmemory:
routed with the number check (`recall(number_check=True)`: an entry whose problem writes other numbers
is another problem); when an entry is routed, its KV is grafted and the answer is chosen among the
numbers of its verified solution (`choices="numbers"`, as `bench recurring`); when none is, the model
solves the question alone with the same budget, as an agent falls back to thinking. The memory holds
the dataset's worked solutions, each verified against the dataset's answer before it is stored.

Reported per kind and side: accuracy, how often memory was used, prefill tokens computed and grafted,
decode tokens, wall and CPU seconds per question; the sibling leak rate (siblings given the original's
stored answer, wrong for them, through memory: an entry routed and grafted) beside every sibling that
got the original's answer whatever the route (where no memory was used that is the model's own decode
landing on the same number, as the model alone also does: counted beside it); and the token and
CPU-second ratios of the model alone over kvmemory.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from tqdm import tqdm

from kvmemory.bench.recurring import ANSWER_PREFIX, _timed

KINDS = ("verbatim", "reworded", "sibling")


@dataclass
class _Side:
    questions: int = 0
    correct: int = 0
    used_memory: int = 0
    prefill_tokens: int = 0
    grafted_tokens: int = 0
    decode_tokens: int = 0
    scored_tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    failures: list = field(default_factory=list)

    def add(self, ok: bool, report, wall: float, cpu: float, used_memory: bool) -> None:
        self.questions += 1
        self.correct += int(ok)
        self.used_memory += int(used_memory)
        self.prefill_tokens += report.tokens_computed
        self.grafted_tokens += report.tokens_grafted
        self.decode_tokens += report.tokens_decoded
        self.scored_tokens += getattr(report, "tokens_scored", 0)
        self.wall += wall
        self.cpu += cpu

    def to_json(self) -> dict:
        n = max(self.questions, 1)
        return {"questions": self.questions, "accuracy": self.correct / n, "used_memory": self.used_memory / n,
                "prefill_tokens_per_question": self.prefill_tokens / n,
                "grafted_tokens_per_question": self.grafted_tokens / n,
                "decode_tokens_per_question": self.decode_tokens / n,
                "choice_tokens_scored_per_question": self.scored_tokens / n,
                "tokens_computed_per_question": (self.prefill_tokens + self.decode_tokens + self.scored_tokens) / n,
                "wall_seconds_per_question": self.wall / n, "cpu_seconds_per_question": self.cpu / n,
                "failures": self.failures[:5]}


@dataclass(frozen=True, slots=True)
class _Alone:
    text: str
    report: object  # GraftReport


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


@contextmanager
def _problems_and_memory(mem, dataset: str, problems: int, seed: int):
    """The dataset's problem pairs and the memory a run uses: `mem`, or a temporary one (removed after)."""
    import tempfile

    from kvmemory.bench import gsm_symbolic
    from kvmemory.errors import InvalidInput
    from kvmemory.memory.facade import KVMemory

    if dataset != gsm_symbolic.NAME:
        raise InvalidInput(f"unknown dataset {dataset!r}; known: {gsm_symbolic.NAME}")
    pairs = gsm_symbolic.load_problems(problems, seed)
    if mem is not None:
        yield pairs, mem
        return
    with tempfile.TemporaryDirectory(prefix="kvmemory-bench-") as tmp:
        yield pairs, KVMemory(store=f"{tmp}/store", namespace=f"bench-outside-{seed}")


def run_outside_bench(mem=None, *, dataset: str = "gsm-symbolic", problems: int = 20, seed: int = 0,
                      base_budget: int = 256, progress: bool = True) -> dict:
    """Run the benchmark on `mem` (a KVMemory; a temporary one on the embedded model by default)."""
    from kvmemory.bench import gsm_symbolic
    from kvmemory.bench.paraphrase import paraphrase
    from kvmemory.memory.verifiers import extract_value

    with _problems_and_memory(mem, dataset, problems, seed) as (pairs, mem):
        bar = dict(disable=not progress, unit="problem")
        entry_of = {}
        for pair in tqdm(pairs, desc="remembering the worked solutions", **bar):
            p = pair.original
            entry_of[p.id] = mem.remember(p.question, p.solution, answer=p.answer, verifier="exact-answer").id

        eng = mem.engine

        def alone(q: str) -> _Alone:
            # Everything computed: no solution in context and no stored prefix grafted either (the
            # remembered problems' own prompt blocks would otherwise be reused, a kvmemory saving).
            result, report = eng.forward(mem.question_ids(q), graft=False, max_new_tokens=base_budget,
                                         logits="last")  # as KVMemory.generate answers
            return _Alone(eng.decode([t for t in result.generated if t not in eng.eos_token_ids]), report)

        def with_memory(q: str):
            hits = mem.recall(q, k=1, number_check=True)
            if hits:
                return mem.answer_from(q, hits, answer_prefix=ANSWER_PREFIX, choices="numbers"), hits
            # Nothing routed: the model solves it itself (kvmemory still grafts any stored prefix).
            return mem.answer(q, use_memory=False, max_new_tokens=base_budget), []

        base = {k: _Side() for k in KINDS}
        memory = {k: _Side() for k in KINDS}
        routed_right = {k: 0 for k in KINDS}
        gave_original = []  # siblings answered with the original's answer (wrong for them), by any route
        alone_gave_original = 0  # the same, by the model alone: what chance alone gives
        samples = []
        for pair in tqdm(pairs, desc="asking (model alone and with memory)", **bar):
            o, s = pair.original, pair.sibling
            asked = {"verbatim": (o.question, o), "reworded": (paraphrase(o.question), o), "sibling": (s.question, s)}
            for kind, (q, truth) in asked.items():
                ans, w, c = _timed(lambda: alone(q))
                base[kind].add(extract_value(ans.text) == truth.value, ans.report, w, c, False)
                if kind == "sibling" and extract_value(ans.text) == o.value:
                    alone_gave_original += 1
                (ans, hits), w, c = _timed(lambda: with_memory(q))
                got = extract_value(ans.text)
                ok = got == truth.value
                side = memory[kind]
                side.add(ok, ans.report, w, c, bool(hits))
                routed_right[kind] += int(bool(hits) and hits[0].entry.id == entry_of[o.id])
                if kind == "sibling" and got == o.value:
                    gave_original.append({"question": q, "answer": ans.text[-200:], "original_answer": o.answer,
                                  "sibling_answer": s.answer, "used_memory": bool(hits)})
                if not ok and len(side.failures) < 5:
                    side.failures.append({"question": q, "answer": ans.text, "expected": truth.answer,
                                          "routed": [h.entry.id for h in hits]})
                if len(samples) < 6:
                    samples.append({"kind": kind, "question": q, "answer": ans.text, "expected": truth.answer})

        out_kinds = {}
        for kind in KINDS:
            b, m = base[kind].to_json(), memory[kind].to_json()
            out_kinds[kind] = {
                "model_alone": b, "kvmemory": m,
                "routed_to_its_entry": routed_right[kind] / max(m["questions"], 1),
                "ratios_alone_over_kvmemory": {
                    "tokens_computed": _ratio(b["tokens_computed_per_question"], m["tokens_computed_per_question"]),
                    "decode_tokens": _ratio(b["decode_tokens_per_question"], m["decode_tokens_per_question"]),
                    "cpu_seconds": _ratio(b["cpu_seconds_per_question"], m["cpu_seconds_per_question"]),
                    "wall_seconds": _ratio(b["wall_seconds_per_question"], m["wall_seconds_per_question"]),
                },
            }
        return {
            "bench": "recurring-outside", "dataset": dataset, "source": gsm_symbolic.SOURCE,
            "model": eng.loaded.source, "profile_id": eng.profile_id, "problems": len(pairs), "seed": seed,
            "base_budget_tokens": base_budget, "answer_prefix": ANSWER_PREFIX,
            "library": "the dataset's worked solutions, each verified (exact-answer) before it is stored",
            "rewording": "kvmemory.bench.paraphrase (question first, general synonyms; not tuned on the data)",
            "kinds": out_kinds,
            # A leak is the stored answer reaching a sibling through memory (routed and grafted): what
            # routing must refuse. Siblings whose own decode (no memory) lands on the original's number
            # are counted beside it, with how often the model alone does the same.
            "sibling_leak_rate": sum(x["used_memory"] for x in gave_original) / max(len(pairs), 1),
            "sibling_leaks": sum(x["used_memory"] for x in gave_original),
            "siblings_given_the_originals_answer": len(gave_original),
            "siblings_given_the_originals_answer_details": gave_original,
            "model_alone_gave_the_originals_answer_on_siblings": alone_gave_original,
            "samples": samples,
        }


def format_table(r: dict) -> str:
    head = ["| question kind | side | accuracy | used memory | prefill computed (+grafted) | decode tokens | "
            "CPU s / q | wall s / q |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for kind in KINDS:
        k = r["kinds"][kind]
        for name, side in (("model alone", k["model_alone"]), ("kvmemory", k["kvmemory"])):
            rows.append(f"| {kind} | {name} | {side['accuracy']:.1%} | {side['used_memory']:.0%} | "
                        f"{side['prefill_tokens_per_question']:.0f} (+{side['grafted_tokens_per_question']:.0f}) | "
                        f"{side['decode_tokens_per_question']:.1f} | {side['cpu_seconds_per_question']:.2f} | "
                        f"{side['wall_seconds_per_question']:.2f} |")
    tail = [f"sibling leak rate (the original's stored answer given to a sibling through memory): "
            f"{r['sibling_leak_rate']:.1%} ({r['sibling_leaks']} of {r['problems']}); siblings given the original's "
            f"answer by any route: {r['siblings_given_the_originals_answer']} (the model alone: "
            f"{r['model_alone_gave_the_originals_answer_on_siblings']})"]
    for kind in ("verbatim", "reworded"):
        ratio = r["kinds"][kind]["ratios_alone_over_kvmemory"]
        fmt = lambda x: "-" if x is None else f"{x:.1f}x"  # noqa: E731
        tail.append(f"{kind}: model alone / kvmemory = {fmt(ratio['tokens_computed'])} tokens computed, "
                    f"{fmt(ratio['cpu_seconds'])} CPU seconds; routed to its entry "
                    f"{r['kinds'][kind]['routed_to_its_entry']:.0%}")
    return "\n".join(head + rows + [""] + tail)


def study_prior(mem=None, *, dataset: str = "gsm-symbolic", problems: int = 20, seed: int = 0,
                priors: tuple[float, ...] = (0.0, 2.5), progress: bool = True) -> dict:
    """The kvmemory side of the bench (verbatim and reworded questions; siblings route nowhere, so the prior
    does not reach them) answered at several `prior`s of `answer(choices="numbers")`: how many are right.
    The model-alone side does not depend on the prior and is not run."""
    from kvmemory.bench.paraphrase import paraphrase
    from kvmemory.memory.inputs import check_prior
    from kvmemory.memory.verifiers import extract_value

    priors = tuple(check_prior(p) for p in priors)
    with _problems_and_memory(mem, dataset, problems, seed) as (pairs, mem):
        bar = dict(disable=not progress, unit="problem")
        ids = {p.original.id: mem.remember(p.original.question, p.original.solution, answer=p.original.answer,
                                           verifier="exact-answer").id
               for p in tqdm(pairs, desc="remembering the worked solutions", **bar)}
        kinds = {k: {"questions": 0, "routed_to_its_entry": 0, **{f"right_at_prior_{p:g}": 0 for p in priors}}
                 for k in ("verbatim", "reworded")}
        for pair in tqdm(pairs, desc="asking at each prior", **bar):
            o = pair.original
            for kind, q in (("verbatim", o.question), ("reworded", paraphrase(o.question))):
                row = kinds[kind]
                row["questions"] += 1
                hits = mem.recall(q, k=1, number_check=True)
                row["routed_to_its_entry"] += int(bool(hits) and hits[0].entry.id == ids[o.id])
                for p in priors:
                    if hits:
                        ans = mem.answer_from(q, hits, answer_prefix=ANSWER_PREFIX, choices="numbers", prior=p)
                        row[f"right_at_prior_{p:g}"] += int(extract_value(ans.text) == o.value)
        return {"bench": "recurring-outside-prior", "dataset": dataset, "seed": seed, "problems": len(pairs),
                "model": mem.engine.loaded.source, "profile_id": mem.engine.profile_id, "priors": list(priors),
                "answer_prefix": ANSWER_PREFIX, "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    """`python -m kvmemory.bench.recurring_outside prior --seed 1 --problems 30`: the prior study."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m kvmemory.bench.recurring_outside",
                                 description="studies on outside data (the bench itself: kvmemory bench recurring "
                                             "--dataset gsm-symbolic)")
    sub = ap.add_subparsers(dest="study", required=True)
    pr = sub.add_parser("prior", help="the kvmemory side answered at several priors of answer(choices='numbers')")
    pr.add_argument("--seed", type=int, default=0, help="seed of the problems drawn (default: %(default)s)")
    pr.add_argument("--problems", type=int, default=20, help="problems (default: %(default)s)")
    pr.add_argument("--priors", default="0,2.5", help="comma-separated priors in nats (default: %(default)s)")
    args = ap.parse_args(argv)
    r = study_prior(problems=args.problems, seed=args.seed,
                    priors=tuple(float(x) for x in args.priors.split(",") if x.strip()), progress=True)
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
