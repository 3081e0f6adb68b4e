"""Aggregate decode tokens/s of the batched step (engine/batch.py) at 1, 4 and 16 sequences, against one
sequence decoding alone through the canonical runner, on the default embedded model.

    PYTHONPATH=. python scripts/bench_batched_step.py [--sizes 1 4 16] [--tokens 32] [--repeats 3] [--threads N]
        [--linears auto|q8]

Each sequence has its own cold prompt (~40 tokens); the prompts are prefilled first (not timed), then
every decode step of the batch is timed until each sequence has decoded `--tokens` tokens. Decode
tokens/s = decode rows computed / seconds; the median of `--repeats` runs. The alone line is
`Engine.forward` of one sequence (its decode_seconds), the path every request takes today. Also checks
that each batched sequence's logits hash equals its run alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store", default="/tmp/kvm-bench-batched-store")
    ap.add_argument("--threads", type=int, default=None, help="the engine's threads (default: the cores)")
    ap.add_argument("--linears", default="auto", help="the engine's linears (loading.LINEARS; q8: 8-bit activations)")
    args = ap.parse_args()

    import torch

    from kvmemory.engine.batched_step import why_not
    from kvmemory.engine.engine import Engine

    eng = Engine.open(store=f"{args.store}-{args.linears}", threads=args.threads, linears=args.linears)
    print(f"model {eng.loaded.source}, linears {eng.profile.linear_impl}, threads {eng.determinism.threads}, "
          f"torch {torch.__version__}, "
          f"shared step: {why_not(eng.runner) or 'yes'}")
    rng = random.Random(0)
    vocab = eng.runner.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(30, 50))] for _ in range(max(args.sizes))]
    kw = dict(graft=False, max_new_tokens=args.tokens, stop_token_ids=(), keep_logits=False, logits="last")

    alone_rates, alone_hash = [], {}
    for _ in range(args.repeats):
        res, _ = eng.forward(prompts[0], **kw)
        alone_rates.append((len(res.generated) - 1) / res.decode_seconds)
    for i, p in enumerate(prompts):
        alone_hash[i] = eng.forward(p, **kw)[0].logits_sha256
    out = {"alone (Engine.forward)": statistics.median(alone_rates)}
    for size in args.sizes:
        rates = []
        for _ in range(args.repeats):
            batch = eng.batch()
            seqs = [batch.add(p, **kw) for p in prompts[:size]]
            while not all(s.decoding or s.done for s in seqs):  # prefill every prompt (not timed)
                batch.step()
            rows, t0 = 0, time.perf_counter()
            while batch.step():
                rows += batch.last_rows
            dt = time.perf_counter() - t0
            rates.append(rows / dt)
            assert all(s.result.logits_sha256 == alone_hash[i] for i, s in enumerate(seqs)), "not bit-identical"
        out[f"batched x{size}"] = statistics.median(rates)
    base = out["alone (Engine.forward)"]
    for name, rate in out.items():
        print(f"{name:24} {rate:8.1f} decode tokens/s  ({rate / base:.2f}x alone)")
    print(json.dumps({k: round(v, 2) for k, v in out.items()}))


if __name__ == "__main__":
    main()
