"""The engine-level sections of scripts/gpu_check.py (issue 39, items 3, 5 and 6): what kvmemory's Engine
does on the device, as opposed to the graft kernel alone (gpu_check.py's own sections).

  graphs   CUDA graphs against the same static steps run eagerly: the tiny architecture matrix's
           recompute logits torch.equal between step modes "cuda-graph" and "static" (a diagnostic: the two
           are separate profiles), each engine's probe, and the time per grid step and per decode step of
           a SmolLM2-135M-shaped model under "dynamic" (the runner before graphs), "static" and "cuda-graph"
  matrix   the tiny architecture matrix (7 families, float32 and bfloat16) through the Engine on CUDA,
           step modes "cuda-graph" (the default there) and "dynamic" (the runner before graphs; "static"
           runs in pytest's GPU tests): graft + computed suffix torch.equal to the recompute, prefill and
           decode logits, and verify_tokens bit-identical
  bench    `kvmemory bench gpu` (kvmemory/bench/gpu.py): SmolLM2-135M and Llama-3.1-8B shapes at 32k, 8k,
           2k (in that order: what matters most first), 3 repeats, written into the JSON after each length
  pytest   the GPU tests: tests/test_graft_op.py, test_kernel_build.py, test_cache.py whole, and the
           GPU-marked tests of tests/test_static_step.py and tests/test_pipeline.py

Each takes `deadline` (time.monotonic()): it starts nothing new after it, and says what it left out. A dry
run (--dry-run, the CPU) runs the same code on tiny shapes: "static" stands in for "cuda-graph", the tiny
shape for the model shapes, and pytest only collects the GPU tests (all skipped without CUDA).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
NESTED = "KVMEMORY_GPU_CHECK_NESTED"  # set in the pytest subprocess: its dry-run test must not recurse


def _tests_on_path() -> None:
    for p in (ROOT, ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _modes(dry_run: bool) -> list[str]:
    return ["static", "dynamic"] if dry_run else ["cuda-graph", "static", "dynamic"]


def section_graphs(rec: dict, args, device: torch.device, deadline: float) -> None:
    _tests_on_path()
    from tiny_models import tiny_engine

    graphs = "static" if args.dry_run else "cuda-graph"
    # full attention, sliding windows in every layer, mixed layer types, eager attention (the matrix
    # section and pytest's GPU tests run all seven)
    archs = ["llama", "gemma3"] if args.dry_run or args.quick else ["llama", "mistral", "gemma2", "gemma3"]
    cases, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            for dtype in (torch.float32, torch.bfloat16):
                if time.monotonic() > deadline:
                    rec.setdefault("left_out", []).append(f"{arch} {dtype}")
                    continue
                a = tiny_engine(arch, f"{tmp}/{arch}-{dtype}-a", dtype, step=graphs, device=str(device))
                b = tiny_engine(arch, f"{tmp}/{arch}-{dtype}-b", dtype, step="static", device=str(device))
                ids = _ids(130)
                ra = a.recompute(ids, max_new_tokens=5, stop_token_ids=())
                rb = b.recompute(ids, max_new_tokens=5, stop_token_ids=())
                equal = torch.equal(ra.prefill_logits, rb.prefill_logits) and torch.equal(ra.decode_logits,
                                                                                           rb.decode_logits)
                grid = a.runner.static
                case = {"arch": arch, "dtype": str(dtype).removeprefix("torch."), "captured_equal_eager": equal,
                        "step_mode": a.runner.step_mode, "probe_equal": grid.probe_equal, "captures": grid.captures,
                        "fallback": grid.fallback,
                        "max_abs_diff": float((ra.prefill_logits.float() - rb.prefill_logits.float()).abs().max())}
                cases.append(case)
                ok = ok and equal and case["step_mode"] == graphs
                print(f"  {case}", flush=True)
    rec["cases"] = cases
    rec["note"] = ("captured vs eager static steps: measured, not relied on (two profiles); the dry run compares "
                   "static with static") if args.dry_run else "captured vs eager static steps (two profiles)"
    if time.monotonic() < deadline:
        rec["step_times"] = _step_times(args, device)
    if not ok:
        rec["ok_override"] = False


def _step_times(args, device: torch.device) -> dict:
    """Milliseconds per 64-token grid step (a 2k-token recompute: 32 steps) and per decode step (32) of a
    SmolLM2-135M-shaped random model, per step mode (the tiny shape in a dry run)."""
    from kvmemory.bench.gpu import SHAPES, IdTokenizer, _random_models
    from kvmemory.engine.engine import Engine
    from kvmemory.models.loading import LoadedModel
    from kvmemory.store.local import LocalStore

    shape, n = ("tiny", 256) if args.dry_run else ("smollm2-135m", 2048)
    cfg = SHAPES[shape](n + 128)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model, _ = _random_models(cfg, dtype, device, 0)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    out = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "tokens": n, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in _modes(args.dry_run):
            eng = Engine(LoadedModel(model, IdTokenizer(cfg.vocab_size), shape, shape), LocalStore(f"{tmp}/{mode}"),
                         chunk=64, max_positions=n + 128, step=mode)
            eng.recompute(ids, logits="last", keep_logits=False)  # warm-up: graphs captured, cache grown
            eng.recompute(ids[:64], max_new_tokens=33, stop_token_ids=(), logits="last", keep_logits=False)
            grid, dec = [], []
            for _ in range(3):
                r = eng.recompute(ids, logits="last", keep_logits=False)
                grid.append(r.prefill_seconds / (n // 64) * 1e3)
                r = eng.recompute(ids[:64], max_new_tokens=33, stop_token_ids=(), logits="last", keep_logits=False)
                dec.append(r.decode_seconds / 32 * 1e3)
            out["modes"][eng.runner.step_mode] = {"grid_step_ms": min(grid), "decode_step_ms": min(dec),
                                                  "grid_step_ms_samples": grid, "decode_step_ms_samples": dec}
            print(f"  {shape} {mode}: {out['modes'][eng.runner.step_mode]}", flush=True)
            del eng
    return out


def section_matrix(rec: dict, args, device: torch.device, deadline: float) -> None:
    _tests_on_path()
    from tiny_models import ARCHS, tiny_engine

    archs = ["llama", "gemma3"] if args.dry_run else ARCHS
    cases, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("static", "dynamic") if args.dry_run else ("cuda-graph", "dynamic"):
            for arch in archs:
                for dtype in (torch.float32, torch.bfloat16):
                    name = f"{mode} {arch} {str(dtype).removeprefix('torch.')}"
                    if time.monotonic() > deadline:
                        rec.setdefault("left_out", []).append(name)
                        continue
                    eng = tiny_engine(arch, f"{tmp}/{mode}-{arch}-{dtype}", dtype, step=mode, device=str(device))
                    ids = _ids(130)
                    eng.store_prefix(ids[:100])
                    got, rep = eng.forward(ids, max_new_tokens=5, stop_token_ids=(), keep_logits=True)
                    ref = eng.recompute(ids, max_new_tokens=5, stop_token_ids=())
                    vr = eng.verify_tokens(ids, decode_tokens=3, single_pass=False)
                    case = {"case": name, "step_mode": eng.runner.step_mode, "tokens_grafted": rep.tokens_grafted,
                            "prefill_equal": torch.equal(got.prefill_logits, ref.prefill_logits[96:]),
                            "decode_equal": torch.equal(got.decode_logits, ref.decode_logits),
                            "tokens_equal": got.generated == ref.generated, "verify_bit_identical": vr.bit_identical}
                    good = (case["prefill_equal"] and case["decode_equal"] and case["tokens_equal"]
                            and case["verify_bit_identical"] and rep.tokens_grafted == 96 and case["step_mode"] == mode)
                    ok = ok and good
                    cases.append(case)
                    print(f"  {'ok ' if good else 'BAD'} {case}", flush=True)
    rec["cases"], rec["equal"] = cases, sum(1 for c in cases if c["prefill_equal"] and c["decode_equal"])
    if not ok or not cases:
        rec["ok_override"] = False


def section_bench(rec: dict, args, device: torch.device, deadline: float, write) -> None:
    from kvmemory.bench.gpu import format_table, plot, run_gpu_bench

    if args.dry_run:
        shapes, lengths, repeats, step = ["tiny"], [192, 128], 3, "static"
    else:
        shapes, lengths, repeats, step = ["smollm2-135m", "llama-3.1-8b"], [32768, 8192, 2048], 3, "auto"

    def keep(report: dict) -> None:
        rec["report"] = report
        write()

    r = run_gpu_bench(shapes, lengths=lengths, repeats=repeats, device=str(device), step=step, progress=True,
                      deadline=deadline, on_result=keep)
    rec["report"] = r
    rec["table"] = format_table(r)
    print(rec["table"], flush=True)
    try:
        path = Path(args.out).with_suffix(".bench_gpu.png")
        plot(r, str(path))
        rec["plot"] = str(path)
    except ImportError as exc:  # matplotlib is not on the device machine: plot the JSON elsewhere
        rec["plot"] = f"not drawn here ({exc}): kvmemory.bench.gpu.plot(json.load(...)['sections']['bench']['report'], PATH)"
    if not r["ok"]:
        rec["ok_override"] = False


def section_pytest(rec: dict, args, device: torch.device, deadline: float) -> None:
    if os.environ.get(NESTED):
        rec["skipped"] = "inside gpu_check's own pytest run"
        return
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        raise RuntimeError("pytest is not installed here: carry its wheels (pytest, pluggy, iniconfig, packaging)")
    whole = ["tests/test_graft_op.py", "tests/test_kernel_build.py", "tests/test_cache.py"]
    runs = [whole + ["-m", "gpu"], ["tests/test_static_step.py", "tests/test_pipeline.py", "tests/test_bench_gpu.py",
                                    "-m", "gpu"]] \
        if args.dry_run else [whole, ["tests/test_static_step.py", "tests/test_pipeline.py", "-m", "gpu"]]
    env = dict(os.environ, **{NESTED: "1"})
    results, ok = [], True
    for argv in runs:
        left = deadline - time.monotonic()
        if left < 10:
            results.append({"argv": argv, "skipped": "time budget spent"})
            ok = False
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not gpu_check", *argv]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            out, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, code = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), "timeout"
        summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line)), "")
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)}
        # pytest exits 5 when every test of a run was deselected (the dry run's CPU has no GPU tests to run)
        good = code == 0 or (code == 5 and args.dry_run)
        ok = ok and good and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
        results.append({"argv": argv, "returncode": code, "summary": summary, "counts": counts,
                        "seconds": round(time.perf_counter() - t, 1), "tail": out[-3000:] if not good else out[-400:]})
        print(f"  pytest {' '.join(argv)}: {summary} (exit {code})", flush=True)
    rec["runs"] = results
    if not ok:
        rec["ok_override"] = False
