"""The few-query CPU attention kernel (kvmemory/kernels/few_query_attention.py, csrc/few_query_attention.cpp).

On an AVX-512 or AVX2 CPU its library must be installed and load (a missing or stale build here is a
FAILURE: the install's build step proves it builds); elsewhere these tests skip, and
`attention.for_device` keeps SDPA. They run the build this CPU takes (native.choose); the other one
is compiled again here and, where the CPU runs it too, run (test_the_other_build_*). It is not claimed bit-equal to SDPA, so it
is compared with a float64 reference by tolerance, next to SDPA's own error; what is claimed exact
(the same bytes whatever the thread count, run after run; grafted logits equal to the recompute's
under the profile that uses it) is asserted with `torch.equal`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_engine

from kvmemory.errors import UnsupportedArchitecture
from kvmemory.kernels import build, few_query_attention, native
from kvmemory.models import attention

RUNS_HERE = native.choose("fewq")[0] is not None
needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="the few-query kernel runs on AVX-512 and AVX2 CPUs only")
F = torch.nn.functional


def _inputs(h_q, h_kv, new, cached, d, dtype, seed=0, mask=True):
    g = torch.Generator().manual_seed(seed)
    S = cached + new
    # query as transformers passes it (a transposed view), K/V as views of longer reserved buffers
    q = torch.randn(1, new, h_q, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, h_kv, S + 7, d, generator=g).to(dtype)[:, :, :S]
    v = torch.randn(1, h_kv, S + 7, d, generator=g).to(dtype)[:, :, :S]
    m = torch.ones(new, S, dtype=torch.bool).tril(cached)[None, None] if mask else None
    return q, k, v, m


@needs_kernel
def test_kernel_builds_and_is_the_cpu_default():
    assert few_query_attention.load() is not None, few_query_attention.why_unavailable()
    assert attention.for_device("sdpa", "cpu") == attention.FEWQ


@needs_kernel
def test_kernel_loads_without_a_compiler_or_a_cache(tmp_path):
    """Nothing is compiled at run time: in a new process with no compiler on PATH and an empty cache
    folder the installed library loads, and the cache folder stays empty."""
    env = dict(os.environ, KVMEMORY_CACHE=str(tmp_path / "cache"), PATH=str(tmp_path / "no-bin"))
    env.pop("CXX", None)
    code = ("from kvmemory.kernels import few_query_attention as c; m = c.load(); "
            "print('OK' if m is not None else 'FAILED: ' + str(c.why_unavailable()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("OK"), out.stdout + out.stderr
    assert not (tmp_path / "cache").exists()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h_q,h_kv,new,cached,d", [
    (9, 3, 16, 2048, 64),   # SmolLM2: a graft's 16 new tokens
    (9, 3, 1, 3000, 64),    # decoding (no unit boundary at a multiple of 512)
    (4, 2, 16, 100, 16),    # the tiny test models: fewer keys than one unit
    (8, 8, 5, 700, 128),    # no grouping, D = 128, a part-filled second unit
    (4, 1, 16, 1030, 32),   # 64 rows per K/V head: four row blocks, one score pass
    (12, 2, 16, 1300, 128), # Qwen2.5-1.5B's graft: 96 rows per K/V head, two score passes
    (8, 1, 16, 530, 64),    # 128 rows per K/V head (the most it takes)
    # few rows (G * T <= 4) under float32 queries: keys in the lanes (run_unit_few)
    (4, 2, 2, 300, 128),    # 4 rows seeing different keys, D = 128
    (2, 2, 1, 17, 16),      # one row, D = 16, one part-filled block of keys
    (3, 1, 1, 255, 32),     # exactly one unit of keys
])
def test_matches_float64_reference(h_q, h_kv, new, cached, d, dtype, tol):
    q, k, v, m = _inputs(h_q, h_kv, new, cached, d, dtype)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m, enable_gqa=True)
    ref = ref.transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).transpose(1, 2)
    out = few_query_attention.attend(q, k, v, m, d ** -0.5, False)
    assert out is not None and out.shape == (1, new, h_q, d) and out.dtype == dtype and out.is_contiguous()
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, (err, (sdpa.double() - ref).abs().max().item())


@needs_kernel
@pytest.mark.parametrize("variant", [None, "avx2"])
def test_few_rows_with_keys_hidden_from_whole_units(variant):
    """Decode-like calls (2 query heads per K/V head x 2 tokens = 4 rows: the keys-in-lanes path) where
    one token sees only the first 100 of 600 keys, so whole units have no key visible to it: both
    builds, float32 and a bfloat16 cache, against the float64 reference."""
    if variant is not None and not native.runs("AVX2"):
        pytest.skip("needs a CPU that runs AVX2")
    lib = few_query_attention.load_variant(variant) if variant else None
    q, k, v, _ = _inputs(4, 2, 2, 598, 64, torch.float32, seed=9)
    m = torch.ones(2, 600, dtype=torch.bool)
    m[0, 100:] = False
    m = m[None, None]
    for kv in (torch.float32, torch.bfloat16):
        kk, vv = k.to(kv), v.to(kv)
        ref = F.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), attn_mask=m, enable_gqa=True)
        out = few_query_attention.attend(q, kk, vv, m, 0.125, False, lib=lib)
        assert out is not None and (out.double() - ref.transpose(1, 2)).abs().max().item() <= 2e-6


@needs_kernel
def test_no_mask_means_causal_or_all_keys():
    q, k, v, _ = _inputs(9, 3, 16, 0, 64, torch.float32)  # prefill on an empty cache: causal
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    out = few_query_attention.attend(q, k, v, None, 0.125, True)
    assert (out.double() - ref.transpose(1, 2)).abs().max().item() < 2e-6
    q, k, v, _ = _inputs(9, 3, 1, 900, 64, torch.float32)  # one decode token sees every key
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    out = few_query_attention.attend(q, k, v, None, 0.125, False)
    assert (out.double() - ref.transpose(1, 2)).abs().max().item() < 2e-6


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_bytes_whatever_the_thread_count(dtype):
    q, k, v, m = _inputs(9, 3, 16, 4000, 64, dtype, seed=3)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 2):
            torch.set_num_threads(threads)
            outs.append(few_query_attention.attend(q, k, v, m, 0.125, False))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
def test_refuses_what_it_does_not_take():
    q, k, v, m = _inputs(9, 3, 16, 600, 64, torch.float32)
    holes = m.clone()
    holes[0, 0, 3, 10] = False  # not a prefix of trues (padding, sliding windows): SDPA's job
    assert few_query_attention.attend(q, k, v, holes, 0.125, False) is None
    assert few_query_attention.attend(q, k, v, torch.zeros_like(m, dtype=torch.float32), 0.125, False) is None
    blind = m.clone()
    blind[0, 0, 0] = False  # a row that sees no key
    assert few_query_attention.attend(q, k, v, blind, 0.125, False) is None
    assert few_query_attention.attend(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                None, 0.125, False) is None  # batches
    q72, k72, v72, m72 = _inputs(9, 3, 16, 600, 72, torch.float32)
    assert few_query_attention.attend(q72, k72, v72, m72, 0.125, False) is None  # head size not a multiple of 16
    q129, k129, v129, m129 = _inputs(9, 3, 43, 600, 64, torch.float32)
    assert few_query_attention.attend(q129, k129, v129, m129, 0.125, False) is None  # 129 rows per K/V head
    assert few_query_attention.attend(q.half(), k.half(), v.half(), m, 0.125, False) is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_runs_the_kernel_and_stays_exact(dtype, store_dir, monkeypatch):
    """Under `kvmemory_fewq` the grafted run's logits equal the recompute's, and the kernel really ran
    (a refusal would silently give SDPA's numbers under the kernel's name)."""
    taken = []
    attend = few_query_attention.attend

    def counting(*args, **kw):
        out = attend(*args, **kw)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(few_query_attention, "attend", counting)
    eng = tiny_engine("llama", store_dir, dtype)
    assert eng.profile.attn_implementation == attention.FEWQ
    ids = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    eng.store_prefix(ids[:96])
    got, rep = eng.forward(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True)
    ref = eng.recompute(ids, max_new_tokens=4, stop_token_ids=())
    assert rep.tokens_grafted == 96
    assert torch.equal(got.prefill_logits, ref.prefill_logits[96:])
    assert torch.equal(got.decode_logits, ref.decode_logits)
    assert taken and all(taken)


def test_asking_for_the_kernel_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setattr(few_query_attention, "load", lambda: None)
    monkeypatch.setattr(few_query_attention, "why_unavailable", lambda: "the CPU does not run AVX-512 (test)")
    with pytest.raises(UnsupportedArchitecture, match="AVX-512"):
        attention.for_device(attention.FEWQ, "cpu")
    assert attention.for_device("sdpa", "cpu") == attention.NAME  # the default falls back, by name


@pytest.mark.parametrize("variant", [b.variant for b in build.builds("fewq")])
def test_the_other_build_compiles(variant, tmp_path):
    """The build this CPU does not run still compiles from the checkout's sources (so a change made on
    an AVX2 machine cannot break the AVX-512 build unseen, and the reverse), with its entry points
    exported; the build this CPU runs is compiled too, and must be the very library installed."""
    b = build.find("fewq", variant)
    entry = build.compile_library(b, tmp_path)
    out = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / b.filename)], capture_output=True, text=True,
                         check=True).stdout
    assert {"kvm_fewq_attention", "kvm_fewq_abi_version"} <= {line.split()[-1] for line in out.split("\n") if line}
    if variant == native.choose("fewq")[0]:
        assert entry["source_digest"] == native.build_info("fewq")["source_digest"]


@needs_kernel
@pytest.mark.skipif(not native.runs("AVX2"), reason="needs a CPU that runs AVX2")
def test_the_avx2_build_runs_here_too():
    """On an AVX-512 CPU the AVX2 build runs as well (`ATEN_CPU_CAPABILITY=avx2` picks it): it takes the
    same calls and is as close to the float64 reference (its bits are its own: another exp, other tiles)."""
    lib = few_query_attention.load_variant("avx2")
    assert lib is not None
    for dtype, tol, new, h_q in ((torch.float32, 2e-6, 16, 9), (torch.bfloat16, 2e-2, 16, 9),
                                 (torch.float32, 2e-6, 1, 9), (torch.float32, 2e-6, 16, 18),
                                 (torch.bfloat16, 2e-2, 16, 18),  # 18 heads x 16 tokens / 3: 96 rows
                                 (torch.float32, 2e-6, 16, 24)):  # 128 rows: the most it takes
        q, k, v, m = _inputs(h_q, 3, new, 2048, 64, dtype)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m, enable_gqa=True)
        out = few_query_attention.attend(q, k, v, m, 0.125, False, lib=lib)
        assert out is not None and (out.double() - ref.transpose(1, 2)).abs().max().item() <= tol


@needs_kernel
def test_aten_cpu_capability_lowers_the_build(tmp_path):
    """`ATEN_CPU_CAPABILITY=avx2` lowers torch's kernels and kvmemory's alike (the profile's cpu_isa)."""
    if not native.runs("AVX2"):
        pytest.skip("needs a CPU that runs AVX2")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    code = ("import json; from kvmemory.kernels import native; "
            "print(json.dumps([native.choose(k)[0] for k in ('fewq', 'qlinear')]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == '["avx2", "avx2"]', out.stdout + out.stderr


@needs_kernel
@pytest.mark.parametrize("new,cached", [(16, 600), (1, 1500), (5, 40)])
def test_float32_queries_over_a_bfloat16_cache(new, cached):
    """A bfloat16 KV cache under a float32 model: the kernel widens the rows itself, which is exact,
    so it gives the same bytes as over the same K/V widened to float32 beforehand."""
    q, k, v, m = _inputs(9, 3, new, cached, 64, torch.float32, seed=new)
    k16, v16 = k.bfloat16(), v.bfloat16()
    got = few_query_attention.attend(q, k16, v16, m, 0.125, False)
    assert got is not None and got.dtype == torch.float32
    assert torch.equal(got, few_query_attention.attend(q, k16.float(), v16.float(), m, 0.125, False))
    # bfloat16 queries over a float32 cache are not a profile: refused
    assert few_query_attention.attend(q.bfloat16(), k, v, m, 0.125, False) is None


@needs_kernel
def test_a_graft_step_of_96_rows_per_kv_head_stays_exact(store_dir, monkeypatch):
    """Qwen2.5-1.5B's grouping (12 query heads over 2 K/V heads): a graft's 16 new tokens are 96 rows per
    K/V head, which the kernel takes since it takes 128 (they went to SDPA at 64): graft = recompute."""
    taken = []
    attend = few_query_attention.attend

    def counting(q, *args, **kw):
        out = attend(q, *args, **kw)
        taken.append((q.shape[1] // 2 * q.shape[2], out is not None))  # (rows per K/V head, taken)
        return out

    monkeypatch.setattr(few_query_attention, "attend", counting)
    import transformers as T
    from tiny_models import IdTokenizer, _base, assert_graft_equals_recompute

    from kvmemory.engine.engine import Engine
    from kvmemory.models.loading import LoadedModel
    from kvmemory.store.local import LocalStore

    torch.manual_seed(0)
    attn = attention.for_device("sdpa", "cpu")
    cfg = T.LlamaConfig(**_base(hidden_size=192, num_attention_heads=12, num_key_value_heads=2, head_dim=16))
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval().requires_grad_(False)
    eng = Engine(LoadedModel(model, IdTokenizer(), "tiny-gqa6", "tiny-gqa6"), LocalStore(store_dir), chunk=16)
    assert eng.profile.attn_implementation == attention.FEWQ
    ids = torch.randint(0, 256, (112,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_graft_equals_recompute(eng, ids, 96, 4)
    assert (96, True) in taken and all(ok for _, ok in taken)  # the graft's step ran the kernel


@needs_kernel
@pytest.mark.parametrize("variant", [None, "avx2"])
def test_bf16_scores_are_those_of_the_rounded_queries(variant):
    """The q8 profile's scores (`bf16_scores`): float32 queries over a bfloat16 cache, scored as their
    bfloat16 rounding where the build has VDPBF16PS on this CPU (against the float64 reference of the
    rounded queries), else exactly the float32 call (the AVX2 build; `bf16_dot()` says which, and the
    profile records it). Calls of at most 4 rows per K/V head keep the float32 path either way."""
    if variant is not None and not native.runs("AVX2"):
        pytest.skip("needs a CPU that runs AVX2")
    lib = few_query_attention.load_variant(variant) if variant else few_query_attention.load()
    q, k, v, m = _inputs(12, 2, 16, 1500, 128, torch.float32, seed=4)
    k, v = k.bfloat16(), v.bfloat16()
    plain = few_query_attention.attend(q, k, v, m, 128 ** -0.5, False, lib=lib)
    got = few_query_attention.attend(q, k, v, m, 128 ** -0.5, False, lib=lib, bf16_scores=True)
    assert got is not None and got.dtype == torch.float32
    if few_query_attention.bf16_dot(lib):
        ref = F.scaled_dot_product_attention(q.bfloat16().double(), k.double(), v.double(), attn_mask=m,
                                             enable_gqa=True).transpose(1, 2)
        assert (got.double() - ref).abs().max().item() <= 2e-6
        assert not torch.equal(got, plain)  # the rounding is real
    else:
        assert torch.equal(got, plain)
    q1, k1, v1, m1 = _inputs(4, 2, 2, 300, 64, torch.float32, seed=5)  # 4 rows: the keys-in-lanes path
    k1, v1 = k1.bfloat16(), v1.bfloat16()
    assert torch.equal(few_query_attention.attend(q1, k1, v1, m1, 0.125, False, lib=lib, bf16_scores=True),
                       few_query_attention.attend(q1, k1, v1, m1, 0.125, False, lib=lib))
