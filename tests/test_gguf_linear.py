"""Linears computed from GGUF blocks (kvmemory/models/gguf_linear.py, kernels/csrc/quantized_linear.cpp).

What is claimed exact is asserted with `torch.equal`: the weights the kernel expands are gguf-py's
(transformers') float32 weights; a row's output is the same bytes whatever rows come with it, whatever
the thread count, in the AVX-512 and the AVX2 build alike; the embedded model's grafted logits equal
its recompute's. The products' order is not sgemm's, so against `x @ W.T` it is only close.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import assert_graft_equals_recompute

from kvmemory.errors import InvalidInput, KVMemoryError
from kvmemory.kernels import build, cpu, native, quantized_linear
from kvmemory.models import gguf_linear
from kvmemory.models.loading import linear_implementation

RUNS_HERE = native.choose("qlinear")[0] is not None
needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="the GGUF-block kernel runs on AVX-512 and AVX2 CPUs only")


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random weights quantized by gguf-py: (raw blocks [n, bytes], gguf-py's float32 expansion [n, k])."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quants.quantize(w, qtype)
    return raw, quants.dequantize(raw, qtype).reshape(n, k)


def _layer(kind: str, n: int, k: int, seed: int = 0) -> gguf_linear.GGUFLinear:
    raw, ref = _blocks(kind, n, k, seed)
    plain = torch.nn.Linear(k, n, bias=False)
    plain.weight.data = torch.from_numpy(ref.copy())
    return gguf_linear.GGUFLinear(plain, kind, *gguf_linear.panels(kind, raw, n, k))


@needs_kernel
def test_kernel_builds():
    assert quantized_linear.load() is not None, quantized_linear.why_unavailable()


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_expanded_weights_are_gguf_pys_float32_weights(kind):
    layer = _layer(kind, 48, 96)
    assert torch.equal(layer.dequantized(), layer.weight.detach())


@needs_kernel
def test_q4_1_weights_expand_exactly_over_every_float16_scale_and_minimum():
    """The kernel expands a Q4_1 weight with one FMA, fma(q, d, m), where gguf-py rounds d * q and then
    the sum: equal because d * q is exact for a float16 d. Checked on blocks whose d and m are drawn
    from every finite float16 (subnormals, both signs, the largest) against gguf-py's own expansion."""
    from gguf import GGMLQuantizationType, quants

    n, k = 64, 1024
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
    halves = rng.integers(0, 1 << 16, size=(n, k // 32, 2), dtype=np.uint16)
    halves[(halves & 0x7C00) == 0x7C00] &= 0xBBFF  # inf / nan bit patterns -> finite ones
    raw[..., 0:4] = halves.view(np.uint8).reshape(n, k // 32, 4)
    raw = raw.reshape(n, -1)
    ref = quants.dequantize(raw, GGMLQuantizationType.Q4_1).reshape(n, k)
    plain = torch.nn.Linear(k, n, bias=False)
    plain.weight.data = torch.from_numpy(ref.copy())
    layer = gguf_linear.GGUFLinear(plain, "Q4_1", *gguf_linear.panels("Q4_1", raw, n, k))
    assert torch.equal(layer.dequantized(), plain.weight.detach())
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(layer(x), layer(x.repeat(5, 1))[:1])  # the one-row path expands them alike


@needs_kernel
def test_a_scale_that_is_not_a_float16_is_refused():
    layer = _layer("Q4_1", 32, 64)
    with pytest.raises(ValueError, match="17 significant bits"):
        quantized_linear.linear(torch.randn(3, 64), layer.q, layer.d + 1e-7, layer.m, layer.kind)


@needs_kernel
@pytest.mark.parametrize("kind,n,k", [("Q4_1", 48, 96), ("Q8_0", 64, 64), ("Q4_1", 32, 1536), ("Q8_0", 208, 64)])
def test_a_row_has_the_same_bytes_among_any_rows(kind, n, k):
    """48 outputs = 3 panels: on AVX-512 a tile pairs two panels, so the odd one takes its own path."""
    layer = _layer(kind, n, k, seed=n)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = layer(x)
        for m in (1, 2, 7, 13, 16, 25, 64):
            assert torch.equal(layer(x[:m]), full[:m]), m
        assert torch.equal(layer(x[150:151]), full[150:151])
        assert torch.equal(layer(x.view(3, 100, k)), full.view(3, 100, n))  # any leading shape
        assert torch.equal(layer(x.t().contiguous().t()), full)  # a non-contiguous input
    # the same linear map as the expanded weight, summed in another order
    assert torch.allclose(full, x @ layer.weight.detach().T, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_same_bytes_whatever_the_thread_count():
    layer = _layer("Q4_1", 176, 576, seed=3)  # 11 panels: the one-row path's groups of 8, 2 and 1
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        outs, rows = [], []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                outs.append(layer(x))
                rows.append(layer(x[5:6]))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert all(torch.equal(r, outs[0][5:6]) for r in rows)


@needs_kernel
@pytest.mark.skipif(cpu.isa() != "AVX512", reason="runs both builds: needs a CPU with AVX-512")
def test_the_avx2_build_gives_the_avx512_builds_bytes():
    """The sum's order is fixed (k ascending, one FMA per lane), not the vector width: both builds
    give the same bits, so a store is not tied to one of the two kinds of CPU by its linears."""
    other = quantized_linear.load_variant("avx2")
    assert other is not None, native.load("qlinear", "avx2")[1]
    assert native.choose("qlinear")[0] == "avx512"
    for kind in ("Q4_1", "Q8_0"):
        layer = _layer(kind, 48, 192, seed=5)
        x = torch.randn(40, 192, generator=torch.Generator().manual_seed(4))
        with torch.inference_mode():
            mine = layer(x)
        assert torch.equal(quantized_linear.linear(x, layer.q, layer.d, layer.m, layer.kind, lib=other), mine)
        for row in (0, 39):  # one row (a decode step) takes each build's own one-row path
            one = quantized_linear.linear(x[row:row + 1], layer.q, layer.d, layer.m, layer.kind, lib=other)
            assert torch.equal(one, mine[row:row + 1])
        assert torch.equal(quantized_linear.dequantize(layer.q, layer.d, layer.m, layer.kind, lib=other),
                           layer.dequantized())


@pytest.mark.parametrize("variant", [b.variant for b in build.builds("qlinear")])
def test_the_other_build_compiles(variant, tmp_path):
    """Every build compiles from the checkout's sources (the one this CPU does not run included), with
    -ffp-contract=off and its entry points exported."""
    import subprocess

    b = build.find("qlinear", variant)
    assert "-ffp-contract=off" in b.flags
    build.compile_library(b, tmp_path)
    out = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / b.filename)], capture_output=True, text=True,
                         check=True).stdout
    assert {"kvm_qlinear_linear", "kvm_qlinear_dequantize"} <= {line.split()[-1] for line in out.split("\n") if line}


@needs_kernel
def test_bad_panels_are_refused_before_the_kernel_runs():
    layer = _layer("Q4_1", 32, 64)
    with pytest.raises(ValueError, match="x must be"):
        quantized_linear.linear(torch.randn(3, 65), layer.q, layer.d, layer.m, layer.kind)
    with pytest.raises(ValueError, match="q must be torch.uint8"):
        quantized_linear.linear(torch.randn(3, 64), layer.q.view(torch.int8), layer.d, layer.m, layer.kind)
    with pytest.raises(ValueError, match="d must be"):
        quantized_linear.dequantize(layer.q, layer.d[:1], layer.m, layer.kind)
    with pytest.raises(ValueError, match="m must be"):
        quantized_linear.dequantize(layer.q, layer.d, layer.m[:, :1], layer.kind)


def test_q_and_k_rows_are_unpermuted_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(192 * 3).reshape(192, 3)
    ref = LlamaTensorProcessor.__new__(LlamaTensorProcessor)._reverse_permute_weights(rows, 9, 3)
    assert np.array_equal(gguf_linear._unpermute_rows(rows, 3), ref)


def test_panels_refuse_what_the_kernel_cannot_compute():
    raw, _ = _blocks("Q4_1", 16, 64)
    with pytest.raises(KVMemoryError, match="panels"):
        gguf_linear.panels("Q4_1", raw[:8], 8, 64)
    with pytest.raises(KVMemoryError, match="IQ2_XXS"):
        gguf_linear.panels("IQ2_XXS", raw, 16, 64)
    with pytest.raises(KVMemoryError, match="whole blocks of 256"):
        gguf_linear.panels("Q4_K", raw, 16, 64)


@needs_kernel
def test_the_embedded_model_computes_from_its_blocks_and_grafts_exactly(tmp_path):
    from kvmemory.engine.engine import Engine
    from kvmemory.models.loading import DEFAULT_MODEL

    eng = Engine.open(DEFAULT_MODEL, tmp_path / "s")
    assert eng.profile.linear_impl == gguf_linear.NAME == linear_implementation(eng.model)
    layers = [m for m in eng.model.modules() if isinstance(m, gguf_linear.GGUFLinear)]
    assert len(layers) == 30 * 7 + 1
    assert eng.model.lm_head.weight is eng.model.get_input_embeddings().weight  # still tied
    ids = torch.randint(0, 49152, (128 + 9,), generator=torch.Generator().manual_seed(7)).tolist()
    assert_graft_equals_recompute(eng, ids, stored=128, new_tokens=3)


@needs_kernel
def test_a_damaged_panel_cache_is_made_again(tmp_path, caplog):
    """The panels are cached next to the converted model; bytes that do not expand to the model's
    weights are never used: the file is read from the GGUF again and rewritten."""
    from safetensors.torch import load_file, save_file

    from kvmemory.models.loading import embedded_gguf_path, load_model

    loaded = load_model(linears="plain")
    cache = tmp_path / "panels.safetensors"
    assert gguf_linear.gguf_linears(loaded.model, embedded_gguf_path(), cache) == 211
    stored = load_file(str(cache))
    stored["model.layers.3.mlp.up_proj.d"][0, 0, 0] *= 2
    save_file(stored, str(cache))
    fresh = load_model(linears="plain")
    assert gguf_linear.gguf_linears(fresh.model, embedded_gguf_path(), cache) == 211
    assert "do not expand to its weights" in caplog.text
    assert not torch.equal(load_file(str(cache))["model.layers.3.mlp.up_proj.d"], stored["model.layers.3.mlp.up_proj.d"])


def test_linears_choice_is_checked(tmp_path):
    from kvmemory.models.loading import load_model

    with pytest.raises(InvalidInput, match="linears must be one of"):
        load_model(linears="fast")
    with pytest.raises(InvalidInput, match="not read from one"):
        load_model("/nonexistent-model-folder", linears="gguf")
