"""Remembering N entries one at a time (`KVMemory.remember`) vs in one batch (`KVMemory.remember_many`).

Two fresh stores on the same engine (one model loaded once), the same N generated problems (verifier
"arithmetic"). Each side is warmed up by one entry of its own first (the router's embedder loads, the
catalogue is created), then timed end to end. It reports per-entry seconds of each side and their
ratio, and splits each side's time into the model's part (computing and proving each entry's KV:
`writes.compute_entry`, the same work on both sides) and the rest (the verifier, the catalogue commit,
routing: what the batch shares). It checks that both sides stored the same entries with the same KV
bytes (the chains are content hashes of the bytes) and reports whether they did.

    kvmemory bench remember --entries 10 --json
"""

from __future__ import annotations

import tempfile
import time

from kvmemory.memory import writes


def _items(n: int, seed: int) -> list[dict]:
    from kvmemory import generate_problems

    return [{"problem": p.text, "solution": p.solution, "answer": str(p.answer), "verifier": "arithmetic"}
            for p in generate_problems(n, seed=seed)]


class _ModelClock:
    """Seconds spent in `writes.compute_entry` while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = writes.compute_entry

    def __enter__(self):
        def timed(mem, plan):
            t0 = time.perf_counter()
            try:
                return self._orig(mem, plan)
            finally:
                self.seconds += time.perf_counter() - t0
        writes.compute_entry = timed
        return self

    def __exit__(self, *exc) -> None:
        writes.compute_entry = self._orig


def run_remember_bench(*, entries: int = 10, seed: int = 0, model: str | None = None, progress: bool = False) -> dict:
    from kvmemory.bench.serve import git_commit, machine_and_software
    from kvmemory.engine.engine import Engine
    from kvmemory.memory.facade import KVMemory
    from kvmemory.models.loading import DEFAULT_MODEL, load_model
    from kvmemory.store.local import LocalStore

    items = _items(entries, seed)
    warm = _items(2, seed + 1000)
    loaded = load_model(model or DEFAULT_MODEL)
    out: dict = {"bench": "remember", "model": model or DEFAULT_MODEL, "entries": entries, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="kvmemory-bench-remember-") as tmp:
        one = KVMemory(Engine(loaded, LocalStore(f"{tmp}/one")))
        many = KVMemory(Engine(loaded, LocalStore(f"{tmp}/many")))
        one.remember(**warm[0])
        many.remember_many([warm[1]])
        with _ModelClock() as clock:
            t0 = time.perf_counter()
            singles = [one.remember(**it) for it in items]
            single_s = time.perf_counter() - t0
        single_model = clock.seconds
        with _ModelClock() as clock:
            t0 = time.perf_counter()
            fates = many.remember_many(items, progress=progress)
            batch_s = time.perf_counter() - t0
        batch_model = clock.seconds
        refused = [f.to_json() for f in fates if not f.ok]
        same = not refused and all((s.id, s.chain, s.token_ids) == (f.entry.id, f.entry.chain, f.entry.token_ids)
                                   for s, f in zip(singles, fates))
        n = max(entries, 1)
        out.update(
            one_at_a_time_s_per_entry=single_s / n, batch_s_per_entry=batch_s / n,
            speedup=single_s / batch_s if batch_s > 0 else None,
            model_s_per_entry={"one_at_a_time": single_model / n, "batch": batch_model / n},
            rest_s_per_entry={"one_at_a_time": (single_s - single_model) / n, "batch": (batch_s - batch_model) / n},
            rest_speedup=((single_s - single_model) / (batch_s - batch_model)) if batch_s > batch_model else None,
            same_entries_and_kv=same, refused=refused,
            machine=machine_and_software(), commit=git_commit(),
        )
    return out


def format_table(r: dict) -> str:
    m, rest = r["model_s_per_entry"], r["rest_s_per_entry"]
    lines = [
        f"remember of {r['entries']} entries on {r['model']} (seconds per entry)",
        f"{'':16s}{'total':>10s}{'model (KV + proof)':>20s}{'the rest':>12s}",
        f"{'one at a time':16s}{r['one_at_a_time_s_per_entry']:10.3f}{m['one_at_a_time']:20.3f}{rest['one_at_a_time']:12.4f}",
        f"{'batch':16s}{r['batch_s_per_entry']:10.3f}{m['batch']:20.3f}{rest['batch']:12.4f}",
        f"speedup: {r['speedup']:.2f}x overall, "
        + (f"{r['rest_speedup']:.1f}x on the rest" if r["rest_speedup"] else "the rest not measurable"),
        f"same entries and KV bytes on both sides: {r['same_entries_and_kv']}",
    ]
    if r["refused"]:
        lines.append(f"refused in the batch: {r['refused']}")
    return "\n".join(lines)
