"""One OpenMP pool per process (kernels/omp_pool.py): a thread that is not the compute thread gives its
libgomp pool back after its parallel work, so that libgomp never holds more threads than CPUs for long
(past that it sleeps at every barrier: a forward from a second thread took twice as long)."""

from __future__ import annotations

import os
import threading

import torch
from gguf_files import write_tiny_gguf

from kvmemory.engine.engine import Engine
from kvmemory.kernels import omp_pool


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_thread(fn):
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"]


def _parallel_op() -> None:
    torch.set_num_threads(2)
    torch.ones(4_000_000).sum()  # past torch's grain: a parallel region, so a pool of 2


def test_release_ends_the_calling_threads_pool_workers():
    def body():
        before = _os_threads()
        _parallel_op()
        with_pool = _os_threads()
        released = omp_pool.release()
        return before, with_pool, released, _os_threads()

    _in_thread(body)  # once first: whatever torch starts once per process (not a pool) is there after
    before, with_pool, released, after = _in_thread(body)
    assert released  # torch's libgomp is loaded here and has omp_pause_resource_all
    assert with_pool == before + 1  # the pool's one worker
    assert after == before


def test_a_kept_thread_keeps_its_pool_and_others_do_not(tmp_path):
    """An engine call from a request thread leaves no pool behind; the batch scheduler's thread keeps its."""
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", linear_type="Q8_0")[0]
    eng = Engine.open(str(path), tmp_path / "store", chunk=16, threads=2)

    def request_thread():
        before = _os_threads()
        eng.forward(list(range(5, 60)), max_new_tokens=2)
        return before, _os_threads()

    _in_thread(request_thread)  # once first (see above)
    before, after = _in_thread(request_thread)
    assert after == before

    def kept_thread():
        omp_pool.keep_here()
        before = _os_threads()
        eng.forward(list(range(5, 60)), max_new_tokens=2)
        _parallel_op()
        kept = _os_threads()
        omp_pool.after_parallel_work()  # kept: a no-op here
        return before, kept, _os_threads()

    before, kept, after = _in_thread(kept_thread)
    assert kept == before + 1 and after == kept
