"""The few-query CPU attention kernel (csrc/few_query_attention.cpp): built once, loaded once.

A graft's step attends 16 new tokens (1 while decoding) to thousands of cached positions. torch's
CPU flash attention splits that call by query head only and runs at about half the machine's
float32 FMA rate; the kernel folds the query heads of each K/V head into one block of rows, splits
the keys into fixed units and merges them by log-sum-exp. For SmolLM2's shapes on 2-core EPYCs
(`python -m kvmemory.kernels.few_query_attention` measures it on yours), against SDPA: with AVX-512, 1.5-1.8x at 2k
cached tokens, 2.3-2.6x at 8k and 16k in float32, 2.2x and 2.3-2.7x in bfloat16 (scores by
AVX512-BF16 where the CPU has it), decoding one token 1.3x (float32) and 10-13x (bfloat16); with AVX2
(Zen 3), 1.3x at 2k and 1.6-1.7x at 8k and 16k in float32 (~100 GFLOP/s on 2 cores, ~60 % of the FMA
peak), 1.4x in bfloat16, decoding 1.2x and 8x.

It is built and loaded by cpu.py (once per source, torch version and ISA: AVX-512, or
AVX2 + FMA for CPUs without it). Chosen once per process: `load()` returns the module, or None with
`why_unavailable()` saying why (neither ISA, no compiler ...), and the attention name in the execution
profile records which attention ran (attention.py); the profile's `cpu_isa` keeps the two builds' bits
apart.

Numerics: float32 accumulation for both dtypes, one rounding to the output dtype; it is not
bit-equal to SDPA (different order of sums) and is not claimed to be: it is its own profile.
For one shape the bytes are fixed: key units depend on the number of keys alone and each runs in
one thread, so neither the thread count nor scheduling changes a bit.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import torch

from kvmemory.kernels import cpu
from kvmemory.kernels.cpu import BUILDS, isa

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "few_query_attention.cpp"
MAX_ROWS = 64  # query heads per K/V head x new tokens the kernel takes (its kMaxRowBlocks x 16)
_PREFIX = "kvmemory_fewq"

_why: str | None = None


def build_dir() -> Path:
    return cpu.build_dir(_PREFIX, SOURCE)


@functools.cache
def load():
    """The compiled kernel module, or None where it cannot run here (see `why_unavailable`)."""
    global _why
    module, _why = cpu.load(_PREFIX, SOURCE, "few-query CPU attention kernel")
    if module is None and isa() in BUILDS:
        log.warning("kvmemory: few-query attention kernel unavailable (%s); attention runs on SDPA", _why)
    return module


def why_unavailable() -> str | None:
    load()
    return _why


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
           causal: bool) -> torch.Tensor | None:
    """[1, T, H_q, D] attention output, or None when this call is not one the kernel takes (the caller
    runs SDPA). Shapes as transformers passes them: query [1, H_q, T, D], key/value [1, H_kv, S, D],
    mask [1, 1, T, S] bool (rows must be prefixes of trues) or None (`causal`: bottom-right aligned)."""
    module = load()
    if module is None:
        return None
    return module.few_query_attention(query, key, value, mask, float(scale), bool(causal))  # None: refused


def _main() -> None:
    """Build the kernel, then time it against SDPA on SmolLM2's attention shapes."""
    import time

    module = load()
    if module is None:
        sys.exit(f"unavailable: {why_unavailable()}")
    print(f"built: {build_dir()}")
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


if __name__ == "__main__":
    _main()
