"""Prefill and decode tokens/s of kvmemory's engine against llama.cpp's `llama-server` on the same GGUF file,
side by side, for machines without llama-cpp-python (whose build `kvmemory bench graft --model FILE.gguf`
needs).

    PYTHONPATH=. python scripts/speed_vs_llama_server.py --llama-server PATH [--model GGUF|embedded:NAME]
        [--linears q8] [--threads 2] [--prompt-tokens 128] [--decode-tokens 64] [--repeats 5] [--json OUT]

Both sides get the same seeded random prompt ids (a new prompt every repeat, the same on both sides),
computed from scratch (kvmemory: `Engine.forward(graft=False)`; llama-server: `/completion` with
`cache_prompt` false, one slot, `-t` / `-tb` = --threads), then decode --decode-tokens greedy tokens
without stopping at an end token. Prefill tokens/s = prompt tokens / prefill seconds and decode tokens/s
= (decoded - 1) / decode seconds as each side times itself (kvmemory's ForwardResult, llama-server's
`timings`), medians and [min-max] over --repeats, the sides interleaved so that drift hits both.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary (scripts/build_llama_server.sh)")
    ap.add_argument("--model", default=None, help="a GGUF file or an embedded: name (default: the default embedded model)")
    ap.add_argument("--linears", default="q8", help="kvmemory's linears (q8: 8-bit activations, as llama.cpp)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args()
    if min(args.threads, args.prompt_tokens, args.decode_tokens, args.repeats) < 1:
        raise SystemExit("--threads, --prompt-tokens, --decode-tokens and --repeats must be >= 1")

    import httpx

    from kvmemory.bench.graft import machine_info
    from kvmemory.bench.serve import git_commit, llama_server_process, llama_server_version, resolve_llama_server
    from kvmemory.engine.engine import Engine
    from kvmemory.kernels import cpu
    from kvmemory.models.loading import embedded_gguf_path

    from kvmemory.errors import InvalidInput

    try:
        binary = resolve_llama_server(args.llama_server)
    except InvalidInput as exc:
        raise SystemExit(str(exc)) from None
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if args.model is not None and not (args.model.endswith(".gguf") and Path(args.model).is_file()):
        raise SystemExit(f"--model: {args.model} is not a .gguf file (llama-server needs the file)")
    gguf = args.model or str(embedded_gguf_path())
    kw = {} if args.model is None else {"model": args.model}
    with tempfile.TemporaryDirectory(prefix="kvm-speed-") as tmp:
        eng = Engine.open(store=Path(tmp) / "store", threads=args.threads, linears=args.linears, **kw)
        server = llama_server_process(Path(tmp), binary, gguf, args.threads, 1, "speed")
        server.start()
        try:
            rng = random.Random(0)
            vocab = eng.runner.vocab_size
            sides = {"kvmemory": {"prefill": [], "decode": []}, "llama-server": {"prefill": [], "decode": []}}
            n, d = args.prompt_tokens, args.decode_tokens
            warm = [rng.randrange(100, vocab) for _ in range(n)]
            eng.forward(warm, graft=False, max_new_tokens=2, stop_token_ids=(), logits="last")
            body = {"n_predict": 2, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
            httpx.post(server.url + "/completion", json={**body, "prompt": warm}, timeout=600).raise_for_status()
            for r in range(args.repeats):
                ids = [rng.randrange(100, vocab) for _ in range(n)]
                res, _ = eng.forward(ids, graft=False, max_new_tokens=d, stop_token_ids=(), logits="last")
                sides["kvmemory"]["prefill"].append(n / res.prefill_seconds)
                sides["kvmemory"]["decode"].append((len(res.generated) - 1) / res.decode_seconds)
                out = httpx.post(server.url + "/completion", json={**body, "n_predict": d, "prompt": ids}, timeout=600)
                out.raise_for_status()
                t = out.json()["timings"]
                if t["prompt_n"] != n:
                    raise SystemExit(f"llama-server computed {t['prompt_n']} prompt tokens, not {n}")
                sides["llama-server"]["prefill"].append(t["prompt_per_second"])
                sides["llama-server"]["decode"].append(t["predicted_per_second"])
                print(f"[{r + 1}/{args.repeats}] prefill {sides['kvmemory']['prefill'][-1]:.0f} vs "
                      f"{t['prompt_per_second']:.0f}, decode {sides['kvmemory']['decode'][-1]:.1f} vs "
                      f"{t['predicted_per_second']:.1f} tokens/s", file=sys.stderr)
        finally:
            server.stop()
    report = {"model": str(eng.loaded.source), "gguf": gguf, "linears": eng.profile.linear_impl, "threads": args.threads,
              "cpu_isa": cpu.isa(), "llama_server": llama_server_version(binary),
              "prompt_tokens": n, "decode_tokens": d, "repeats": args.repeats,
              "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": git_commit(), "machine": machine_info(),
              "sides": {s: {k: summary(v) for k, v in m.items()} for s, m in sides.items()}}
    for k in ("prefill", "decode"):
        report[f"{k}_ratio"] = (report["sides"]["kvmemory"][k]["median"] / report["sides"]["llama-server"][k]["median"])
    for s, m in report["sides"].items():
        print(f"{s:>12}: prefill {m['prefill']['median']:.0f} [{m['prefill']['min']:.0f}-{m['prefill']['max']:.0f}] "
              f"tokens/s, decode {m['decode']['median']:.1f} [{m['decode']['min']:.1f}-{m['decode']['max']:.1f}] tokens/s")
    print(f"kvmemory / llama-server: prefill {report['prefill_ratio']:.2f}x, decode {report['decode_ratio']:.2f}x "
          f"({report['model']}, {report['linears']}, {args.threads} threads, {report['cpu_isa']})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
