"""Free-decode accuracy with and without memory on GSM-Symbolic, per model (issue 41, item 7).

`bench recurring --dataset gsm-symbolic` answers with memory by choosing among the numbers of the routed
solution (`choices="numbers"`). This asks what a user who decodes freely gets, on the same problems
(gsm_symbolic.load_problems) and the same memory (each dataset worked solution verified with
exact-answer before it is stored), for each question kind asked:

- **alone**: the model with no memory, free decode (`base_budget` tokens), every token computed;
- **memory, free decode**: routed with the number check (`recall(number_check=True)`); when an entry
  is routed its KV is grafted, the assistant's turn starts with ANSWER_PREFIX and the model decodes
  freely (`answer_tokens`, stopping at a newline); when none is, the model answers alone (its answer
  is the alone side's: a graft of the stored prefix computes the same tokens, exactly);
- **memory, choices**: the same routed entry, the answer chosen among its solution's numbers (the
  mode `bench recurring` reports), for comparison.

The answer is read with `extract_value` and compared with the exact answer. Also reported per model:
decode tokens/s of the alone side (decode tokens over decode seconds, as the runner times them) and
the machine's load average while it ran (the VM is shared: read seconds with that in mind).

    python -m kvmemory.bench.free_decode --model embedded:qwen2.5-coder-0.5b-instruct --problems 10 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

from kvmemory.bench.recurring import ANSWER_PREFIX

KINDS = ("verbatim", "reworded", "sibling")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(model: str, *, problems: int = 10, seed: int = 0, kinds=("verbatim", "reworded"), base_budget: int = 256,
        answer_tokens: int = 12, threads: int | None = None, store: str | None = None, progress: bool = True,
        alone_problems: int | None = None, alone_kinds=None, choices: bool = True, jsonl: str | None = None) -> dict:
    """`alone_problems` / `alone_kinds`: the alone side (the costly one: up to `base_budget` decode
    tokens per question) is measured on the first `alone_problems` problems and these kinds only (all
    by default); elsewhere it is not measured, and a question with nothing routed is then answered
    alone for the memory side all the same. `choices=False` leaves the choices side unmeasured."""
    from tqdm import tqdm

    from kvmemory.bench import gsm_symbolic
    from kvmemory.bench.paraphrase import paraphrase
    from kvmemory.memory.facade import KVMemory
    from kvmemory.memory.verifiers import extract_value

    pairs = gsm_symbolic.load_problems(problems, seed)
    tmp = tempfile.TemporaryDirectory(prefix="kvmemory-free-decode-") if store is None else None
    loads = [os.getloadavg()[0]]
    try:
        t0 = time.perf_counter()
        kw = {"threads": threads} if threads else {}
        mem = KVMemory(model=model, store=store or f"{tmp.name}/store", namespace=f"free-decode-{seed}", **kw)
        eng = mem.engine
        open_s = time.perf_counter() - t0
        bar = dict(disable=not progress, unit="problem", file=sys.stderr)
        entry_of = {}
        t0 = time.perf_counter()
        for pair in tqdm(pairs, desc="remembering", **bar):
            p = pair.original
            entry_of[p.id] = mem.remember(p.question, p.solution, answer=p.answer, verifier="exact-answer").id
        remember_s = time.perf_counter() - t0
        sides = {k: {s: 0 for s in ("alone", "memory_free", "memory_choices", "routed", "routed_right")}
                 for k in kinds}
        decode_tokens = decode_s = 0.0
        alone_cpu = alone_wall = 0.0
        samples = []
        alone_kinds = tuple(kinds if alone_kinds is None else alone_kinds)
        alone_n = {k: 0 for k in kinds}  # questions the alone side was measured on, per kind

        def ask_alone(q: str) -> str:
            nonlocal decode_tokens, decode_s, alone_cpu, alone_wall
            c0, w0 = _cpu(), time.perf_counter()
            result, rep = eng.forward(mem.question_ids(q), graft=False, max_new_tokens=base_budget, logits="last")
            alone_cpu += _cpu() - c0
            alone_wall += time.perf_counter() - w0
            decode_tokens += rep.tokens_decoded
            decode_s += rep.decode_seconds
            loads.append(os.getloadavg()[0])
            return eng.decode([t for t in result.generated if t not in eng.eos_token_ids])

        def log(row: dict) -> None:  # one line per question as it is answered: a cut-short run keeps them
            if jsonl is not None:
                with open(jsonl, "a") as fh:
                    fh.write(json.dumps({"model": model, "seed": seed, **row}) + "\n")

        asked_of = []
        for pair in pairs:
            o, s = pair.original, pair.sibling
            asked_of.append({"verbatim": (o.question, o), "reworded": (paraphrase(o.question), o),
                             "sibling": (s.question, s)})
        alone_of = {}  # (problem, kind) -> the alone side's answer
        # The memory sides first (a few tokens each), then the alone side (up to base_budget tokens each).
        for i, pair in enumerate(tqdm(pairs, desc="asking with memory", **bar)):
            o = pair.original
            for kind in kinds:
                q, truth = asked_of[i][kind]
                row = sides[kind]
                hits = mem.recall(q, k=1, number_check=True)
                if hits:
                    row["routed"] += 1
                    row["routed_right"] += hits[0].entry.id == entry_of[o.id]
                    free = mem.answer_from(q, hits, answer_prefix=ANSWER_PREFIX, max_new_tokens=answer_tokens,
                                           stop=["\n"]).text
                    chosen = (mem.answer_from(q, hits, answer_prefix=ANSWER_PREFIX, choices="numbers").text
                              if choices else None)
                else:  # nothing routed: the model answers alone (the same tokens as the alone side)
                    free = chosen = alone_of[(i, kind)] = ask_alone(q)
                row["memory_free"] += extract_value(free) == truth.value
                row["memory_choices"] += chosen is not None and extract_value(chosen) == truth.value
                log({"problem": i, "id": o.id, "kind": kind, "side": "memory", "expected": truth.answer,
                     "routed": bool(hits), "free": free, "free_ok": extract_value(free) == truth.value,
                     "choices": chosen, "choices_ok": None if chosen is None else extract_value(chosen) == truth.value})
                if len(samples) < 2 * len(kinds):
                    samples.append({"kind": kind, "question": q, "expected": truth.answer, "memory_free": free,
                                    "memory_choices": chosen})
        for i, pair in enumerate(tqdm(pairs, desc="asking alone", **bar)):
            if alone_problems is not None and i >= alone_problems:
                break
            for kind in kinds:
                if kind not in alone_kinds:
                    continue
                q, truth = asked_of[i][kind]
                alone = alone_of[(i, kind)] if (i, kind) in alone_of else ask_alone(q)
                alone_n[kind] += 1
                ok = extract_value(alone) == truth.value
                sides[kind]["alone"] += ok
                log({"problem": i, "id": pair.original.id, "kind": kind, "side": "alone", "expected": truth.answer,
                     "answer": alone, "ok": ok})
        n = len(pairs)
        return {
            "bench": "free-decode", "dataset": gsm_symbolic.NAME, "model": model, "profile_id": eng.profile_id,
            "model_class": type(eng.model).__name__, "parameters": sum(p.numel() for p in eng.model.parameters()),
            "linear_impl": eng.profile.to_dict().get("linear_impl"), "threads": eng.profile.to_dict().get("threads"),
            "problems": n, "seed": seed, "kinds": list(kinds), "base_budget": base_budget,
            "answer_tokens": answer_tokens, "answer_prefix": ANSWER_PREFIX,
            # Each side's share of the questions it was asked (None: not measured for that kind).
            "accuracy": {k: {"alone": row["alone"] / alone_n[k] if alone_n[k] else None,
                             "memory_free": row["memory_free"] / n,
                             "memory_choices": row["memory_choices"] / n if choices else None,
                             "routed": row["routed"] / n, "routed_right": row["routed_right"] / n}
                         for k, row in sides.items()},
            "counts": sides, "questions": {"alone": alone_n, "memory": {k: n for k in kinds}},
            "alone_decode_tokens": int(decode_tokens), "alone_decode_seconds": round(decode_s, 2),
            "alone_decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else None,
            "alone_wall_s": round(alone_wall, 1), "alone_cpu_s": round(alone_cpu, 1),
            "open_s": round(open_s, 1), "remember_s": round(remember_s, 1),
            "load_average_1min": {"min": min(loads), "max": max(loads), "mean": round(sum(loads) / len(loads), 2)},
            "samples": samples,
        }
    finally:
        if tmp is not None:
            tmp.cleanup()


def format_table(r: dict) -> str:
    out = [f"{r['model']} ({r['model_class']}, {r['parameters'] / 1e6:.0f}M parameters, {r['linear_impl']}), "
           f"{r['problems']} GSM-Symbolic problems, seed {r['seed']}",
           "| kind | alone (free decode) | memory, free decode | memory, choices=numbers | routed to its entry |",
           "|---|---:|---:|---:|---:|"]
    c, q = r["counts"], r["questions"]

    def cell(kind: str, side: str) -> str:
        asked = q["alone"][kind] if side == "alone" else q["memory"][kind]
        if r["accuracy"][kind][side] is None or not asked:
            return "not measured"
        return f"{c[kind][side]}/{asked} ({r['accuracy'][kind][side]:.0%})"

    for k in r["accuracy"]:
        out.append(f"| {k} | {cell(k, 'alone')} | {cell(k, 'memory_free')} | {cell(k, 'memory_choices')} | "
                   f"{c[k]['routed_right']}/{q['memory'][k]} |")
    out.append(f"alone: {r['alone_decode_tokens']} decode tokens in {r['alone_decode_seconds']} s = "
               f"{r['alone_decode_tokens_per_s']} tokens/s (load average {r['load_average_1min']})")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmemory.bench.free_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded", help="an embedded model name, a folder or a cached hub id")
    ap.add_argument("--problems", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="verbatim,reworded", help=f"comma separated, of {', '.join(KINDS)}")
    ap.add_argument("--base-budget", type=int, default=256, help="tokens the model alone may decode")
    ap.add_argument("--answer-tokens", type=int, default=12, help="tokens decoded after the answer prefix")
    ap.add_argument("--alone-problems", type=int, default=None, help="measure the alone side on the first N "
                    "problems only (default: all)")
    ap.add_argument("--alone-kinds", default=None, help="measure the alone side on these kinds only (default: all)")
    ap.add_argument("--no-choices", action="store_true", help="leave the choices=numbers side out")
    ap.add_argument("--jsonl", default=None, help="append each question's outcome to this file as it is answered")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if any(k not in KINDS for k in kinds):
        ap.error(f"--kinds takes {', '.join(KINDS)}")
    alone_kinds = None if a.alone_kinds is None else tuple(k for k in a.alone_kinds.split(",") if k)
    r = run(a.model, problems=a.problems, seed=a.seed, kinds=kinds, base_budget=a.base_budget,
            answer_tokens=a.answer_tokens, threads=a.threads, alone_problems=a.alone_problems,
            alone_kinds=alone_kinds, choices=not a.no_choices, jsonl=a.jsonl)
    print(json.dumps(r, indent=1) if a.json else format_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
