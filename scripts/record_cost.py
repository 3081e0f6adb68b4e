"""What keeping entry records (store/records.py) costs a commit, and what rebuilding a lost catalogue
costs, on synthetic entries (tests/redis_server.py's: 3 blocks of 4 KiB each): BENCHMARKS.md,
"Reliability".

    python scripts/record_cost.py [--entries 200] [--json]

Times `LocalStore.commit_entry` with records (the default: one small JSON file written, fsynced and
renamed, and its folder fsynced, before the catalogue transaction) against a store without them
(`records=False`, what Redis's cache tier uses), interleaved; then deletes the catalogue and times
`fsck --repair` rebuilding it. Medians and totals in milliseconds; the machine's load is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_server import synth_entry  # noqa: E402

from kvmemory.store.fsck import fsck_at  # noqa: E402
from kvmemory.store.local import LocalStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        on, off = LocalStore(Path(tmp) / "records"), LocalStore(Path(tmp) / "plain", records=False)
        t_on, t_off = [], []
        for i in range(args.entries):
            for store, times in ((on, t_on), (off, t_off)) if i % 2 else ((off, t_off), (on, t_on)):
                e, b = synth_entry(i, n_blocks=3, shared=1)
                t0 = time.perf_counter()
                store.commit_entry(e, b)
                times.append(1000 * (time.perf_counter() - t0))
        on.close()
        for f in (Path(tmp) / "records").glob("catalogue.sqlite*"):
            f.unlink()
        t0 = time.perf_counter()
        rep = fsck_at(str(Path(tmp) / "records"), repair=True)
        rebuild_ms = 1000 * (time.perf_counter() - t0)
        restored = rep.rebuild["counts"]["entries_restored"] if rep.rebuild else 0
    out = {"entries": args.entries, "commit_ms_median_with_records": round(statistics.median(t_on), 3),
           "commit_ms_median_without_records": round(statistics.median(t_off), 3),
           "record_overhead_ms_median": round(statistics.median(t_on) - statistics.median(t_off), 3),
           "rebuild_ms_total": round(rebuild_ms, 1), "entries_restored": restored,
           "load_average": os.getloadavg()}
    print(json.dumps(out, indent=1) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
