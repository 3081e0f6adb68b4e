"""The q8 linears (`linears="q8"`, kernels/csrc/q8_dot.h): integer dot products with 8-bit activations.

Claimed exact, asserted with `torch.equal` on the bytes: for random blocks of every quantized GGUF type,
the kernel's output equals a torch computation of q8_dot.h's formulas (activations quantized per block
of 32, integer sums per sub-block, then one fixed sequence of float32 operations), in the AVX-512 build
with and without VNNI and in the AVX2 build; a row has the same bytes computed alone or among others,
with any thread count. The reference shares no code with the kernel: it reads the integer quants and
scales from the float path's panels (models/gguf_blocks.py), not from the q8 layout. A model opened with
`linears="q8"` grafts exactly (graft = recompute byte for byte) for every block type and architecture,
batches exactly (every row of a shared step equal to its sequence alone), and is its own profile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_files import write_tiny_gguf
from test_batched_step import _check, _pool
from test_gguf_blocks import QUANTIZED, random_blocks
from tiny_models import ARCHS, assert_graft_equals_recompute

from kvmemory.engine.batched_step import why_not
from kvmemory.engine.engine import Engine
from kvmemory.errors import ProfileMismatch
from kvmemory.kernels import cpu, native, quantized_linear as ql
from kvmemory.models import gguf_blocks

needs_kernel = pytest.mark.skipif(native.choose("qlinear")[0] is None,
                                  reason="the GGUF-block kernel runs on AVX-512 and AVX2 CPUs only")


def _ints_and_scales(q, d, m, kind):
    """Integer quants [N, K] (int64, bias taken off), scale and minimum per sub-block [N, K/sub] float32
    (minimum None where the format has none), from the float path's panels."""
    fmt, sub, bias = ql.decode_kind(kind)
    P = q.shape[0]
    if fmt in (ql.NIB, ql.NIBMIN):
        ints = torch.stack((q & 0x0F, q >> 4), dim=2).reshape(P, -1, ql.PANEL).to(torch.int64) - bias
    else:
        ints = q.to(torch.int64)
    ints = ints.permute(0, 2, 1).reshape(P * ql.PANEL, -1)
    K = ints.shape[1]
    if not ql.kscales(kind):
        per_row = lambda t: t.permute(0, 2, 1).reshape(P * ql.PANEL, -1)  # noqa: E731
        return ints, per_row(d), per_row(m) if ql.has_min(kind) else None
    nsub, with_min = 256 // sub, ql.has_min(kind)
    raw = d.reshape(P, K // 256, -1)
    floats = raw[:, :, :ql.PANEL * 4 * (2 if with_min else 1)].contiguous().view(torch.float32)  # [P, S, 16 | 32]
    at = ql.PANEL * 4 * (2 if with_min else 1)
    scale = raw[:, :, at:at + nsub * ql.PANEL].contiguous().view(torch.int8).reshape(P, K // 256, nsub, ql.PANEL)
    dd = floats[:, :, None, :ql.PANEL] * scale.to(torch.float32)  # gguf-py's D * scale, exact
    dd = dd.reshape(P, K // sub, ql.PANEL).permute(0, 2, 1).reshape(P * ql.PANEL, -1)
    if not with_min:
        return ints, dd, None
    mins = raw[:, :, at + nsub * ql.PANEL:at + 2 * nsub * ql.PANEL].contiguous().view(torch.int8)
    mm = -(floats[:, :, None, ql.PANEL:] * mins.reshape(P, K // 256, nsub, ql.PANEL).to(torch.float32))
    return ints, dd, mm.reshape(P, K // sub, ql.PANEL).permute(0, 2, 1).reshape(P * ql.PANEL, -1)


def reference(x: torch.Tensor, q, d, m, kind) -> torch.Tensor:
    """q8_dot.h's sums, in torch: float32 elementwise operations (each rounded once) and int64 sums."""
    ints, dd, mm = _ints_and_scales(q, d, m, kind)
    sub = ql.decode_kind(kind)[1]
    M, K = x.shape
    blocks = x.reshape(M, K // 32, 32)
    dx = blocks.abs().amax(-1) / 127.0  # [M, K/32]
    idx = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * idx[..., None]).clamp(-127, 127).to(torch.int64).reshape(M, K)
    S = K // sub
    isum = (xq.reshape(M, 1, S, sub) * ints.reshape(1, -1, S, sub)).sum(-1)  # [M, N, S]
    xs = xq.reshape(M, S, sub).sum(-1)  # [M, S]
    acc = torch.zeros(M, ints.shape[0], dtype=torch.float32)
    for s in range(S):
        dxs = dx[:, (s * sub) // 32][:, None]
        acc = acc + (dd[:, s][None, :] * dxs) * isum[:, :, s].to(torch.float32)
        if mm is not None:
            acc = acc + (mm[:, s][None, :] * dxs) * xs[:, s].to(torch.float32)[:, None]
    return acc


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _libs():
    """(name, library, vnni) for every build and dot product this CPU runs."""
    out = []
    own = native.choose("qlinear")[0]
    lib = ql.load_variant(own)
    if own == "avx512" and ql.q8_vnni(lib=lib):
        out.append(("avx512-vnni", lib, True))
    out.append((own, lib, False))
    if cpu.isa() == "AVX512":
        out.append(("avx2", ql.load_variant("avx2"), False))
    return out


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZED)
def test_q8_sums_equal_a_torch_computation_in_every_build(kind):
    n, k = 48, 512
    raw = random_blocks(kind, n, k, seed=3 + len(kind))
    q, d, m, code = gguf_blocks.panels(kind, raw, n, k)
    q8, code8 = ql.to_q8(q, code)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1)) * 3
    x[2, 40:72] = 0.0  # a block of zeros: dx = 0
    ref = reference(x, q, d, m, code)
    assert torch.isfinite(ref).all()
    try:
        for name, lib, vnni in _libs():
            ql.q8_vnni(vnni, lib=lib)
            for rows in (1, 3, 7, 11):  # one row (a decode step), small tiles, more rows than a tile (AVX-512: 8)
                got = ql.linear(x[:rows].contiguous(), q8, d, m, code8, lib=lib)
                assert _bytes(got).equal(_bytes(ref[:rows])), (kind, name, rows)
    finally:
        ql.q8_vnni(True)


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZED)
def test_q8_sums_at_the_largest_quants_stay_exact(kind):
    """Every weight at its format's largest stored value and every activation at +-127: the integer sums at
    their bounds (q8_dot.h sums a sub-block's multiply-adds in 16-bit lanes before widening them, which
    holds only while those bounds stay below 2^15)."""
    n, k = 32, 512
    q, d, m, code = gguf_blocks.panels(kind, random_blocks(kind, n, k, seed=5), n, k)
    fmt = ql.decode_kind(code)[0]
    if fmt in (ql.NIB, ql.NIBMIN):
        q.fill_(0xFF)  # every nibble 15
    else:  # the byte formats' largest magnitude their range allows (the six layout's u = q + 32 = 63)
        lo, hi = int(q.min()), int(q.max())
        q.fill_(31 if lo >= -32 and hi < 32 else -128)
    q8, code8 = ql.to_q8(q, code)
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # signs alternating
    x[3] = torch.linspace(-1, 1, k).sign()
    ref = reference(x, q, d, m, code)
    try:
        for name, lib, vnni in _libs():
            ql.q8_vnni(vnni, lib=lib)
            for rows in (1, 4):
                got = ql.linear(x[:rows].contiguous(), q8, d, m, code8, lib=lib)
                assert _bytes(got).equal(_bytes(ref[:rows])), (kind, name, rows)
    finally:
        ql.q8_vnni(True)


@needs_kernel
@pytest.mark.parametrize("kind", ["Q6_K", "Q5_0"])
def test_6_bit_quants_keep_6_bits_and_give_the_bytes_of_the_byte_layout(kind):
    n, k = 32, 512
    q, d, m, code = gguf_blocks.panels(kind, random_blocks(kind, n, k, seed=8), n, k)
    six, six_code = ql.to_q8(q, code)
    full, full_code = ql.to_q8(q, code, six=False)
    assert six_code & ql.SIX and not full_code & ql.SIX
    assert six.numel() * 4 == full.numel() * 3  # 6 bits a weight, not 8
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(9))
    for name, lib, vnni in _libs():
        ql.q8_vnni(vnni, lib=lib)
        try:
            for rows in (1, 9):
                a = ql.linear(x[:rows].contiguous(), six, d, m, six_code, lib=lib)
                assert _bytes(a).equal(_bytes(ql.linear(x[:rows].contiguous(), full, d, m, full_code, lib=lib))), name
        finally:
            ql.q8_vnni(True)
    q8_0 = gguf_blocks.panels("Q8_0", random_blocks("Q8_0", n, k, seed=8), n, k)
    assert not ql.to_q8(q8_0[0], q8_0[3])[1] & ql.SIX  # full-range bytes stay bytes


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_q8_row_has_the_same_bytes_alone_among_rows_and_on_any_threads(kind):
    n, k = 64, 768
    raw = random_blocks(kind, n, k, seed=11)
    q, d, m, code = gguf_blocks.panels(kind, raw, n, k)
    q8, code8 = ql.to_q8(q, code)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        many = ql.linear(x, q8, d, m, code8)  # 70 rows: two row groups of the kernel's work items
        torch.set_num_threads(1)
        for r in (0, 9, 69):
            alone = ql.linear(x[r:r + 1].contiguous(), q8, d, m, code8)
            assert _bytes(alone).equal(_bytes(many[r:r + 1])), (kind, r)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_q8_is_close_to_the_float_sums_and_refuses_float_weights():
    raw = random_blocks("Q4_K", 32, 512, seed=5)
    q, d, m, code = gguf_blocks.panels("Q4_K", raw, 32, 512)
    q8, code8 = ql.to_q8(q, code)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    exact = x @ ql.dequantize(q, d, m, code).T
    got = ql.linear(x, q8, d, m, code8)
    assert not torch.equal(got, exact)  # another sum: what the profile's name says
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()  # 8-bit activations: close, not equal
    with pytest.raises(ValueError):
        ql.dequantize(q8, d, m, code8)  # q8 panels hold no float weights to expand
    fq, fd, fm, fcode = gguf_blocks.panels("F16", np.zeros((16, 64), np.float16), 16, 64)
    with pytest.raises(ValueError, match="no float-path quants"):
        ql.to_q8(fq, fcode)


@needs_kernel
def test_a_nan_activation_gives_nan_outputs_not_numbers():
    raw = random_blocks("Q8_0", 16, 64, seed=6)
    q, d, m, code = gguf_blocks.panels("Q8_0", raw, 16, 64)
    q8, code8 = ql.to_q8(q, code)
    x = torch.ones(2, 64)
    x[1, 5] = float("nan")
    y = ql.linear(x, q8, d, m, code8)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


TEXT = "Hello there, the world is a wide place and the sea is deep. " * 3


def _q8_engine(path, tmp_path) -> Engine:
    eng = Engine.open(str(path), tmp_path / "store", chunk=16, linears="q8")
    assert eng.profile.linear_impl == "gguf-blocks-q8"
    return eng


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZED)
def test_q8_graft_equals_recompute_for_every_block_type(kind, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", linear_type=kind, embedding_type=kind,
                           tied=kind != "Q6_K", seed=1)[0]
    eng = _q8_engine(path, tmp_path)
    assert_graft_equals_recompute(eng, eng.loaded.tokenizer(TEXT)["input_ids"], 48, 4)


@needs_kernel
@pytest.mark.parametrize("arch", ARCHS)
def test_q8_graft_equals_recompute_for_every_architecture(arch, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, linear_type="Q4_K", embedding_type="Q6_K", seed=2)[0]
    eng = _q8_engine(path, tmp_path)
    assert_graft_equals_recompute(eng, eng.loaded.tokenizer(TEXT)["input_ids"], 48, 4)


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_q8_rows_batch_exactly(kind, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", linear_type=kind, embedding_type=kind, seed=1)[0]
    eng = _q8_engine(path, tmp_path)
    assert why_not(eng.runner) is None
    _check(eng, _pool(eng, 16, eng.runner.vocab_size, seed=1)[:8], budget=64, late=False)


@needs_kernel
def test_q8_is_its_own_profile_and_says_how_to_open_the_other(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", linear_type="Q4_K", embedding_type="Q6_K", seed=2)[0]
    plain = Engine.open(str(path), tmp_path / "store", chunk=16)
    q8 = _q8_engine(path, tmp_path)
    assert plain.profile.linear_impl == "gguf-blocks" and plain.profile.profile_id != q8.profile.profile_id
    with pytest.raises(ProfileMismatch, match="--linears gguf"):
        q8.profile.require_same(plain.profile)
    ids = q8.loaded.tokenizer(TEXT)["input_ids"]
    a, b = plain.forward(ids, graft=False, max_new_tokens=0)[0], q8.forward(ids, graft=False, max_new_tokens=0)[0]
    assert a.logits_sha256 != b.logits_sha256  # another sum, not a relabelled one


@needs_kernel
def test_q8_scores_as_llama_cpp_and_its_profile_says_how(tmp_path):
    """Under q8 the attention scores over the bfloat16 cache come from the queries rounded to bfloat16
    (models/attention.py): every attention module says so, and the profile records whether VDPBF16PS
    computes them here (their bits differ from the widened path's); the float profile has neither."""
    from kvmemory.kernels import few_query_attention
    from kvmemory.models import attention

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", linear_type="Q4_K", embedding_type="Q6_K", seed=2)[0]
    plain = Engine.open(str(path), tmp_path / "store", chunk=16)
    q8 = _q8_engine(path, tmp_path)
    assert q8.profile.kv_dtype == "bfloat16" and q8.profile.attn_implementation == attention.FEWQ
    marked = [m for m in q8.model.modules() if getattr(m, attention.BF16_SCORES_ATTR, False)]
    assert len(marked) == q8.model.config.num_hidden_layers
    assert not any(getattr(m, attention.BF16_SCORES_ATTR, False) for m in plain.model.modules())
    assert q8.profile.kernels["fewq"]["bf16_dot"] is few_query_attention.bf16_dot()
    assert "bf16_dot" not in plain.profile.kernels["fewq"]


@needs_kernel
def test_the_embedded_model_runs_q8_and_batches_exactly(tmp_path):
    from kvmemory.models.loading import load_model
    from kvmemory.store.local import LocalStore

    loaded = load_model(linears="q8")
    eng = Engine(loaded, LocalStore(tmp_path / "store"))
    assert eng.profile.linear_impl == "gguf-blocks-q8"
    assert why_not(eng.runner) is None, why_not(eng.runner)
    _check(eng, _pool(eng, 64, eng.runner.vocab_size, seed=3)[:8], budget=256, late=False)
