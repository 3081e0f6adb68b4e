"""The GGUF-block linear kernel (csrc/quantized_linear.cpp): y = x @ W.T with W kept as a GGUF file's
own Q4_1 / Q8_0 blocks, re-laid out in panels of 16 output rows, expanded to float32 in cache while it
multiplies (models/gguf_linear.py makes model layers of it).

Layout (the contract with the C code): for N output rows and K inputs, `q` [N/16, K/2, 16] uint8 (Q4_1:
weights 2t and 2t + 1 of a row in one byte, low nibble first) or [N/16, K, 16] int8 (Q8_0), `d` and
`m` [N/16, K/32, 16] float32 (the blocks' scales and, Q4_1 only, minimums). Every weight is expanded to
gguf-py's `d * q + m` exactly: d holds float16 values, as the GGUF's blocks do (checked here), so `d * q`
is exact and the kernel's one FMA rounds as gguf-py's product-then-sum does. Each output is one fixed
sum (k ascending, one FMA each), so a row's bytes depend on nothing else: not the rows beside it, the
thread count, nor AVX-512 vs AVX2.

A plain C library built into the package at install time (build.py: AVX-512 and AVX2 builds), picked
and loaded by native.py; where none runs, `load()` is None and says why once.
"""

from __future__ import annotations

import ctypes

import torch

from kvmemory.kernels import native

KERNEL = "qlinear"
PANEL = 16  # output rows per panel (the kernel's kPanel)
BLOCK = 32  # weights per Q4_1 / Q8_0 block
KINDS = {"Q4_1": 0, "Q8_0": 1}  # GGUF block type -> the kernel's `kind`
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_Q_DTYPES = {0: torch.uint8, 1: torch.int8}


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvm_qlinear_dequantize.argtypes = [c_int, vp, vp, vp, i64, i64, vp, c_int]
    lib.kvm_qlinear_dequantize.restype = c_int
    lib.kvm_qlinear_linear.argtypes = [c_int, vp, i64, vp, vp, vp, i64, i64, vp, c_int]
    lib.kvm_qlinear_linear.restype = c_int


KERNEL_LIB = native.Kernel(KERNEL, _declare)
load, load_variant = KERNEL_LIB.load, KERNEL_LIB.load_variant  # the library (None: see why_unavailable)
why_unavailable, build_info = KERNEL_LIB.why_unavailable, KERNEL_LIB.build_info


def in_features(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int) -> int:
    """K, after checking the panels against the kernel's layout (csrc/quantized_linear.cpp); raises
    ValueError saying what is wrong."""
    if kind not in _Q_DTYPES:
        raise ValueError("kind must be 0 (Q4_1) or 1 (Q8_0)")
    if q.dim() != 3 or q.shape[2] != PANEL or not q.is_contiguous() or q.device.type != "cpu":
        raise ValueError("q must be [N/16, K/2 or K, 16] contiguous on the CPU")
    if q.dtype != _Q_DTYPES[kind]:
        raise ValueError("q has the wrong dtype for its kind")
    K = q.shape[1] * 2 if kind == KINDS["Q4_1"] else q.shape[1]
    if K % BLOCK:
        raise ValueError("K must be a multiple of 32")
    if (d.dtype != torch.float32 or not d.is_contiguous() or d.dim() != 3 or d.device.type != "cpu"
            or tuple(d.shape) != (q.shape[0], K // BLOCK, PANEL)):
        raise ValueError("d must be [N/16, K/32, 16] float32 contiguous")
    if not torch.equal(d.to(torch.float16).to(torch.float32), d):  # csrc/quantized_linear.cpp: exact weights
        raise ValueError("d must hold float16 values (as GGUF blocks store them): the kernel expands d * q exactly "
                         "only for those")
    if kind == KINDS["Q4_1"] and (m.shape != d.shape or m.dtype != torch.float32 or not m.is_contiguous()
                                  or m.device.type != "cpu"):
        raise ValueError("m must be shaped and typed as d")
    return K


def check_rc(rc: int) -> None:
    if rc == -1:
        raise MemoryError("the GGUF-block linear kernel could not allocate its scratch memory")
    if rc != 0:
        raise ValueError(f"the GGUF-block linear kernel refused its arguments ({rc})")


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The float32 weight [N, K] the panels hold, expanded by the kernel's own code (`lib`: another build)."""
    lib = lib if lib is not None else load()
    K = in_features(q, d, m, kind)
    out = torch.empty((q.shape[0] * PANEL, K), dtype=torch.float32)
    m_ptr = m.data_ptr() if kind == KINDS["Q4_1"] else None
    check_rc(lib.kvm_qlinear_dequantize(kind, q.data_ptr(), d.data_ptr(), m_ptr, q.shape[0], K, out.data_ptr(),
                                     torch.get_num_threads()))
    return out


def linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T with W held as panels (`lib`: another build than the CPU's own)."""
    lib = lib if lib is not None else load()
    K = in_features(q, d, m, kind)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != K or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError("x must be [M, K] float32 contiguous on the CPU")
    y = torch.empty((x.shape[0], q.shape[0] * PANEL), dtype=torch.float32)
    m_ptr = m.data_ptr() if kind == KINDS["Q4_1"] else None
    check_rc(lib.kvm_qlinear_linear(kind, x.data_ptr(), x.shape[0], q.data_ptr(), d.data_ptr(), m_ptr, q.shape[0], K,
                                 y.data_ptr(), torch.get_num_threads()))
    return y
