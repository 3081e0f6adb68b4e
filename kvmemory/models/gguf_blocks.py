"""A GGUF tensor's blocks, re-laid out for the GGUF-block linear kernel (kernels/quantized_linear.py).

Each block type becomes one of the kernel's formats: integer q (nibbles or bytes), and a float32 scale d
and minimum m per sub-block of 16 or 32 weights of a row, computed here with exactly the float32 operations
of gguf-py's `dequantize` (gguf/quants.py), so that the kernel's `q * d (+ m)` is gguf-py's value, byte
for byte (tests/test_gguf_blocks.py checks every type, both kernel builds). The K-quants (Q2_K ... Q6_K)
keep their scales as compact as the file does (the float16 D and DMIN of a super-block as float32, the
integer scale and min of each sub-block as int8) and the kernel takes gguf-py's exact products D * scale,
DMIN * min itself: Q4_K is then 4.75 bits a weight (the file's 4.5), not 6. F32, F16 and BF16 tensors
are kept as their float32 values (F16 / BF16 then take twice their file size).

Layouts per block type (bytes of one block; QK_K = 256 weights, K-quants' sub-blocks of 16 or 32):
  Q4_0 18: d f16, 16 bytes of nibbles (low = weight j, high = j + 16), w = d * (q - 8)
  Q4_1 20: d, m f16, nibbles as Q4_0, w = d * q + m
  Q5_0 22: d, qh u32 (bit j = 5th bit of weight j), nibbles, w = d * (q - 16)
  Q5_1 24: d, m, qh, nibbles, w = d * q + m
  Q8_0 34: d, 32 int8, w = d * q
  Q2_K 84: 16 scale bytes (low 4 bits scale, high 4 min), 64 bytes of 2-bit q, d, dmin f16
  Q3_K 110: 32 bytes high-bit mask, 64 bytes 2-bit q, 12 bytes of 6-bit scales, d
  Q4_K 144: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  Q5_K 176: d, dmin, 12 scale bytes, 32 bytes high bits, 128 bytes of nibbles
  Q6_K 210: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d
"""

from __future__ import annotations

import numpy as np
import torch

from kvmemory.errors import KVMemoryError
from kvmemory.kernels.quantized_linear import BYTE, BYTEMIN, F32, FORMATS, KINDS, NIB, NIBMIN, PANEL, super_bytes

QK_K = 256
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q2_K": QK_K, "Q3_K": QK_K,
                 "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
TYPES = tuple(FORMATS)  # every block type the kernel computes
_ROWS_PER_CHUNK = 2048  # rows unpacked at a time: bounds the temporaries of a large tensor


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (the last axis) as float16 -> float32, as gguf-py reads a scale."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 16] bytes -> [B, 32] values: low nibbles are weights 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[B, 4] bytes of a little-endian u32 -> [B, 32] bits (bit j of weight j)."""
    bits = np.ascontiguousarray(qh).view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (gguf-py's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _unpack(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[B, block bytes] -> q [B, weights] (what the kernel stores: nibble value, or int8), d and m
    [B, sub-blocks] float32 (m None without a minimum), each by gguf-py's float32 operations."""
    if kind in ("Q4_0", "Q4_1"):
        off = 2 if kind == "Q4_0" else 4
        d = _f16(blocks[:, 0:2])[:, None]
        m = _f16(blocks[:, 2:4])[:, None] if kind == "Q4_1" else None
        return _nibbles(blocks[:, off:]), d, m  # Q4_0's bias of 8 is the kernel's (kind)
    if kind in ("Q5_0", "Q5_1"):
        off = 2 if kind == "Q5_0" else 4
        d = _f16(blocks[:, 0:2])[:, None]
        q = _nibbles(blocks[:, off + 4:]) | (_high_bits(blocks[:, off:off + 4]) << 4)
        if kind == "Q5_0":
            return q.astype(np.int8) - np.int8(16), d, None
        return q.astype(np.int8), d, _f16(blocks[:, 2:4])[:, None]
    if kind == "Q8_0":
        return np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _f16(blocks[:, 0:2])[:, None], None
    raise KVMemoryError(f"GGUF block type {kind} is not one the kernel's sub-block scales take")


def _unpack_k(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None,
                                                      np.ndarray | None]:
    """A K-quant's [B, block bytes] -> q [B, 256] (what the kernel stores), D [B] float32, the int8 scale
    per sub-block [B, 256 / sub], and DMIN, the int8 min alike (None without a minimum): gguf-py's
    sub-block scale is D * scale, its minimum DMIN * min (the kernel computes both, as gguf-py does)."""
    B = blocks.shape[0]
    if kind == "Q2_K":
        scales, qs = blocks[:, :16], blocks[:, 16:80]
        q = (qs.reshape(B, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        return (q.reshape(B, QK_K), _f16(blocks[:, 80:82]), (scales & 0xF).astype(np.int8),
                _f16(blocks[:, 82:84]), (scales >> 4).astype(np.int8))
    if kind == "Q3_K":
        hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
        lsc = (scales[:, :8].reshape(B, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(B, 16)
        hsc = (scales[:, 8:].reshape(B, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(B, 16)
        sc = ((lsc & 0x0F) | ((hsc & 0x03) << 4)).astype(np.int8) - np.int8(32)
        ql = (qs.reshape(B, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(B, 16, 16) & 3
        qh = (hmask.reshape(B, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(B, 16, 16) & 1
        q = ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)  # -4 .. 3
        # stored + 4, the kernel's bias
        return (q + np.int8(4)).astype(np.uint8).reshape(B, QK_K), _f16(blocks[:, 108:110]), sc, None, None
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        qs = blocks[:, 16:144] if kind == "Q4_K" else blocks[:, 48:176]
        ql = ((qs.reshape(B, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(B, QK_K)
        if kind == "Q5_K":
            qh = ((blocks[:, 16:48].reshape(B, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1)
            ql = (ql | (qh.reshape(B, QK_K) << 4)).astype(np.int8)
        return ql, _f16(blocks[:, 0:2]), sc.astype(np.int8), _f16(blocks[:, 2:4]), mn.astype(np.int8)
    if kind == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
        lo = ((ql.reshape(B, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(B, 8, 32)
        hi = ((qh.reshape(B, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(B, 8, 32)
        return ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).reshape(B, QK_K), _f16(blocks[:, 208:210]), sc, None, None
    raise KVMemoryError(f"GGUF block type {kind} is not one the kernel computes with ({', '.join(TYPES)})")


def _by_panel(a: np.ndarray) -> torch.Tensor:  # [n, c] -> [n/16, c, 16]
    n = a.shape[0]
    return torch.from_numpy(np.ascontiguousarray(a.reshape(n // PANEL, PANEL, -1).transpose(0, 2, 1)))


def _float_weights(kind: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """An F32 / F16 / BF16 tensor's float32 values [n, k] (exact: every F16 and BF16 value is a float32)."""
    from gguf import GGMLQuantizationType, quants

    if raw.dtype == np.uint8:  # raw bytes (BF16 and, from some readers, the others)
        return quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32, copy=False)
    return np.asarray(raw, dtype=np.float32).reshape(n, k)


def panels(kind: str, raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A GGUF tensor ([n, bytes per row] uint8 blocks, one row per output feature; F32 / F16 / BF16 as
    their values) in the kernel's panel layout: (q, d, m, kind code); d is empty for F32, m for formats
    without a minimum. KVMemoryError for a type the kernel lacks or sizes that are not whole panels."""
    if kind not in FORMATS:
        raise KVMemoryError(f"GGUF block type {kind} is not one the kernel computes with ({', '.join(TYPES)})")
    fmt, sub, _, kscaled = FORMATS[kind]
    if n % PANEL or k % 32:
        raise KVMemoryError(f"a {n} x {k} weight does not fill whole panels of {PANEL} rows and blocks of 32")
    empty = torch.empty(0, dtype=torch.float32)
    if fmt == F32:
        return _by_panel(_float_weights(kind, raw, n, k)), empty, empty, KINDS[kind]
    if k % BLOCK_WEIGHTS[kind]:
        raise KVMemoryError(f"a {kind} row of {k} weights is not whole blocks of {BLOCK_WEIGHTS[kind]}")
    raw = np.asarray(raw).reshape(n, -1)
    nb = k // BLOCK_WEIGHTS[kind]
    if raw.dtype != np.uint8 or raw.shape[1] != nb * BLOCK_BYTES[kind]:
        raise KVMemoryError(f"a {kind} tensor of {n} x {k} weights must be {n} rows of {nb * BLOCK_BYTES[kind]} bytes")
    nibble = fmt in (NIB, NIBMIN)
    q = np.empty((n, k // 2 if nibble else k), dtype=np.uint8 if nibble else np.int8)
    if kscaled:  # per super-block and panel: D [16] f32, (DMIN [16] f32), scale [subs][16] i8, (min [subs][16] i8)
        minimum = fmt == NIBMIN or fmt == BYTEMIN
        subs = QK_K // sub
        scales = np.empty((n // PANEL, nb, super_bytes(KINDS[kind])), dtype=np.uint8)
    else:
        d = np.empty((n, k // sub), dtype=np.float32)
        m = np.empty((n, k // sub), dtype=np.float32) if fmt in (NIBMIN, BYTEMIN) else None
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        r1 = min(n, r0 + _ROWS_PER_CHUNK)
        blocks = raw[r0:r1].reshape(-1, BLOCK_BYTES[kind])
        if kscaled:
            qv, D, sc, DMIN, mn = _unpack_k(kind, blocks)
            parts = [_lanes(D, r1 - r0, nb, 1).view(np.uint8)]
            if minimum:
                parts.append(_lanes(DMIN, r1 - r0, nb, 1).view(np.uint8))
            parts.append(_lanes(sc, r1 - r0, nb, subs).view(np.uint8))
            if minimum:
                parts.append(_lanes(mn, r1 - r0, nb, subs).view(np.uint8))
            scales[r0 // PANEL:r1 // PANEL] = np.concatenate(parts, axis=-1)
        else:
            qv, dv, mv = _unpack(kind, blocks)
            d[r0:r1] = dv.reshape(r1 - r0, k // sub)
            if m is not None:
                m[r0:r1] = mv.reshape(r1 - r0, k // sub)
        qv = qv.reshape(r1 - r0, k)
        q[r0:r1] = (qv[:, 0::2] | (qv[:, 1::2] << 4)) if nibble else qv  # nibbles: weights 2t, 2t + 1 in a byte
    assert fmt in (NIB, NIBMIN, BYTE, BYTEMIN)
    if kscaled:
        return _by_panel(q), torch.from_numpy(scales), empty, KINDS[kind]
    return _by_panel(q), _by_panel(d), (_by_panel(m) if m is not None else empty), KINDS[kind]


def _lanes(a: np.ndarray, rows: int, nb: int, per_block: int) -> np.ndarray:
    """Per-block values [rows * nb * per_block] of whole panels of rows -> [rows / 16, nb, per_block * 16]:
    for each panel and super-block, value j of the 16 rows side by side (lane = the row in its panel)."""
    a = a.reshape(rows // PANEL, PANEL, nb, per_block).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(a).reshape(rows // PANEL, nb, per_block * PANEL)
