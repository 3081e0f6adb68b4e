"""SHA-256 of many blocks at once (csrc/sha256_lanes.cpp): built at install time, called by ctypes.

Verifying a graft is SHA-256 over every byte it grafts, and on a CPU that is most of a graft's read
time. OpenSSL (hashlib) hashes one message at a time with the CPU's SHA instructions (~1.7 GB/s per
core on the EPYC of BENCHMARKS.md); the blocks of a chain are independent messages of one size, so
the kernel hashes 16 of them at once in the 16 lanes of AVX-512 registers (~2.7 GB/s per core there:
`python -m kvmemory.kernels.sha256_lanes` measures both on yours). The digests are plain SHA-256, equal to
hashlib's (tested). With fewer than `fewest_lanes()` blocks to a call the idle lanes make it slower
than hashlib, so callers keep hashlib for those.

`read_hash_lanes` also reads: it opens each block's file, checks that it still begins with the header
checked before, reads a slab of the block's rows at a time into the reader thread's own scratch buffer
(one pread per slab), hashes the slab there while it is still in the CPU cache and stores the bytes
hashed into the block's rows of the cache (non-temporal stores: the cache rows are not read first),
all without the GIL — the bytes hashed are the bytes the cache holds, and a reader thread makes no
system call holding the GIL. (Read straight into the cache rows instead, an 8k-token graft's read and
verify ran 9 % slower side by side: every row's lines were fetched before being overwritten.)

Plain C++ (no torch headers), built into the package at install time (build.py) in two builds, one
chosen once per process by what the CPU runs (`kind()`, native.py): "avx512" (16 lanes in one
register) or, on x86 CPUs with the SHA extensions but no AVX-512, "sha-ni" (each lane hashed on its
own with the SHA instructions, as OpenSSL would, but right where the reader put it, with no copy and
no GIL). KVMEMORY_SHA256_LANES=avx512|sha-ni|off asks for one. Where neither can run (another CPU, a
missing build) `load()` returns None, `why_unavailable()` says why (logged once), and hashing stays
on hashlib.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import sys

import numpy as np

from kvmemory.kernels import native
from kvmemory.kernels.cpu import isa

log = logging.getLogger(__name__)

KERNEL = "sha256"
LANES = 16  # messages per call, at most
# Per build, the fewest blocks a call should hash (with AVX-512, idle lanes make a call of fewer
# than 10 slower than hashlib on the same bytes; SHA-NI lanes cost nothing idle).
_FEWEST = {"avx512": 10, "sha-ni": 1}

def builds_here() -> dict[str, bool]:
    """Per build, whether this CPU runs it."""
    return {"avx512": isa() == "AVX512", "sha-ni": native.runs("SHA-NI")}


def _declare(lib: ctypes.CDLL) -> None:
    u64p, i64p, u8p = (np.ctypeslib.ndpointer(t, flags="C_CONTIGUOUS") for t in (np.uint64, np.int64, np.uint8))
    lib.kvm_sha256_lanes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, u64p, u8p]
    lib.kvm_sha256_lanes.restype = ctypes.c_int
    # The segments' addresses as a plain pointer: null (None) asks for no stores (read and hash only).
    lib.kvm_read_hash_lanes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p,
                                        ctypes.POINTER(ctypes.c_char_p), ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_int64, i64p, u8p]
    lib.kvm_read_hash_lanes.restype = ctypes.c_int


KERNEL_LIB = native.Kernel(KERNEL, _declare)
load, why_unavailable, build_info = KERNEL_LIB.load, KERNEL_LIB.why_unavailable, KERNEL_LIB.build_info


def kind() -> str | None:
    """The build this CPU runs: "avx512", "sha-ni", or None (neither). KVMEMORY_SHA256_LANES=sha-ni
    (or avx512, or off) asks for one; a build the CPU cannot run is refused, with the reason."""
    return KERNEL_LIB.variant()


def fewest_lanes() -> int:
    """The fewest blocks worth one call of this CPU's build."""
    return _FEWEST[kind()] if kind() else LANES


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


def read_hash_lanes(paths: list, offsets: list[int], segments: np.ndarray | None, seg_bytes: int,
                    heads: list[bytes | None] | None = None, slab: int = 16,
                    nseg: int | None = None) -> tuple[list[int], list[bytes]]:
    """Open file `paths[l]`, check that it begins with `heads[l]` (its `offsets[l]` header bytes, as
    checked before; None: no check), then read lane l's payload from byte `offsets[l]` on, hash it and
    store it into lane l's segments (`segments[l]`: addresses of `seg_bytes`-byte buffers, in payload
    order), every lane in one call without the GIL. `segments=None` stores nothing (the payload, `nseg`
    segments long, is read and hashed only: the bench's raw floor). Returns, per lane, the payload bytes
    read (+1 when the file holds more after the payload), or MISSING / HEAD_CHANGED / READ_ERROR, and
    the digest."""
    lib = load()
    if segments is None:
        if nseg is None:
            raise ValueError("without segments, nseg (the payload's segments) is needed")
        lanes, seg_ptr = len(paths), None
    else:
        segments = np.ascontiguousarray(segments, dtype=np.uint64)
        (lanes, nseg), seg_ptr = segments.shape, segments.ctypes.data
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
                                 seg_ptr, slab, got, out)
    if rc:
        raise ValueError("bad arguments to kvm_read_hash_lanes")
    return got.tolist(), [out[32 * i : 32 * i + 32].tobytes() for i in range(lanes)]


def _main() -> None:
    """Time this CPU's build against hashlib on 16 buffers of 3 MB (one thread)."""
    import time

    if load() is None:
        sys.exit(f"unavailable: {why_unavailable()}")
    print(f"library ({kind()}): {build_info()['path']}")
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
