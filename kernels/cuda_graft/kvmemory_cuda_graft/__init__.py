"""kvmemory_cuda_graft: the CUDA graft kernel of kvmemory, as a tiny self-contained distribution.

One op copies a chain of KV blocks from a staging buffer (device memory, or pinned host memory read
directly by the GPU) into a model's per-layer K/V cache tensors, all blocks x layers x {K,V} x heads
in a single launch on the caller's stream, copying bytes, never values. The kernel is plain CUDA
C++ with C entry points (csrc/kvgraft.cu), compiled by `nvcc` into libkvgraft.so and called via
ctypes with raw pointers, so neither building nor loading it needs torch's CUDA headers.

Importing this package never fails, on any machine: without nvcc, a driver or a GPU, `available()`
is False and `status()` says why. The library is built at install time when nvcc is present (see
setup.py), otherwise lazily by `load()` / `build()` into a cache folder ($KVMEMORY_CUDA_GRAFT_CACHE, default
~/.cache/kvmemory-cuda-graft), or explicitly with `python -m kvmemory_cuda_graft build`. $KVMEMORY_CUDA_GRAFT_LIB names a prebuilt
library to use instead. The torch-level op with validation (and its pure-PyTorch twin) is
`kvmemory.kernels.graft_op.graft_copy`; this package is the raw binding.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ._build import (
    BASE_ARCH_LIST,
    LIB_NAME,
    SOURCE,
    BuildError,
    build,
    cached_libraries,
    default_arch_list,
    expected_path,
    find_nvcc,
    merge_arch_lists,
    parse_arch_list,
)
from ._lib import ABI_VERSION, Block, CudaGraftError, Layer, Library

__all__ = [
    "ABI_VERSION", "BASE_ARCH_LIST", "LIB_NAME", "SOURCE", "Block", "BuildError", "CudaGraftError",
    "CudaGraftUnavailable", "Layer", "Library", "Status", "available", "build", "covers", "find_nvcc",
    "load", "status",
]
__version__ = "0.1.0"


class CudaGraftUnavailable(RuntimeError):
    """The library could not be found, built or used here; the message says why."""


@dataclass(slots=True, frozen=True)
class Status:
    available: bool          # library loaded and a CUDA driver new enough for it is present
    reason: str              # why not (or "ok")
    library: str | None      # path of the loaded library
    arch_list: str | None    # arch list it was built for (None when unknown, e.g. $KVMEMORY_CUDA_GRAFT_LIB)
    runtime_version: int     # CUDA runtime linked into the library (e.g. 13000), 0 if unknown
    driver_version: int      # CUDA driver present (0 = none)


_lock = threading.Lock()
_loaded: dict[str, tuple[Library, str | None]] = {}


def _arch_of(path: Path) -> str | None:
    info = path.parent / "BUILD_INFO.txt"
    try:
        for line in info.read_text().splitlines():
            if line.startswith("arch_list="):
                return line.split("=", 1)[1]
    except OSError:
        pass
    return None


def load(arch_list: str | None = None, build_if_missing: bool = True) -> Library:
    """Returns the loaded library, building it first if needed (and nvcc exists).

    Order: $KVMEMORY_CUDA_GRAFT_LIB; the keyed cache entry for (source, nvcc, arch_list), built on demand;
    without nvcc, the newest library already in the cache. Raises CudaGraftUnavailable.
    """
    want = merge_arch_lists(arch_list or default_arch_list(), BASE_ARCH_LIST)
    with _lock:
        if want in _loaded:
            return _loaded[want][0]
        env = os.environ.get("KVMEMORY_CUDA_GRAFT_LIB")
        try:
            if env:
                path, built_for = Path(env), None
            else:
                nvcc = find_nvcc()
                if nvcc is not None:
                    path = expected_path(want, nvcc)  # type: ignore[assignment]
                    if not path.is_file():
                        if not build_if_missing:
                            raise CudaGraftUnavailable(f"libkvgraft for {want} is not built yet")
                        path = build(want, nvcc=nvcc)
                    built_for = want
                else:
                    libs = cached_libraries()
                    if not libs:
                        raise CudaGraftUnavailable(
                            "libkvgraft.so is not built and nvcc is not installed (set KVMEMORY_CUDA_GRAFT_LIB "
                            "to a prebuilt library or install the CUDA toolkit)"
                        )
                    path = libs[0]
                    built_for = _arch_of(path)
            lib = Library(path)
        except (BuildError, CudaGraftError, OSError) as exc:
            raise CudaGraftUnavailable(f"kvmemory_cuda_graft unavailable: {exc}") from exc
        _loaded[want] = (lib, built_for)
        return lib


def covers(arch_list: str | None, capability: tuple[int, int]) -> bool:
    """True when a library built for `arch_list` runs on a device of this compute capability:
    exact SASS for it, or PTX of an arch at or below it (JIT-compiled by the driver)."""
    if not arch_list:
        return True  # unknown (e.g. $KVMEMORY_CUDA_GRAFT_LIB): assume the user built it for their device
    cap = capability[0] * 10 + capability[1]
    for arch, ptx in parse_arch_list(arch_list):
        digits = int(arch.rstrip("af"))
        if arch == f"{cap}" or (ptx and digits <= cap):
            return True
    return False


def status(arch_list: str | None = None, build_if_missing: bool = True) -> Status:
    """Loads (or builds) the library if possible and reports whether it can run here."""
    try:
        want = merge_arch_lists(arch_list or default_arch_list(), BASE_ARCH_LIST)
        lib = load(want, build_if_missing=build_if_missing)
    except (CudaGraftUnavailable, BuildError) as exc:
        return Status(False, str(exc), None, None, 0, 0)
    built_for = _loaded.get(want, (None, None))[1]
    code, rt, drv = lib.cuda_versions()
    if drv == 0:
        why = lib.error_string(code) if code != 0 else "cudaDriverGetVersion reports none"
        return Status(False, f"no CUDA driver ({why})", str(lib.path), built_for, rt, drv)
    # The static runtime needs a driver of at least its major version (minor-version compatibility).
    if drv < (rt // 1000) * 1000:
        return Status(False, f"CUDA driver {drv} is older than the runtime {rt} libkvgraft was built "
                      "with; build it with an older nvcc or update the driver",
                      str(lib.path), built_for, rt, drv)
    return Status(True, "ok", str(lib.path), built_for, rt, drv)


def available(arch_list: str | None = None) -> bool:
    """True when the kernel can be launched here (library loads and a suitable driver exists)."""
    return status(arch_list).available
