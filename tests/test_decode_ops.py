"""The decode-step kernel (kernels/decode_ops.py, csrc/decode_ops.cpp) gives the bits of the torch ops it
replaces: transformers' `LlamaRMSNorm` after the residual add, and `apply_rotary_pos_emb` with the K/V
write a `ReservedLayer` makes (float32 and bfloat16 caches). Both builds (AVX-512, AVX2) are compared
on this CPU, with torch summing as it does here and, in a subprocess, as it does under
ATEN_CPU_CAPABILITY=avx2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kvmemory.kernels import decode_ops

BUILDS = {v: decode_ops.load_variant(v) for v in ("avx512", "avx2")}
RUNNABLE = [v for v, lib in BUILDS.items() if lib is not None]
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="no build of the decode-step kernel runs on this CPU")
SIZES = [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129, 257, 576, 960, 1000, 2048, 2049, 4096, 5120,
         8192, 16384]


def _norm(n: int, eps: float, g: torch.Generator) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(n, eps=eps)
    norm.weight.data = torch.randn(n, generator=g)
    return norm


@pytest.mark.parametrize("variant", RUNNABLE)
def test_the_norm_gives_llama_rms_norms_bits(variant):
    lib = BUILDS[variant]
    g = torch.Generator().manual_seed(0)
    probe = _norm(576, 1e-5, g)
    width = decode_ops.sum_lanes(probe.forward, probe.weight.detach(), probe.variance_epsilon, lib)
    assert width in decode_ops.WIDTHS
    for n in SIZES:
        for t in range(8):
            norm = _norm(n, (1e-5, 1e-6)[t % 2], g)
            x = torch.randn(1, 1, n, generator=g) * 10.0 ** (t % 4 - 1)
            delta = torch.randn(1, 1, n, generator=g) if t % 3 else None
            with torch.inference_mode():
                h_ref = x + delta if delta is not None else x
                ref = norm(h_ref)
                h = x.clone()
                out = decode_ops.add_rms_norm(h, norm.weight.detach(), norm.variance_epsilon, delta, width, lib)
            assert torch.equal(h, h_ref) and torch.equal(out, ref), (n, t)


def test_a_wrong_sum_width_gives_other_bits():
    """The probe can tell the widths apart: the one it does not pick differs from torch on a real row."""
    g = torch.Generator().manual_seed(1)
    norm = _norm(576, 1e-5, g)
    width = decode_ops.sum_lanes(norm.forward, norm.weight.detach(), norm.variance_epsilon)
    other = next(w for w in decode_ops.WIDTHS if w != width)
    rows = [torch.randn(1, 1, 576, generator=g) for _ in range(16)]
    with torch.inference_mode():
        assert any(not torch.equal(decode_ops.add_rms_norm(r.clone(), norm.weight.detach(), 1e-5, width=other),
                                   norm(r)) for r in rows)


def test_torchs_avx2_sums_are_found_and_matched():
    """Under ATEN_CPU_CAPABILITY=avx2 (torch's AVX2 kernels), the probe finds its width and the norm
    equals torch's on rows of several sizes."""
    code = (
        "import json, torch\n"
        "from transformers.models.llama.modeling_llama import LlamaRMSNorm\n"
        "from kvmemory.kernels import decode_ops\n"
        "g = torch.Generator().manual_seed(5); out = []\n"
        "for n in (64, 576, 2049):\n"
        "    norm = LlamaRMSNorm(n); norm.weight.data = torch.randn(n, generator=g)\n"
        "    w = decode_ops.sum_lanes(norm.forward, norm.weight.detach(), norm.variance_epsilon)\n"
        "    rows = [torch.randn(1, 1, n, generator=g) * 30 for _ in range(20)]\n"
        "    with torch.inference_mode():\n"
        "        ok = all(torch.equal(decode_ops.add_rms_norm(r.clone(), norm.weight.detach(), 1e-6, width=w), norm(r))"
        " for r in rows)\n"
        "    out.append([torch.backends.cpu.get_cpu_capability(), w, ok])\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for cap, width, ok in json.loads(res.stdout.strip().splitlines()[-1]):
        assert cap == "AVX2" and width in decode_ops.WIDTHS and ok


@pytest.mark.parametrize("variant", RUNNABLE)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rope_and_the_cache_write_give_transformers_bits(variant, kv_dtype):
    lib = BUILDS[variant]
    g = torch.Generator().manual_seed(2)
    for T, hq, hkv, D in ((1, 9, 3, 64), (16, 9, 3, 64), (5, 4, 2, 16), (3, 32, 8, 128), (2, 2, 1, 2)):
        qkv = torch.randn(1, T, (hq + 2 * hkv) * D, generator=g) * 5
        cos, sin = torch.randn(1, T, D, generator=g), torch.randn(1, T, D, generator=g)
        heads = qkv.view(1, T, -1, D).transpose(1, 2)  # as transformers views its projections
        q_ref, k_ref = apply_rotary_pos_emb(heads[:, :hq], heads[:, hq:hq + hkv], cos, sin)
        v_ref = heads[:, hq + hkv:]
        k_buf = torch.zeros(1, hkv, T + 7, D, dtype=kv_dtype)  # a cache's room: write at positions 5..5+T-1
        v_buf = torch.zeros(1, hkv, T + 7, D, dtype=kv_dtype)
        k_want, v_want = k_buf.clone(), v_buf.clone()
        k_want[:, :, 5:5 + T].copy_(k_ref)  # what ReservedLayer.update writes (rounded where bfloat16)
        v_want[:, :, 5:5 + T].copy_(v_ref)
        q = decode_ops.rope_write(qkv, cos, sin, hq, hkv, k_buf[0, :, 5:5 + T], v_buf[0, :, 5:5 + T], lib)
        strides = lambda t: [st for st, n in zip(t.stride(), t.shape) if n > 1]  # noqa: E731 (size-1 dims: any)
        assert torch.equal(q, q_ref) and strides(q) == strides(q_ref), (T, hq, hkv, D)
        assert torch.equal(k_buf, k_want) and torch.equal(v_buf, v_want), (T, hq, hkv, D)


@pytest.mark.parametrize("variant", RUNNABLE)
def test_the_norm_of_several_rows_is_each_rows_own(variant):
    g = torch.Generator().manual_seed(3)
    norm = _norm(576, 1e-5, g)
    width = decode_ops.sum_lanes(norm.forward, norm.weight.detach(), norm.variance_epsilon)
    x, delta = torch.randn(1, 16, 576, generator=g), torch.randn(1, 16, 576, generator=g)
    with torch.inference_mode():
        ref = norm(x + delta)
        out = decode_ops.add_rms_norm(x.clone(), norm.weight.detach(), 1e-5, delta, width, BUILDS[variant])
    assert torch.equal(out, ref)


def test_bad_arguments_are_refused():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="rows of 8 floats"):
        decode_ops.add_rms_norm(torch.zeros(9), w, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        decode_ops.add_rms_norm(torch.zeros(8, dtype=torch.float64), w, 1e-6)
    with pytest.raises(ValueError, match="refused"):
        decode_ops.add_rms_norm(torch.zeros(8), w, 1e-6, width=4)
    cos = torch.ones(1, 4)
    with pytest.raises(ValueError, match="hq \\+ 2 hkv"):
        decode_ops.rope_write(torch.zeros(10), cos, cos, 1, 1, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="consecutive positions"):
        decode_ops.rope_write(torch.zeros(12), cos, cos, 1, 1, torch.zeros(1, 1, 8)[..., ::2],
                              torch.zeros(1, 1, 8)[..., ::2])
