"""Every GGUF block type the kernel computes (models/gguf_blocks.py, kernels/csrc/quantized_linear.cpp).

Claimed exact, asserted with `torch.equal`: for random blocks of every type (random bytes with finite
float16 scales, so every scale, minimum and quant value occurs), the kernel expands each weight to the
float32 value gguf-py's `dequantize` gives, byte for byte, in the AVX-512 and the AVX2 build; a row's
output is the same bytes computed alone, among other rows, with any thread count and in either build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmemory.kernels import cpu, native, quantized_linear
from kvmemory.models import gguf_blocks

RUNS_HERE = native.choose("qlinear")[0] is not None
needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="the GGUF-block kernel runs on AVX-512 and AVX2 CPUs only")
QUANTIZED = tuple(t for t in gguf_blocks.TYPES if t in gguf_blocks.BLOCK_BYTES)
FLOATS = ("F32", "F16", "BF16")
# where the float16 scales sit in a block: (offset, count) of 2-byte fields
_SCALES = {"Q4_0": [(0, 1)], "Q4_1": [(0, 2)], "Q5_0": [(0, 1)], "Q5_1": [(0, 2)], "Q8_0": [(0, 1)],
           "Q2_K": [(80, 2)], "Q3_K": [(108, 1)], "Q4_K": [(0, 2)], "Q5_K": [(0, 2)], "Q6_K": [(208, 1)]}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, bytes per row] of random blocks whose float16 scales are finite (any other bit pattern)."""
    rng = np.random.default_rng(seed)
    nb = k // gguf_blocks.BLOCK_WEIGHTS[kind]
    raw = rng.integers(0, 256, size=(n * nb, gguf_blocks.BLOCK_BYTES[kind]), dtype=np.uint8)
    for off, count in _SCALES[kind]:
        halves = raw[:, off:off + 2 * count].copy().view(np.uint16)
        halves[(halves & 0x7C00) == 0x7C00] &= 0xBBFF  # inf / nan bit patterns -> finite ones
        raw[:, off:off + 2 * count] = halves.view(np.uint8)
    return raw.reshape(n, -1)


def random_floats(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if kind == "F16":
        return w.astype(np.float16)
    if kind == "BF16":  # raw bytes, as a GGUF reader gives them
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    return w


def reference(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    if kind in ("F32", "F16"):
        return torch.from_numpy(np.asarray(raw, dtype=np.float32).reshape(n, k).copy())
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32))


def _variants() -> list[str]:
    out = [native.choose("qlinear")[0]]
    if cpu.isa() == "AVX512":
        out.append("avx2")
    return out


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZED + FLOATS)
def test_every_type_expands_to_gguf_pys_weights_in_both_builds(kind):
    n, k = 48, 512
    raw = random_blocks(kind, n, k, seed=len(kind)) if kind in QUANTIZED else random_floats(kind, n, k)
    q, d, m, code = gguf_blocks.panels(kind, raw, n, k)
    ref = reference(kind, raw, n, k)
    for variant in _variants():
        lib = quantized_linear.load_variant(variant)
        assert lib is not None, variant
        got = quantized_linear.dequantize(q, d, m, code, lib=lib)
        assert got.view(torch.int32).equal(ref.view(torch.int32)), (kind, variant)  # bytes, -0.0 included


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZED + ("F16",))
def test_a_row_has_the_same_bytes_whatever_computes_it(kind):
    """Alone (the one-row path), among 1..40 rows (the tiled path), 1 or 2 threads, either build."""
    n, k = 80, 512  # 5 panels: on AVX-512 a tile pairs two panels, so the odd one takes its own path
    raw = random_blocks(kind, n, k, seed=3) if kind in QUANTIZED else random_floats(kind, n, k)
    q, d, m, code = gguf_blocks.panels(kind, raw, n, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
    full = quantized_linear.linear(x, q, d, m, code)
    assert torch.isfinite(full).all() or kind in QUANTIZED  # random scales may overflow; bytes still compared
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for variant in _variants():
                lib = quantized_linear.load_variant(variant)
                for rows in (slice(0, 1), slice(7, 8), slice(0, 13), slice(0, 40)):
                    got = quantized_linear.linear(x[rows].contiguous(), q, d, m, code, lib=lib)
                    assert got.view(torch.int32).equal(full[rows].view(torch.int32)), (kind, variant, threads, rows)
    finally:
        torch.set_num_threads(before)
    # the same linear map as gguf-py's weights, summed in another order (finite weights only)
    w = reference(kind, raw, n, k)
    ok = torch.isfinite(w).all(dim=1)
    if kind not in QUANTIZED:
        assert torch.allclose(full[:, ok], (x @ w.T)[:, ok], rtol=1e-4, atol=1e-3)


@needs_kernel
def test_real_quantized_weights_compute_the_linear_map():
    """Blocks gguf-py quantizes from smooth weights (not random bytes): the kernel's outputs are x @ W.T
    with gguf-py's weights, up to the order of the sum."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((32, 256)) * 0.05).astype(np.float32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # the types gguf-py can quantize
        raw = quants.quantize(w, GGMLQuantizationType[kind])
        q, d, m, code = gguf_blocks.panels(kind, raw, 32, 256)
        ref = reference(kind, raw, 32, 256)
        assert torch.allclose(quantized_linear.linear(x, q, d, m, code), x @ ref.T, rtol=1e-5, atol=1e-5), kind


def test_types_the_kernel_lacks_are_refused_by_name():
    raw = np.zeros((16, 66), dtype=np.uint8)
    for kind in ("IQ2_XXS", "IQ4_NL", "TQ1_0", "TQ2_0"):
        with pytest.raises(Exception, match=kind):
            gguf_blocks.panels(kind, raw, 16, 256)
