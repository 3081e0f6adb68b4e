"""SHA-256 of many blocks at once (csrc/sha256_lanes.cpp): built once, loaded once, called by ctypes.

Verifying a graft is SHA-256 over every byte it grafts, and on a CPU that is most of a graft's read
time. OpenSSL (hashlib) hashes one message at a time with the CPU's SHA instructions (~1.7 GB/s per
core on the EPYC of BENCHMARKS.md); the blocks of a chain are independent messages of one size, so
the kernel hashes 16 of them at once in the 16 lanes of AVX-512 registers (~2.7 GB/s per core there:
`python -m kvmemory.kernels.sha256_lanes` measures both on yours). The digests are plain SHA-256, equal to
hashlib's (tested). With fewer than `fewest_lanes()` blocks to a call the idle lanes make it slower
than hashlib, so callers keep hashlib for those.

`read_hash_lanes` also reads: it opens each block's file, checks that it still begins with the header
checked before, fills the block's rows of the cache from it (one preadv per slab of rows) and hashes
the slab while it is still in the CPU cache, all without the GIL — the bytes hashed are the bytes the
cache holds, and a reader thread makes no system call holding the GIL.

Plain C++ (no torch headers), compiled with g++ on first use into the user cache folder (~2 s), in
one of two builds chosen once per process by what the CPU runs (`kind()`): "avx512" (16 lanes in one
register) or, on x86 CPUs with the SHA extensions but no AVX-512, "sha-ni" (each lane hashed on its
own with the SHA instructions, as OpenSSL would, but right where the reader put it, with no copy and
no GIL). Where neither can run (another CPU, no compiler) `load()` returns None, `why_unavailable()`
says why, and hashing stays on hashlib.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvmemory.kernels.cpu import cpu_info

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "sha256_lanes.cpp"
LANES = 16  # messages per call, at most
_BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fno-exceptions"]
# Per build: its compiler flags, and the fewest blocks a call should hash (with AVX-512, idle lanes
# make a call of fewer than 10 slower than hashlib on the same bytes; SHA-NI lanes cost nothing idle).
_BUILDS = {"avx512": (["-mavx512f", "-mavx512bw"], 10),
           "sha-ni": (["-msha", "-msse4.1", "-mssse3", "-DKVM_SHA_NI"], 1)}

_why: str | None = None


def builds_here() -> dict[str, bool]:
    """Per build, whether this CPU runs it."""
    return {"avx512": torch.backends.cpu.get_cpu_capability() == "AVX512",
            "sha-ni": {"sha_ni", "sse4_1", "ssse3"} <= set(cpu_info().get("flags", "").split())}


@functools.cache
def kind() -> str | None:
    """The build this CPU runs: "avx512", "sha-ni", or None (neither). KVMEMORY_SHA256_LANES=sha-ni
    (or avx512, or off) asks for one; a build the CPU cannot run is refused, with the reason."""
    global _why
    _why = None
    runs = builds_here()
    wanted = os.environ.get("KVMEMORY_SHA256_LANES", "").strip().lower()
    if wanted == "off":
        _why = "turned off by KVMEMORY_SHA256_LANES=off"
        return None
    if wanted:
        if wanted not in runs:
            _why = f"KVMEMORY_SHA256_LANES={wanted!r} is none of avx512, sha-ni, off"
        elif not runs[wanted]:
            _why = f"KVMEMORY_SHA256_LANES asks for the {wanted} build, which this CPU cannot run"
        return wanted if runs.get(wanted) else None
    found = next((k for k, ok in runs.items() if ok), None)
    if found is None:
        _why = ("the CPU runs neither AVX-512 nor the SHA extensions "
                f"(torch reports {torch.backends.cpu.get_cpu_capability()})")
    return found


def fewest_lanes() -> int:
    """The fewest blocks worth one call of this CPU's build."""
    return _BUILDS[kind()][1] if kind() else LANES


def _cflags() -> list[str]:
    return _BASE_FLAGS + _BUILDS[kind()][0]


@functools.cache
def library_path() -> Path:
    from kvmemory.paths import cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_cflags()).encode()).hexdigest()[:12]
    return cache_dir() / "ext" / f"kvmemory_sha256_lanes_{kind()}_{digest}.so"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot run here (see `why_unavailable`)."""
    global _why
    if kind() is None:
        return None
    out = library_path()
    try:
        if not out.exists():
            _build(out)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()[-3:]
        _why = f"building {SOURCE.name} failed: {type(exc).__name__}: {' '.join(detail)}"
        log.warning("kvmemory: multi-lane SHA-256 unavailable (%s); blocks are hashed by hashlib", _why)
        return None
    u64p, i64p, u8p = (np.ctypeslib.ndpointer(t, flags="C_CONTIGUOUS") for t in (np.uint64, np.int64, np.uint8))
    lib.kvm_sha256_lanes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, u64p, u8p]
    lib.kvm_sha256_lanes.restype = ctypes.c_int
    lib.kvm_read_hash_lanes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p,
                                        ctypes.POINTER(ctypes.c_char_p), ctypes.c_int64, ctypes.c_int64, u64p,
                                        ctypes.c_int64, i64p, u8p]
    lib.kvm_read_hash_lanes.restype = ctypes.c_int
    return lib


def _build(out: Path) -> None:
    """g++ into a temporary name, then an atomic rename: concurrent first uses do not collide."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise OSError("no C++ compiler (g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cxx, *_cflags(), str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def why_unavailable() -> str | None:
    load()
    return _why


def groups(items: list, threads: int, min_lanes: int | None = None) -> list[list] | None:
    """`items` (blocks) cut into consecutive groups of at most 16, as many as `threads` at least so
    every thread works, of near-equal sizes; None when a group would hold fewer than `min_lanes`
    (default: this CPU's `fewest_lanes()`; idle AVX-512 lanes would make the call slower than hashlib)."""
    if min_lanes is None:
        min_lanes = fewest_lanes()
    if not items:
        return None
    count = max(threads, -(-len(items) // LANES))
    size = -(-len(items) // count)
    if size < min_lanes:
        return None
    return [items[i : i + size] for i in range(0, len(items), size)]


def _pointers(buffers) -> np.ndarray:
    return np.array([np.frombuffer(b, dtype=np.uint8).ctypes.data for b in buffers], dtype=np.uint64)


def sha256_many(buffers) -> list[bytes]:
    """SHA-256 digests of up to 16 writable buffers of one size (a multiple of 64 bytes)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"multi-lane SHA-256 unavailable: {why_unavailable()}")
    sizes = {memoryview(b).nbytes for b in buffers}
    if not 1 <= len(buffers) <= LANES or len(sizes) != 1 or next(iter(sizes)) % 64:
        raise ValueError("1 to 16 buffers of one size, a multiple of 64 bytes")
    out = np.empty(32 * len(buffers), dtype=np.uint8)
    if lib.kvm_sha256_lanes(len(buffers), 1, sizes.pop(), _pointers(buffers), out):
        raise ValueError("bad arguments to kvm_sha256_lanes")
    return [out[32 * i : 32 * i + 32].tobytes() for i in range(len(buffers))]


# read_hash_lanes' byte counts that are not counts (csrc: kMissing, kHeadChanged; -1 any other error).
READ_ERROR, MISSING, HEAD_CHANGED = -1, -2, -3


def read_hash_lanes(paths: list, offsets: list[int], segments: np.ndarray, seg_bytes: int,
                    heads: list[bytes | None] | None = None, slab: int = 16) -> tuple[list[int], list[bytes]]:
    """Open file `paths[l]`, check that it begins with `heads[l]` (its `offsets[l]` header bytes, as
    checked before; None: no check), then fill lane l's segments (`segments[l]`: addresses of
    `seg_bytes`-byte buffers, in payload order) from byte `offsets[l]` on and hash them, every lane
    in one call without the GIL. Returns, per lane, the payload bytes read (+1 when the file holds more
    after the payload), or MISSING / HEAD_CHANGED / READ_ERROR, and the digest."""
    lib = load()
    lanes, nseg = segments.shape
    heads = heads if heads is not None else [None] * lanes
    if not len(paths) == len(offsets) == len(heads) == lanes:
        raise ValueError("one path, offset and head per lane")
    if any(h is not None and len(h) != o for h, o in zip(heads, offsets)):
        raise ValueError("a lane's head must be its offset's length")
    c_paths = (ctypes.c_char_p * lanes)(*[os.fsencode(p) for p in paths])
    c_heads = (ctypes.c_char_p * lanes)(*heads)
    got = np.empty(lanes, dtype=np.int64)
    out = np.empty(32 * lanes, dtype=np.uint8)
    rc = lib.kvm_read_hash_lanes(lanes, c_paths, np.asarray(offsets, dtype=np.int64), c_heads, nseg, seg_bytes,
                                 np.ascontiguousarray(segments, dtype=np.uint64), slab, got, out)
    if rc:
        raise ValueError("bad arguments to kvm_read_hash_lanes")
    return got.tolist(), [out[32 * i : 32 * i + 32].tobytes() for i in range(lanes)]


def _main() -> None:
    """Build, then time this CPU's build against hashlib on 16 buffers of 3 MB (one thread)."""
    import time

    if load() is None:
        sys.exit(f"unavailable: {why_unavailable()}")
    print(f"built ({kind()}): {library_path()}")
    bufs = [bytearray(os.urandom(3 << 20)) for _ in range(LANES)]
    assert sha256_many(bufs) == [hashlib.sha256(b).digest() for b in bufs]
    for name, fn in (("hashlib (one at a time)", lambda: [hashlib.sha256(b).digest() for b in bufs]),
                     (f"16 lanes ({kind()})", lambda: sha256_many(bufs))):
        fn()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        print(f"{name:24} {5 * LANES * len(bufs[0]) / (time.perf_counter() - t) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    _main()
