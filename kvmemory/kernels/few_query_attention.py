"""The few-query CPU attention kernel (csrc/few_query_attention.cpp): built once, loaded once.

A graft's step attends 16 new tokens (1 while decoding) to thousands of cached positions. torch's
CPU flash attention splits that call by query head only and runs at about half the machine's
float32 FMA rate; the kernel folds the query heads of each K/V head into one block of rows, splits
the keys into fixed units and merges them by log-sum-exp. A decode step under float32 queries
(at most 4 rows per K/V head: SmolLM2's 3) has too few rows to fill the lanes, and takes a path with
the keys in the lanes instead (csrc: `run_unit_few`). For SmolLM2's shapes on 2-core EPYCs
(`python -m kvmemory.kernels.few_query_attention` measures it on yours), against SDPA: with AVX-512, 1.5-1.8x at 2k
cached tokens, 2.3-2.6x at 8k and 16k in float32, 2.2x and 2.3-2.7x in bfloat16 (scores by
AVX512-BF16 where the CPU has it), decoding one token at 8k 3.9x (float32), 7.3x (float32 over a bfloat16
cache: 0.19 ms, 3.6x the rows-in-lanes path it replaced) and 11x (bfloat16); with AVX2 (Zen 3), 1.3x
at 2k and 1.6-1.7x at 8k and 16k in float32 (~100 GFLOP/s on 2 cores, ~60 % of the FMA peak), 1.4x in
bfloat16 (decoding: measured before the keys-in-lanes path, 1.2x and 8x).

A plain C library built into the package at install time (build.py: an AVX-512 build, and an AVX2 +
FMA one for CPUs without it), picked and loaded by native.py. Chosen once per process: `load()` returns
the library, or None with `why_unavailable()` saying why (neither ISA, a missing or stale build ...,
logged once, with the fallback: SDPA), and the attention name in the execution profile records which
attention ran (models/attention.py); the profile's `cpu_isa` keeps the two builds' bits apart.

Numerics: float32 accumulation for both dtypes, one rounding to the output dtype; it is not
bit-equal to SDPA (different order of sums) and is not claimed to be: it is its own profile.
For one shape the bytes are fixed: key units depend on the number of keys alone and each runs in
one thread, so neither the thread count nor scheduling changes a bit.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from kvmemory.kernels import build, native
from kvmemory.kernels.cpu import isa  # noqa: F401  (callers ask `isa() in BUILDS`: has this CPU a build?)

KERNEL = "fewq"
BUILDS = {b.isa: list(b.flags) for b in build.builds(KERNEL)}  # ISA -> the flags of its build
MAX_ROWS = 128  # query heads per K/V head x new tokens the kernel takes (its kMaxRows)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C entry point's dtype codes
BF16_SCORES = 2  # its query code for float32 queries scored as their bfloat16 rounding (the q8 profile's)


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.kvm_fewq_attention.argtypes = ([ctypes.c_int, ctypes.c_int, vp, vp, vp, vp, vp] + [i64] * 12
                                       + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
    lib.kvm_fewq_attention.restype = ctypes.c_int
    lib.kvm_fewq_bf16_dot.argtypes = []
    lib.kvm_fewq_bf16_dot.restype = ctypes.c_int


KERNEL_LIB = native.Kernel(KERNEL, _declare)
load, load_variant = KERNEL_LIB.load, KERNEL_LIB.load_variant  # the library (None: see why_unavailable)
why_unavailable, build_info = KERNEL_LIB.why_unavailable, KERNEL_LIB.build_info


def bf16_dot(lib: ctypes.CDLL | None = None) -> bool | None:
    """Whether the build (`load()`'s) scores bfloat16 pairs by VDPBF16PS on this CPU (None: no build):
    where it does, bfloat16 scores have other bits than the widened path's, so profiles record it."""
    lib = lib if lib is not None else load()
    return None if lib is None else bool(lib.kvm_fewq_bf16_dot())


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
           causal: bool, lib: ctypes.CDLL | None = None, threads: int | None = None,
           bf16_scores: bool = False) -> torch.Tensor | None:
    """[1, T, H_q, D] attention output, or None when this call is not one the kernel takes (the caller
    runs SDPA). Shapes as transformers passes them: query [1, H_q, T, D], key/value [1, H_kv, S, D],
    mask [1, 1, T, S] bool (rows must be prefixes of trues) or None (`causal`: bottom-right aligned).
    `lib`: another build than `load()`'s (load_variant). `threads`: how many threads split the keys (None:
    torch's count); the bytes do not depend on it (the module docstring), only the time: a decode row over
    few keys runs fastest on one (engine/batched_step.py), with no wait for a second core. `bf16_scores`
    (float32 queries over a bfloat16 cache; else ignored): the q8 profile's scores, from the queries
    rounded to bfloat16, by VDPBF16PS where `bf16_dot()` (llama.cpp rounds Q to its cache's type for them);
    calls of at most 4 rows per K/V head (decoding SmolLM2) keep their float32 path."""
    lib = lib if lib is not None else load()
    if lib is None:
        return None
    q, k, v = query, key, value
    # What the C entry point cannot see: dtypes, ranks, the batch of 1, the device, contiguous rows.
    # (Its sizes' limits: head size, rows per K/V head, T <= S, it checks itself and refuses.) Each
    # attribute is read once: a decode step makes this call once per layer.
    qd, kd = _DTYPES.get(q.dtype), _DTYPES.get(k.dtype)
    if qd is None or kd is None or v.dtype is not k.dtype or not (q.is_cpu and k.is_cpu and v.is_cpu):
        return None
    if bf16_scores and qd == 0 and kd == 1:
        qd = BF16_SCORES
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or ks != vs or qs[0] != 1 or ks[0] != 1 or ks[3] != qs[3]:
        return None
    qt, kt, vt = q.stride(), k.stride(), v.stride()
    if qt[3] != 1 or kt[3] != 1 or vt[3] != 1:
        return None
    _, Hq, T, D = qs
    _, Hkv, S, _ = ks
    mask_ptr, mask_st = None, 0
    if mask is not None:
        mt = mask.stride()
        if mask.dtype is not torch.bool or mask.shape != (1, 1, T, S) or mt[3] != 1 or not mask.is_cpu:
            return None
        mask_ptr, mask_st = mask.data_ptr(), mt[2]
    out = torch.empty((1, T, Hq, D), dtype=q.dtype)
    rc = lib.kvm_fewq_attention(qd, kd, q.data_ptr(), k.data_ptr(), v.data_ptr(), mask_ptr, out.data_ptr(), Hq, T, D,
                                Hkv, S, qt[1], qt[2], kt[1], kt[2], vt[1], vt[2], mask_st, scale, causal,
                                threads or torch.get_num_threads())
    if rc == 1:
        return None  # refused: the caller runs SDPA
    if rc != 0:
        raise MemoryError("the few-query attention kernel could not allocate its scratch memory")
    return out


def _main() -> None:
    """Time the kernel against SDPA on SmolLM2's attention shapes."""
    import time

    if load() is None:
        sys.exit(f"unavailable: {why_unavailable()}")
    print(f"library: {build_info()['path']}")
    F = torch.nn.functional
    # (query dtype, cache dtype): the two profiles' own dtypes, and float32 over a bfloat16 cache
    for dtype, kv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                            (torch.float32, torch.bfloat16)):
        for cached, new in ((2048, 16), (8192, 16), (16384, 16), (8192, 1)):
            S = cached + new
            q = torch.randn(1, new, 9, 64).to(dtype).transpose(1, 2)
            k, v = torch.randn(1, 3, S, 64).to(kv_dtype), torch.randn(1, 3, S, 64).to(kv_dtype)
            mask = torch.ones(new, S, dtype=torch.bool).tril(S - new)[None, None]

            def timed(fn, n=20):
                fn()
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                return (time.perf_counter() - t) / n

            # SDPA takes one dtype: over a bfloat16 cache it runs on K/V widened per call (as attention.py does)
            sdpa = timed(lambda: F.scaled_dot_product_attention(q, k.to(dtype), v.to(dtype), attn_mask=mask,
                                                                enable_gqa=True))
            kern = timed(lambda: attend(q, k, v, mask, 0.125, False))
            name = str(dtype).removeprefix("torch.") + ("" if kv_dtype == dtype else "/" + str(kv_dtype).removeprefix("torch."))
            print(f"{name:17} {cached:>5} cached + {new:>2} new: SDPA {sdpa * 1e3:.3f} ms, kernel "
                  f"{kern * 1e3:.3f} ms ({sdpa / kern:.2f}x)")


__all__ = ["BF16_SCORES", "BUILDS", "KERNEL", "MAX_ROWS", "attend", "bf16_dot", "build_info", "isa", "load",
           "load_variant", "why_unavailable"]

if __name__ == "__main__":
    _main()
