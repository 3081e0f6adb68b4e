"""The few-query CPU attention kernel (csrc/few_query_attention.cpp): built once, loaded once.

A graft's step attends 16 new tokens (1 while decoding) to thousands of cached positions. torch's
CPU flash attention splits that call by query head only and runs at about half the machine's
float32 FMA rate; the kernel folds the query heads of each K/V head into one block of rows, splits
the keys into fixed units and merges them by log-sum-exp. For SmolLM2's shapes on 2-core EPYCs
(`python -m kvmemory.cpu_attention` measures it on yours), against SDPA: with AVX-512, 1.5-1.8x at 2k
cached tokens, 2.3-2.6x at 8k and 16k in float32, 2.2x and 2.3-2.7x in bfloat16 (scores by
AVX512-BF16 where the CPU has it), decoding one token 1.3x (float32) and 10-13x (bfloat16); with AVX2
(Zen 3), 1.3x at 2k and 1.6-1.7x at 8k and 16k in float32 (~100 GFLOP/s on 2 cores, ~60 % of the FMA
peak), 1.4x in bfloat16, decoding 1.2x and 8x.

It is C++ against torch's headers, compiled on first use with torch's own extension builder (g++,
ninja) into the user cache directory (~30-50 s, once per source/torch version/ISA;
`scripts/setup.sh` does it ahead of time). One source, two builds: AVX-512, and AVX2 + FMA for CPUs
without AVX-512 (`isa()`, torch's own reading of the CPU, picks one). Chosen once per process:
`load()` returns the module, or None with `why_unavailable()` saying why (neither ISA, no compiler
...), and the attention name in the execution profile records which attention ran (attention.py);
the profile's `cpu_isa` keeps the two builds' bits apart.

Numerics: float32 accumulation for both dtypes, one rounding to the output dtype; it is not
bit-equal to SDPA (different order of sums) and is not claimed to be: it is its own profile.
For one shape the bytes are fixed: key units depend on the number of keys alone and each runs in
one thread, so neither the thread count nor scheduling changes a bit.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "few_query_attention.cpp"
MAX_ROWS = 64  # query heads per K/V head x new tokens the kernel takes (its kMaxRowBlocks x 16)
# One source, one build per vector ISA torch reports for this CPU (the profile records that ISA).
BUILDS = {
    "AVX512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"],
    "AVX2": ["-O3", "-mavx2", "-mfma", "-DKVM_AVX2", "-fopenmp"],
}

_why: str | None = None


def isa() -> str:
    """The vector ISA torch's kernels use on this CPU ("AVX512", "AVX2", "DEFAULT" ...)."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def _build_name() -> str:
    flags = " ".join(BUILDS.get(isa(), []))
    digest = hashlib.sha256(SOURCE.read_bytes() + flags.encode() + torch.__version__.encode())
    return f"kvmemory_fewq_{isa().lower()}_{digest.hexdigest()[:12]}"


def build_dir() -> Path:
    from .paths import cache_dir

    return cache_dir() / "ext" / _build_name()


@functools.cache
def load():
    """The compiled kernel module, or None where it cannot run here (see `why_unavailable`)."""
    global _why
    if isa() not in BUILDS:
        _why = f"the CPU runs neither AVX-512 nor AVX2 (torch reports {isa()})"
        return None
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        fresh = not any(out.glob("*.so"))
        if fresh:
            print(f"kvmemory: building the few-query CPU attention kernel into {out} (once, ~30 s)", file=sys.stderr)
        module = cpp_extension.load(_build_name(), [str(SOURCE)], extra_cflags=BUILDS[isa()], extra_ldflags=["-fopenmp"],
                                    build_directory=str(out), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: SDPA runs instead, and the profile says so
        _why = f"building {SOURCE.name} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
        log.warning("kvmemory: few-query attention kernel unavailable (%s); attention runs on SDPA", _why)
        return None
    return module


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel (a dependency) puts it next to this
    Python, which is not on PATH when the venv is not activated (`.venv/bin/python -m pytest`)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # the build then fails and says so
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


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
