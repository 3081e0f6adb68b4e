"""One OpenMP thread pool per process: the threads that are not the process's compute thread give theirs
back after their parallel work.

torch's CPU ops and kvmemory's kernels (csrc/parallel.h) run their parallel loops on libgomp, which
keeps a pool of worker threads per thread that ever started a parallel region, for as long as that
thread lives. Once the pools hold more threads than the machine has CPUs, libgomp stops spinning at
its barriers (100 spins, then a futex sleep: `gomp_throttled_spin_count_var`), and every parallel
region then pays a sleep and a wake-up. A server has that at once: the main thread loaded the model (a
pool), the batch thread steps it (a second pool), its request threads embed questions (more). Measured
on 2 cores (SmolLM2, q8, a 40-token prompt and 24 decoded tokens): 0.20 s from the thread that loaded
the model, 0.43 s from another thread while the loader's pool lived, 0.22 s once it was given back.

So: `release()` gives the calling thread's pool back (`omp_pause_resource_all(omp_pause_hard)`, OpenMP
5.0: its workers end, and the next parallel region there starts a new pool, ~80 us), and
`after_parallel_work()` does it unless the calling thread said it keeps its pool (`keep_here()`: the
batch scheduler's thread, which computes step after step). Engine calls (determinism.applied), the
loading of a model (Engine.open) and the router's embedder call it. Bits never depend on which
threads run a loop (parallel.h), so none of this changes a result. A no-op where libgomp is not
loaded or lacks the call.
"""

from __future__ import annotations

import ctypes
import os
import threading

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free every resource, the threads included


def _pause_call():
    """libgomp's omp_pause_resource_all when the process has libgomp loaded (torch's own), else None."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only the one loaded
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


_pause = None
_resolved = False
_local = threading.local()


def release() -> bool:
    """Give the calling thread's OpenMP pool back (its worker threads end). Returns whether it could."""
    global _pause, _resolved
    if not _resolved:  # resolved at first use: torch (and its libgomp) is loaded by then
        _pause, _resolved = _pause_call(), True
    return _pause is not None and _pause(_OMP_PAUSE_HARD) == 0


def keep_here() -> None:
    """The calling thread computes step after step (the batch scheduler's): it keeps its pool."""
    _local.keep = True


def after_parallel_work() -> None:
    """`release()`, unless the calling thread keeps its pool (`keep_here`)."""
    if not getattr(_local, "keep", False):
        release()


__all__ = ["after_parallel_work", "keep_here", "release"]
