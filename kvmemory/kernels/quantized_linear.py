"""The GGUF-block linear kernel (csrc/quantized_linear.cpp): y = x @ W.T with W kept as a GGUF file's
own quantized blocks, re-laid out in panels of 16 output rows (models/gguf_blocks.py does that per block
type), expanded to float32 in cache while it multiplies (models/gguf_linear.py makes model layers of it).

Formats (the contract with the C code; `kind` = format | 8 if sub-blocks of 16 | bias << 4 | 256 with
K-quant scales):
- NIB: q [N/16, K/2, 16] uint8 nibble pairs (weights 2t and 2t + 1 of a row in one byte, low nibble
  first), w = (q - bias) * d. NIBMIN: the same q, w = q * d + m.
- BYTE: q [N/16, K, 16] int8, w = q * d. BYTEMIN: w = q * d + m.
- F32: q [N/16, K, 16] float32, the weights themselves (F32, F16 and BF16 tensors, expanded exactly).
d and m are [N/16, K/sub, 16] float32: a scale (and minimum) per sub-block of `sub` (16 or 32) weights
of a row. With K-quant scales (Q2_K ... Q6_K, as compact as the file's own) d is uint8
[N/16, K/256, super-block bytes] and m is empty: per super-block of 256 weights and panel, D [16]
float32, DMIN [16] float32 where the format has a minimum, then an int8 scale [K/sub per 256][16] and
an int8 min alike; the kernel takes d = D * scale and m = -(DMIN * min), gguf-py's own products.
With the q8 flag (512, `to_q8`) the same d and m go with q re-laid for integer dot products against
activations quantized to 8 bits per block of 32, as llama.cpp computes (csrc/q8_dot.h has the layout and
the sums): not gguf-py's float32 weights summed in float32, but a sum as fixed, row by row, as that one.
Every weight is expanded to exactly gguf-py's `dequantize` value: d * q is rounded once as gguf-py
rounds it, and where a minimum follows, d * q is exact (d has at most 17 significant bits, checked
here) so the kernel's one FMA equals gguf-py's product-then-sum. Each output is one fixed sum (k
ascending, one FMA each), so a row's bytes depend on nothing else: not the rows beside it, the thread
count, nor AVX-512 vs AVX2.

A plain C library built into the package at install time (build.py: AVX-512 and AVX2 builds), picked
and loaded by native.py; where none runs, `load()` is None and says why once.
"""

from __future__ import annotations

import ctypes

import torch

from kvmemory.kernels import native

KERNEL = "qlinear"
PANEL = 16  # output rows per panel (the kernel's kPanel)
BLOCK = 32  # K is a multiple of this
NIB, NIBMIN, BYTE, BYTEMIN, F32 = range(5)  # the kernel's formats
_FORMAT_NAMES = ("nib", "nibmin", "byte", "bytemin", "f32")


KSCALES = 256  # the kind's flag for K-quant scales
Q8 = 512  # the kind's flag for q re-laid for 8-bit activations (csrc/q8_dot.h)
SIX = 1024  # with Q8 and BYTE: quants in [-32, 32) kept in 6 bits (csrc/q8_dot.h's "six" layout)
SUPER = 256  # weights per K-quant super-block


def kind_code(fmt: int, sub: int = 32, bias: int = 0, kscales: bool = False) -> int:
    """The kernel's `kind` for a format, sub-block size (16 or 32), nibble bias (NIB only) and scale layout."""
    return fmt | (8 if sub == 16 else 0) | bias << 4 | (KSCALES if kscales else 0)


# GGUF block type -> (format, sub-block, bias, K-quant scales): how gguf_blocks.py lays each out for the kernel.
FORMATS = {
    "Q4_0": (NIB, 32, 8, False), "Q4_1": (NIBMIN, 32, 0, False), "Q5_0": (BYTE, 32, 0, False),
    "Q5_1": (BYTEMIN, 32, 0, False), "Q8_0": (BYTE, 32, 0, False), "Q2_K": (NIBMIN, 16, 0, True),
    "Q3_K": (NIB, 16, 4, True), "Q4_K": (NIBMIN, 32, 0, True), "Q5_K": (BYTEMIN, 32, 0, True),
    "Q6_K": (BYTE, 16, 0, True), "F32": (F32, 32, 0, False), "F16": (F32, 32, 0, False),
    "BF16": (F32, 32, 0, False),
}
KINDS = {name: kind_code(*f) for name, f in FORMATS.items()}  # GGUF block type -> the kernel's `kind`


def decode_kind(kind: int) -> tuple[int, int, int]:
    """(format, sub-block, bias) of a kind code; ValueError for one the kernel does not take."""
    fmt, sub, bias = kind & 7, 16 if kind & 8 else 32, (kind >> 4) & 15
    if kind < 0 or kind >> 11 or fmt > F32 or (bias and fmt != NIB) or (kind & (KSCALES | Q8) and fmt == F32) \
            or (kind & SIX and (fmt != BYTE or not kind & Q8)):
        raise ValueError(f"kind {kind} is not one the GGUF-block kernel takes")
    return fmt, sub, bias


def kscales(kind: int) -> bool:
    """Whether the kind keeps K-quant scales (d: bytes per super-block; no m tensor)."""
    return bool(decode_kind(kind) and kind & KSCALES)


def is_q8(kind: int) -> bool:
    """Whether the kind computes with 8-bit activations (its q laid out by `to_q8`)."""
    return bool(decode_kind(kind) and kind & Q8)


def has_min(kind: int) -> bool:
    """Whether a weight of this kind has a minimum (w = q * d + m)."""
    return decode_kind(kind)[0] in (NIBMIN, BYTEMIN)


def has_m(kind: int) -> bool:
    """Whether the kind takes an m tensor of its own (a minimum, without K-quant scales)."""
    return has_min(kind) and not kscales(kind)


def super_bytes(kind: int) -> int:
    """Bytes of one super-block's K-quant scales per panel (the C code's Kind::super_bytes)."""
    fmt, sub, _ = decode_kind(kind)
    return (2 if has_min(kind) else 1) * (PANEL * 4 + SUPER // sub * PANEL)


def describe(kind: int) -> str:
    fmt, sub, bias = decode_kind(kind)
    return (f"{_FORMAT_NAMES[fmt]}/{sub}" + (f"-{bias}" if bias else "") + ("+k" if kind & KSCALES else "")
            + ("+q8" if kind & Q8 else "") + ("+six" if kind & SIX else ""))


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvm_qlinear_dequantize.argtypes = [c_int, vp, vp, vp, i64, i64, vp, c_int]
    lib.kvm_qlinear_dequantize.restype = c_int
    lib.kvm_qlinear_linear.argtypes = [c_int, vp, i64, vp, vp, vp, i64, i64, vp, c_int]
    lib.kvm_qlinear_linear.restype = c_int
    lib.kvm_qlinear_q8_vnni.argtypes = [c_int]
    lib.kvm_qlinear_q8_vnni.restype = c_int


KERNEL_LIB = native.Kernel(KERNEL, _declare)
load, load_variant = KERNEL_LIB.load, KERNEL_LIB.load_variant  # the library (None: see why_unavailable)
why_unavailable, build_info = KERNEL_LIB.why_unavailable, KERNEL_LIB.build_info

_Q_DTYPES = {NIB: torch.uint8, NIBMIN: torch.uint8, BYTE: torch.int8, BYTEMIN: torch.int8, F32: torch.float32}


def _on_cpu(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.device.type == "cpu"


def in_features(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int) -> int:
    """K, after checking the panels against the kernel's layout (csrc/quantized_linear.cpp); raises
    ValueError saying what is wrong."""
    fmt, sub, _ = decode_kind(kind)
    if is_q8(kind):
        per = "K/8" if fmt in (NIB, NIBMIN) else "3K/16" if kind & SIX else "K/4"
        if q.dim() != 4 or q.shape[2:] != (PANEL, 4) or q.dtype != torch.uint8 or not _on_cpu(q) \
                or (kind & SIX and q.shape[1] % 3):
            raise ValueError(f"q8 panels must be [N/16, {per}, 16, 4] uint8 contiguous on the CPU")
        K = q.shape[1] * 8 if fmt in (NIB, NIBMIN) else q.shape[1] // 3 * 16 if kind & SIX else q.shape[1] * 4
        if K % BLOCK:
            raise ValueError("K must be a multiple of 32")
        return _scales_checked(q, d, m, kind, K, sub)
    if q.dim() != 3 or q.shape[2] != PANEL or not _on_cpu(q):
        raise ValueError("q must be [N/16, K/2 or K, 16] contiguous on the CPU")
    if q.dtype != _Q_DTYPES[fmt]:
        raise ValueError(f"q must be {_Q_DTYPES[fmt]} for a {describe(kind)} kind, not {q.dtype}")
    K = q.shape[1] * 2 if fmt in (NIB, NIBMIN) else q.shape[1]
    if K % BLOCK:
        raise ValueError("K must be a multiple of 32")
    if fmt == F32:
        return K
    return _scales_checked(q, d, m, kind, K, sub)


def _scales_checked(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int, K: int, sub: int) -> int:
    fmt = decode_kind(kind)[0]
    if kscales(kind):
        sb = super_bytes(kind)
        if K % SUPER or d.dtype != torch.uint8 or not _on_cpu(d) or tuple(d.shape) != (q.shape[0], K // SUPER, sb):
            raise ValueError(f"d must be [N/16, K/256, {sb}] uint8 contiguous (K-quant scales)")
        # D (and DMIN) must be float16 values (<= 11 significant bits): then D * scale is gguf-py's exact
        # product, and with a minimum d * q stays exact for the kernel's one FMA
        floats = d[:, :, :PANEL * 4 * (2 if has_min(kind) else 1)].contiguous().view(torch.int32)
        if bool((floats & 0x1FFF).any()):
            raise ValueError("D and DMIN must be float16 values, as GGUF K-quant blocks store them")
        return K
    if d.dtype != torch.float32 or not _on_cpu(d) or tuple(d.shape) != (q.shape[0], K // sub, PANEL):
        raise ValueError(f"d must be [N/16, K/{sub}, 16] float32 contiguous")
    if fmt in (NIBMIN, BYTEMIN):
        if m.shape != d.shape or m.dtype != torch.float32 or not _on_cpu(m):
            raise ValueError("m must be shaped and typed as d")
        # csrc/quantized_linear.cpp: the one FMA rounds as gguf-py's product-then-sum only where d * q is exact
        if bool((d.view(torch.int32) & 0x7F).any()):
            raise ValueError("d must hold values of at most 17 significant bits (a float16 scale times a 6-bit "
                             "one, as GGUF blocks store them): the kernel expands d * q + m exactly only for those")
    return K


def check_rc(rc: int) -> None:
    if rc == -1:
        raise MemoryError("the GGUF-block linear kernel could not allocate its scratch memory")
    if rc != 0:
        raise ValueError(f"the GGUF-block linear kernel refused its arguments ({rc})")


def pointers(d: torch.Tensor, m: torch.Tensor, kind: int) -> tuple[int | None, int | None]:
    """The addresses of d and m the kernel takes for a kind (None where it takes none)."""
    fmt = decode_kind(kind)[0]
    return (None if fmt == F32 else d.data_ptr()), (m.data_ptr() if has_m(kind) else None)


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The float32 weight [N, K] the panels hold, expanded by the kernel's own code (`lib`: another build)."""
    lib = lib if lib is not None else load()
    K = in_features(q, d, m, kind)
    out = torch.empty((q.shape[0] * PANEL, K), dtype=torch.float32)
    check_rc(lib.kvm_qlinear_dequantize(kind, q.data_ptr(), *pointers(d, m, kind), q.shape[0], K, out.data_ptr(),
                                        torch.get_num_threads()))
    return out


def linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T with W held as panels (`lib`: another build than the CPU's own)."""
    lib = lib if lib is not None else load()
    K = in_features(q, d, m, kind)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != K or not _on_cpu(x):
        raise ValueError("x must be [M, K] float32 contiguous on the CPU")
    y = torch.empty((x.shape[0], q.shape[0] * PANEL), dtype=torch.float32)
    dp, mp = pointers(d, m, kind)
    check_rc(lib.kvm_qlinear_linear(kind, x.data_ptr(), x.shape[0], q.data_ptr(), dp, mp, q.shape[0], K,
                                    y.data_ptr(), torch.get_num_threads()))
    return y


def to_q8(q: torch.Tensor, kind: int, six: bool = True) -> tuple[torch.Tensor, int]:
    """The panels' q re-laid for the q8 kind (csrc/q8_dot.h), and that kind; d and m stay as they are.
    A new tensor: the float path's q (an embedding may share it) is left untouched. A BYTE format whose
    quants all lie in [-32, 32) (Q6_K, Q5_0) keeps 6 bits a weight (the "six" layout) unless `six` is
    False: the same integers, so the same sums."""
    fmt = decode_kind(kind)[0]
    if fmt == F32 or is_q8(kind):
        raise ValueError(f"a {describe(kind)} kind has no float-path quants to re-lay for q8")
    P = q.shape[0]
    if fmt in (NIB, NIBMIN):  # [P, K/2, 16] nibble pairs -> [P, K/8, 16, 4]: k 8g+b low, 8g+4+b high
        u = torch.stack((q & 0x0F, q >> 4), dim=2).reshape(P, -1, 2, 4, PANEL)  # [P, K/8, half, b, 16]
        out = (u[:, :, 0] | (u[:, :, 1] << 4)).permute(0, 1, 3, 2)
    elif six and fmt == BYTE and bool(((q >= -32) & (q < 32)).all()):  # six: u = q + 32, low nibbles, high 2 bits
        u = (q.to(torch.int16) + 32).to(torch.uint8)  # [P, K, 16]
        lo = (u & 0x0F).reshape(P, -1, 2, 4, PANEL)  # [P, K/8, half, b, 16]
        hi = (u >> 4).reshape(P, -1, 4, 4, PANEL)  # [P, K/16, c, b, 16]
        nib = (lo[:, :, 0] | (lo[:, :, 1] << 4)).permute(0, 1, 3, 2)
        high = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).permute(0, 1, 3, 2)
        return torch.cat((nib, high), dim=1).contiguous(), kind | Q8 | SIX
    else:  # [P, K, 16] int8 -> [P, K/4, 16, 4] uint8 holding q + 128
        u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(P, -1, 4, PANEL)
        out = u.permute(0, 1, 3, 2)
    return out.contiguous(), kind | Q8


def q8_vnni(want: bool | None = None, lib: ctypes.CDLL | None = None) -> bool:
    """Whether q8 kinds use AVX-512 VNNI here; `want` False turns it off (tests: both paths give the same
    bits), True back on where the CPU has it."""
    lib = lib if lib is not None else load()
    return bool(lib.kvm_qlinear_q8_vnni(-1 if want is None else int(want)))
