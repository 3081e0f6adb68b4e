"""Where a decode step's time goes: `python -m kvmemory.bench.decode_parts [--json]`.

For each context length L (default 512, 2048, 8192 as `bench answer`'s), the context of `bench answer`
is prefilled once, then `steps` single-token steps run through the lean llama step
(models/llama_step.py) with its part marks on: embedding and tables, norms, the q/k/v linears, RoPE,
the cache write, attention, the o linear, the MLP, the final norm and lm_head. Each part's time is
summed over the layers within a step; the report gives each part's median over the steps (ms per
token) and the whole step's, next to the runner's own time per decoded token (`Engine.forward`'s
decode, which adds choosing the token and hashing its logits). With the marks on, the step makes its
calls from Python; a decode step without them makes a layer's calls from C where it can
(llama_step.py's `kvm_decode_layer`): the same steps are timed that way too ("step, layers from C").
The marks cost a few microseconds a step; their figures are for finding the largest parts, `bench
answer` is the speed reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from kvmemory.bench.answer import DEFAULT_LENGTHS, library_ids, question_ids


def run(lengths=DEFAULT_LENGTHS, steps: int = 40, seed: int = 0) -> dict:
    from kvmemory.bench.graft import machine_info
    from kvmemory.engine.engine import Engine
    from kvmemory.errors import InvalidInput, KVMemoryError
    from kvmemory.models.loading import DEFAULT_MODEL

    if steps < 2:
        raise InvalidInput(f"steps must be at least 2, got {steps}")
    tmp = tempfile.TemporaryDirectory(prefix="kvmemory-bench-decode-parts-")
    # room past the model's 8192 positions for the 8k context + question + steps, as `bench answer` opens it
    eng = Engine.open(DEFAULT_MODEL, f"{tmp.name}/store", max_positions=max(lengths) + 512 + 3 * steps)
    runner = eng.runner
    lean = runner._lean_step
    if lean is None:
        raise KVMemoryError("this model and profile decode through transformers' forward: no parts to time")
    q = question_ids(eng, seed)
    out = {"bench": "decode_parts", "profile_id": eng.profile.profile_id, "steps": steps, "lengths": {},
           "machine": machine_info()}
    for L in lengths:
        prompt = library_ids(eng.tokenizer, L, seed)[:L] + q
        # one prefill; its own decode gives the runner's time per token, the marked steps continue it
        cache = runner.new_cache(len(prompt) + 3 * steps)
        first = runner.forward(prompt, cache=cache, max_new_tokens=steps, stop_token_ids=(), keep_logits=False)
        tok, n = first.generated[-1], len(prompt) + steps - 1
        per_step: list[dict[str, float]] = []
        totals = []
        for i in range(steps):
            marks = [("start", time.perf_counter())]
            logits = lean.step(torch.tensor([[tok]]), n + i, cache, marks=marks)
            parts: dict[str, float] = {}
            for (_, t0), (part, t1) in zip(marks, marks[1:]):
                parts[part] = parts.get(part, 0.0) + (t1 - t0)
            per_step.append(parts)
            totals.append(marks[-1][1] - marks[0][1])
            tok = int(logits[-1].argmax())
        unmarked = []  # the same number of steps again, as decoding runs them (no marks)
        for i in range(steps):
            t0 = time.perf_counter()
            logits = lean.step(torch.tensor([[tok]]), n + steps + i, cache)
            unmarked.append(time.perf_counter() - t0)
            tok = int(logits[-1].argmax())
        out["lengths"][str(L)] = {
            "step_ms": statistics.median(totals) * 1e3,
            "unmarked_step_ms": statistics.median(unmarked) * 1e3,
            "layers_from_c": lean.c_layers is not None,
            "parts_ms": {p: statistics.median(s[p] for s in per_step) * 1e3 for p in per_step[0]},
            "runner_ms_per_token": first.decode_seconds / (steps - 1) * 1e3,
        }
    tmp.cleanup()
    return out


def format_table(r: dict) -> str:
    lengths = list(r["lengths"])
    parts = list(r["lengths"][lengths[0]]["parts_ms"])
    lines = ["| part (ms per token, median of %d steps) | " % r["steps"] + " | ".join(f"L = {L}" for L in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for p in parts:
        lines.append(f"| {p} | " + " | ".join(f"{r['lengths'][L]['parts_ms'][p]:.2f}" for L in lengths) + " |")
    lines.append("| **step** | " + " | ".join(f"**{r['lengths'][L]['step_ms']:.2f}**" for L in lengths) + " |")
    lines.append("| step without marks" + (", layers from C" if r["lengths"][lengths[0]]["layers_from_c"] else "")
                 + " | " + " | ".join(f"{r['lengths'][L]['unmarked_step_ms']:.2f}" for L in lengths) + " |")
    lines.append("| runner's time per decoded token | " + " | ".join(
        f"{r['lengths'][L]['runner_ms_per_token']:.2f}" for L in lengths) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvmemory.bench.decode_parts", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="context lengths (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per length (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    r = run([int(x) for x in args.lengths.split(",")], steps=args.steps)
    print(json.dumps(r, indent=1) if args.json else format_table(r))


if __name__ == "__main__":
    main()
