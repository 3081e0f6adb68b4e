"""The torch settings the canonical runner pins, applied only while an engine computes.

torch keeps its deterministic-algorithms flag, its float32 matmul precision, its intra-op thread count
and (on a GPU) the cuDNN / TF32 switches per process. An `Engine` needs them fixed for its logits to be
repeatable, but must not change them for the rest of the user's program: so each engine call runs
inside `Determinism.applied()`, which sets them, and puts back what was there when the call returns
(or raises). The execution profile records the values in force inside (profile.py), so blocks made
under other settings are refused, never silently mixed.

Calls are serialised process-wide while the settings are applied (one lock for every engine): two
engines computing at once in two threads would otherwise see each other's thread count, and on a
2-core machine concurrent forwards only oversubscribe the cores. The lock is re-entrant, so an engine
call that makes another (verify -> forward) nests.

One thing cannot be scoped: on a GPU, cuBLAS reads `CUBLAS_WORKSPACE_CONFIG` from the environment when
it starts, so an engine on a CUDA device sets it once (if the user has not) and logs that it did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvmemory.kernels import omp_pool

log = logging.getLogger(__name__)

_LOCK = threading.RLock()
CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic GEMMs (PyTorch's reproducibility notes)


@dataclass(slots=True, frozen=True)
class Determinism:
    """What an engine pins for the duration of each of its calls."""

    device_type: str  # "cpu" or "cuda"
    threads: int  # torch intra-op threads

    @classmethod
    def for_device(cls, device: torch.device, threads: int | None = None) -> "Determinism":
        """The settings for an engine on `device`; `threads=None` keeps the count torch has now."""
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if device.type == "cuda" and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
            log.info("kvmemory: set CUBLAS_WORKSPACE_CONFIG=%s for deterministic cuBLAS (process-wide, once)",
                     CUBLAS_WORKSPACE)
        return cls(device.type, int(threads or torch.get_num_threads()))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Apply the settings, run the body, restore what was in force before."""
        with _LOCK:
            saved = _snapshot()
            try:
                _apply(self)
                yield
            finally:
                _restore(saved)
        if not _LOCK._is_owned():  # the outermost call: one OpenMP pool per process (kernels/omp_pool.py)
            omp_pool.after_parallel_work()

    def to_json(self) -> dict:
        """What the execution profile records (read inside `applied`, so it is what the runner ran under)."""
        return {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cuda_tf32": torch.backends.cuda.matmul.allow_tf32 if self.device_type == "cuda" else None,
        }


def _snapshot() -> dict:
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
    }


def _apply(d: Determinism) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
    if torch.get_num_threads() != d.threads:
        torch.set_num_threads(d.threads)
    if d.device_type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _restore(s: dict) -> None:
    torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["warn_only"])
    torch.set_float32_matmul_precision(s["matmul_precision"])
    if torch.get_num_threads() != s["threads"]:
        torch.set_num_threads(s["threads"])
    torch.backends.cudnn.deterministic = s["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = s["cudnn_benchmark"]
    torch.backends.cuda.matmul.allow_tf32 = s["cuda_tf32"]
    torch.backends.cudnn.allow_tf32 = s["cudnn_tf32"]
