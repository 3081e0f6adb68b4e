"""The lean step's norm and RoPE kernel (csrc/decode_ops.cpp): transformers' `LlamaRMSNorm` (with the
residual add before it) and RoPE on q / k plus the K/V write into the cache, for a few tokens, each the
same bits as the torch ops it replaces (models/llama_step.py calls it; tests/test_decode_ops.py
compares it with torch's own ops under AVX-512 and AVX2). And `kvm_decode_layer`: one decoder layer's
calls (norms, the GGUF-block linears, RoPE and the cache write, the few-query attention) made from C,
in the order and with the arguments the lean step makes them from Python (`Layer` / `Step` below are
its structs), so that a decode step costs 30 calls instead of ~300.

The norm's mean is a sum whose order is torch's: SumKernel.cpp's cascade over vectors of W floats, W
the width of the build of that kernel torch runs. That is not simply torch's capability (torch 2.13 on
an AVX-512 CPU sums with its AVX2 build, W = 8: measured, its sum is not registered for AVX-512), so
`sum_lanes` finds W by computing norms of seeded random rows both ways and comparing with the torch
code the kernel replaces; where neither width gives its bits, the step keeps torch's ops. A plain C
library built into the package (build.py), loaded by native.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from kvmemory.kernels import native

KERNEL = "decode"
MAX_NORM = 32768  # torch splits a longer row's sum across threads (its grain size): not this kernel's order
WIDTHS = (8, 16)  # the float vector widths of torch's CPU builds (AVX2, AVX-512)
PROBE_ROWS = 32  # rows `sum_lanes` compares: a wrong width gives other bits on most rows of 8+ floats


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.kvm_decode_add_rms_norm.argtypes = [vp, vp, vp, i64, i64, c_float, c_int, vp, vp]
    lib.kvm_decode_add_rms_norm.restype = c_int
    lib.kvm_decode_rope_write.argtypes = [vp, vp, vp, i64, i64, i64, i64, vp, vp, vp, i64, c_int, vp]
    lib.kvm_decode_rope_write.restype = c_int
    lib.kvm_decode_layer.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(Layer), vp, ctypes.POINTER(Layer), vp, vp]
    lib.kvm_decode_rows.argtypes = [ctypes.POINTER(Rows), ctypes.POINTER(Row), i64, i64, vp, i64, vp]
    lib.kvm_decode_rows.restype = c_int
    lib.kvm_decode_rows_layer.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(Layer), vp, ctypes.POINTER(Layer),
                                          ctypes.POINTER(Rows), ctypes.POINTER(Row), i64, i64]
    lib.kvm_decode_rows_layer.restype = c_int
    lib.kvm_decode_layer.restype = c_int
    lib.kvm_decode_layer_scratch.argtypes = [ctypes.POINTER(Step)]
    lib.kvm_decode_layer_scratch.restype = i64


class Linear(ctypes.Structure):
    """csrc/decode_ops.cpp's KvmLinear: a GGUF-block linear's kernel arguments."""
    _fields_ = [("kind", ctypes.c_int64), ("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("panels", ctypes.c_int64), ("in_features", ctypes.c_int64), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """KvmLayer: what a layer's calls need that no step changes (norm weights, linears)."""
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_double),
                ("eps2", ctypes.c_double), ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                # where q/k/v (gate/up) are not fused: k, v (up) beside q (gate); all-zero where they are
                ("k", Linear), ("v", Linear), ("up", Linear)]


class Rows(ctypes.Structure):
    """KvmRows: what the decode rows of a batched step share (kvm_decode_rows)."""
    _fields_ = [("attend", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("hq", "hkv", "D", "kv_bf16")] + [
        ("scale", ctypes.c_double), ("threads", ctypes.c_int64)]


class Row(ctypes.Structure):
    """KvmRow: one sequence's rows of a batched step (a decode row, or T > 1 of a short chunk); the
    per-layer pointers are arrays of c_void_p."""
    _fields_ = [("at", ctypes.c_int64), ("T", ctypes.c_int64), ("causal", ctypes.c_int64), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("q", ctypes.c_void_p),
                ("rope_scratch", ctypes.c_void_p), ("k_write", ctypes.c_void_p), ("v_write", ctypes.c_void_p),
                ("k_read", ctypes.c_void_p), ("v_read", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("keys", ctypes.c_int64), ("mask_st", ctypes.c_int64), ("threads", ctypes.c_int64),
                ("head_stride", ctypes.c_int64)]


class Step(ctypes.Structure):
    """KvmStep: one step's shapes, positions and buffers, shared by its layers' calls."""
    _fields_ = [("linear", ctypes.c_void_p), ("attend", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("T", "hq", "hkv", "D", "hidden", "ffn", "lanes", "threads", "position",
                                             "head_stride", "kv_bf16", "causal", "keys")] + [
        ("mask", ctypes.c_void_p), ("mask_st", ctypes.c_int64), ("scale", ctypes.c_double),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("h", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p)]


KERNEL_LIB = native.Kernel(KERNEL, _declare)
load, load_variant = KERNEL_LIB.load, KERNEL_LIB.load_variant  # the library (None: see why_unavailable)
why_unavailable, build_info = KERNEL_LIB.why_unavailable, KERNEL_LIB.build_info


def sum_lanes(reference: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor, eps: float,
              lib: ctypes.CDLL | None = None) -> int | None:
    """The width W (8 or 16) with which the kernel's norm gives `reference`'s bits (a LlamaRMSNorm's
    `forward` with `weight`, `eps`) on PROBE_ROWS seeded random rows at several scales, or None where
    neither does (or the row is too long for one sum: MAX_NORM)."""
    lib = lib if lib is not None else load()
    n = weight.numel()
    if lib is None or n > MAX_NORM:
        return None
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(1, 1, n, generator=g) * (10.0 ** (i % 8 - 3)) for i in range(PROBE_ROWS)]
    with torch.inference_mode():
        wanted = [reference(r) for r in rows]
        for width in WIDTHS:
            if all(torch.equal(add_rms_norm(r.clone(), weight, eps, lib=lib, width=width), w)
                   for r, w in zip(rows, wanted)):
                return width
    return None


def _check_rc(rc: int) -> None:
    if rc:
        raise ValueError(f"the decode-step kernel refused its arguments ({rc})")


# The calls themselves, without the tensor checks: the lean step (models/llama_step.py) makes ~90 of
# them per token with tensors it made itself, where the checks below would cost more than the work.
def norm_into(lib: ctypes.CDLL, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
              width: int, scratch: torch.Tensor, out: torch.Tensor) -> None:
    """`add_rms_norm` into `out`, unchecked (`scratch`: weight.numel() floats)."""
    n = weight.numel()
    _check_rc(lib.kvm_decode_add_rms_norm(h.data_ptr(), delta.data_ptr() if delta is not None else None,
                                          weight.data_ptr(), h.numel() // n, n, eps, width, scratch.data_ptr(),
                                          out.data_ptr()))


def rope_into(lib: ctypes.CDLL, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
              k_dst: torch.Tensor, v_dst: torch.Tensor) -> torch.Tensor:
    """`rope_write`, unchecked: q [1, hq, T, D]."""
    D = cos.shape[-1]
    T = cos.numel() // D
    q = torch.empty((1, T, hq, D), dtype=torch.float32)  # transformers' q layout: [1, T, H, D] transposed
    scratch = torch.empty(hkv * D, dtype=torch.float32)  # held here while the kernel writes into it
    _check_rc(lib.kvm_decode_rope_write(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, hq, hkv, D, q.data_ptr(),
                                        k_dst.data_ptr(), v_dst.data_ptr(), k_dst.stride(0),
                                        int(k_dst.dtype == torch.bfloat16), scratch.data_ptr()))
    return q.transpose(1, 2)


def _floats(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be float32, contiguous, on the CPU")


def add_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
                 width: int = 8, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`h += delta` in place (where given), then LlamaRMSNorm(h) with `weight`, over h's last dimension
    (rows of n = weight.numel() floats), summing in vectors of `width` floats (`sum_lanes`). `lib`:
    another build than the CPU's own (tests)."""
    lib = lib if lib is not None else load()
    n = weight.numel()
    _floats(weight, "weight")
    for t, name in ((h, "h"),) + (((delta, "delta"),) if delta is not None else ()):
        _floats(t, name)
        if t.shape[-1] != n or t.numel() != h.numel():
            raise ValueError(f"{name} must be rows of {n} floats, as h")
    out = torch.empty_like(h)
    norm_into(lib, h, delta, weight, eps, width, torch.empty(n, dtype=torch.float32), out)
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, k_dst: torch.Tensor,
               v_dst: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """T tokens' q [1, hq, T, D] with RoPE (laid out as transformers' q: [1, T, hq, D] transposed);
    their k (with RoPE) and v written into `k_dst` / `v_dst` ([hkv, T, D] views of a cache's buffers at
    T consecutive positions: float32 or bfloat16). qkv: [T, (hq + 2 hkv) D] float32 contiguous; cos /
    sin: [T, D] (each position's)."""
    lib = lib if lib is not None else load()
    D = cos.shape[-1]
    T = cos.numel() // D
    for t, name in ((qkv, "qkv"), (cos, "cos"), (sin, "sin")):
        _floats(t, name)
    if qkv.numel() != T * (hq + 2 * hkv) * D or sin.shape != cos.shape:
        raise ValueError("qkv must hold T rows of hq + 2 hkv heads of D floats (cos / sin: [T, D])")
    for t in (k_dst, v_dst):
        if (t.dtype not in (torch.float32, torch.bfloat16) or t.shape != (hkv, T, D) or t.stride(2) != 1
                or t.stride(1) != D or t.dtype != k_dst.dtype or t.stride() != k_dst.stride()
                or t.device.type != "cpu"):
            raise ValueError("k_dst / v_dst must be [hkv, T, D] float32 or bfloat16 views of consecutive positions")
    return rope_into(lib, qkv, cos, sin, hq, hkv, k_dst, v_dst)
