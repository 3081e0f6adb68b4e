"""Remembering N entries one at a time (`KVMemory.remember`) vs in one batch (`KVMemory.remember_many`).

Two fresh stores on the same engine (one model loaded once), the same N generated problems (verifier
"arithmetic"). Each side is warmed up by one entry of its own first (the router's embedder loads, the
catalogue is created), then timed end to end. It reports per-entry seconds of each side and their
ratio (medians of `repeats` rounds, the sides' order alternating), and splits each side's time into the model's part (computing and proving each entry's KV:
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
    from kvmemory.bench.problems import generate_problems

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


def run_remember_bench(*, entries: int = 10, seed: int = 0, model: str | None = None, repeats: int = 1,
                       progress: bool = False) -> dict:
    """`repeats` rounds, each on fresh stores, the sides in alternating order (one at a time first in
    even rounds, the batch first in odd ones) so that a machine's load drifting over the run weighs on
    both; per-entry figures are medians over the rounds."""
    import statistics

    from kvmemory.bench.serve import git_commit, machine_and_software
    from kvmemory.engine.engine import Engine
    from kvmemory.memory.facade import KVMemory
    from kvmemory.models.loading import DEFAULT_MODEL, load_model
    from kvmemory.store.local import LocalStore

    items = _items(entries, seed)
    warm = _items(2, seed + 1000)
    loaded = load_model(model or DEFAULT_MODEL)
    n = max(entries, 1)
    rounds, refused, same = [], [], True
    with tempfile.TemporaryDirectory(prefix="kvmemory-bench-remember-") as tmp:
        for r in range(repeats):
            one = KVMemory(Engine(loaded, LocalStore(f"{tmp}/{r}-one")))
            many = KVMemory(Engine(loaded, LocalStore(f"{tmp}/{r}-many")))
            one.remember(**warm[0])
            many.remember_many([warm[1]])
            got: dict = {}

            def side_one() -> None:
                with _ModelClock() as clock:
                    t0 = time.perf_counter()
                    got["singles"] = [one.remember(**it) for it in items]
                    got["one"] = (time.perf_counter() - t0, clock.seconds)

            def side_many() -> None:
                with _ModelClock() as clock:
                    t0 = time.perf_counter()
                    got["fates"] = many.remember_many(items, progress=progress)
                    got["many"] = (time.perf_counter() - t0, clock.seconds)

            for side in ((side_one, side_many) if r % 2 == 0 else (side_many, side_one)):
                side()
            bad = [f.to_json() for f in got["fates"] if not f.ok]
            refused += bad
            same = same and not bad and all(
                (s.id, s.chain, s.token_ids) == (f.entry.id, f.entry.chain, f.entry.token_ids)
                for s, f in zip(got["singles"], got["fates"]))
            rounds.append({"one_at_a_time": {"s_per_entry": got["one"][0] / n, "model_s_per_entry": got["one"][1] / n},
                           "batch": {"s_per_entry": got["many"][0] / n, "model_s_per_entry": got["many"][1] / n},
                           "order": "one at a time first" if r % 2 == 0 else "batch first"})

    def med(side: str, key: str) -> float:
        return statistics.median(x[side][key] for x in rounds)

    single_s, batch_s = med("one_at_a_time", "s_per_entry"), med("batch", "s_per_entry")
    single_m, batch_m = med("one_at_a_time", "model_s_per_entry"), med("batch", "model_s_per_entry")
    return {
        "bench": "remember", "model": model or DEFAULT_MODEL, "entries": entries, "seed": seed, "repeats": repeats,
        "one_at_a_time_s_per_entry": single_s, "batch_s_per_entry": batch_s,
        "speedup": single_s / batch_s if batch_s > 0 else None,
        "model_s_per_entry": {"one_at_a_time": single_m, "batch": batch_m},
        "rest_s_per_entry": {"one_at_a_time": single_s - single_m, "batch": batch_s - batch_m},
        "rest_speedup": (single_s - single_m) / (batch_s - batch_m) if batch_s > batch_m else None,
        "rounds": rounds, "same_entries_and_kv": same, "refused": refused,
        "machine": machine_and_software(), "commit": git_commit(),
    }


def format_table(r: dict) -> str:
    m, rest = r["model_s_per_entry"], r["rest_s_per_entry"]
    lines = [
        f"remember of {r['entries']} entries on {r['model']} (seconds per entry, median of {r['repeats']} rounds)",
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
