"""The lean llama decode step (kvmemory/models/llama_step.py) computes transformers' bits.

Each check runs the same steps twice from equal caches, one side through `LlamaLeanStep.step`, the
other through transformers' `LlamaForCausalLM.forward`, and asserts with `torch.equal` that every
step's logits and, at the end, every layer's K/V are the same bytes: one-token decode steps and
prefill chunks of several tokens (from an empty cache on), with the decode-step kernel's norms and
RoPE (kernels/decode_ops.py) where it runs, and with torch's ops in their place.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from tiny_models import tiny_model

from kvmemory.engine.runner import CanonicalRunner
from kvmemory.kernels import decode_ops
from kvmemory.models import gguf_linear, llama_step

needs_decode_kernel = pytest.mark.skipif(decode_ops.load() is None, reason="the decode-step kernel does not run here")


def _decode_both_ways(runner: CanonicalRunner, prompt: list[int], steps: int) -> None:
    lean = runner._lean_step
    assert lean is not None
    caches = [runner.new_cache(len(prompt) + steps), runner.new_cache(len(prompt) + steps)]
    for cache in caches:
        runner.forward(prompt, cache=cache, keep_logits=False)
    tok, n = prompt[-1], len(prompt)
    for i in range(steps):
        ids = torch.tensor([[tok]])
        mine = lean.step(ids, n + i, caches[0])
        with torch.inference_mode():
            theirs = runner.model(input_ids=ids, position_ids=torch.tensor([[n + i]]), use_cache=True,
                                  **{runner._cache_kwarg: caches[1]}).logits[0]
        assert torch.equal(mine, theirs), i
        tok = int(theirs[-1].argmax())
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _prefill_both_ways(runner: CanonicalRunner, prompt: list[int], chunk: int) -> None:
    lean = runner._lean_step
    caches = [runner.new_cache(len(prompt) + 4), runner.new_cache(len(prompt) + 4)]
    for s in range(0, len(prompt), chunk):
        ids = torch.tensor([prompt[s:s + chunk]])
        mine = lean.step(ids, s, caches[0])
        with torch.inference_mode():
            theirs = runner.model(input_ids=ids, position_ids=torch.arange(s, s + ids.shape[1]).unsqueeze(0),
                                  use_cache=True, **{runner._cache_kwarg: caches[1]}).logits[0]
        assert torch.equal(mine, theirs), s
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_embedded_model_decodes_transformers_bits(smollm):
    runner = CanonicalRunner(smollm.model)
    if not any(isinstance(m, gguf_linear.GGUFLinear) for m in smollm.model.modules()):
        pytest.skip("the embedded model runs packed linears here (no GGUF-block kernel): covered by the tiny model")
    assert all(f is not None for f in runner._lean_step.qkv)  # q/k/v in one kernel call
    prompt = torch.randint(0, 49152, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    _decode_both_ways(runner, prompt, steps=6)
    _prefill_both_ways(runner, prompt, chunk=64)  # a grid chunk, then the 6 after it
    _prefill_both_ways(runner, prompt[:40], chunk=16)  # the step after a graft's, and a ragged last one
    # the fused panels are the layers' own (views, no copy): each layer still computes alone
    layer = smollm.model.model.layers[0].self_attn
    assert layer.k_proj.q.untyped_storage().data_ptr() == runner._lean_step.qkv[0].q.untyped_storage().data_ptr()
    x = torch.randn(2, 576)
    with torch.inference_mode():
        assert torch.equal(runner._lean_step.qkv[0](x)[:, 576:768], layer.k_proj(x))


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
def test_a_tiny_llama_decodes_transformers_bits(kv_dtype):
    model = tiny_model("llama")
    runner = CanonicalRunner(model, chunk=16, kv_dtype=kv_dtype)
    assert runner._lean_step.qkv == [None, None]  # packed linears: one call each
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _decode_both_ways(runner, prompt, steps=5)
    for chunk in (16, 7, 1):
        _prefill_both_ways(runner, prompt, chunk)


@needs_decode_kernel
def test_the_decode_kernel_is_taken_and_torch_ops_give_the_same_bits(smollm):
    """Where the kernel runs the step uses it (its sum width found against the model's own norm), and
    the same step with torch's ops in its place (the fallback) gives transformers' bits too."""
    lean = CanonicalRunner(smollm.model)._lean_step
    assert lean.kernel is not None and lean.width in decode_ops.WIDTHS
    runner = CanonicalRunner(tiny_model("llama"), chunk=16)
    prompt = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    kernel, width = runner._lean_step.kernel, runner._lean_step.width
    assert kernel is not None
    try:
        runner._lean_step.kernel = runner._lean_step.width = None
        _decode_both_ways(runner, prompt, steps=4)
        _prefill_both_ways(runner, prompt, chunk=8)
    finally:
        runner._lean_step.kernel, runner._lean_step.width = kernel, width


def _steps(lean, runner, prompt, steps, kv_dtype, python_path: bool):
    """Logits of `steps` greedy decode steps after a prefill, and the cache; python_path: the step's
    own Python loop (marks on), else whichever path it takes."""
    cache = runner.new_cache(len(prompt) + steps)
    runner.forward(prompt, cache=cache, keep_logits=False)
    out, tok, n = [], prompt[-1], len(prompt)
    for i in range(steps):
        logits = lean.step(torch.tensor([[tok]]), n + i, cache, marks=[] if python_path else None)
        out.append(logits)
        tok = int(logits[-1].argmax())
    return out, cache


@needs_decode_kernel
@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("variant", [None, "avx2"])
def test_the_c_layer_loop_gives_the_python_loops_bits(smollm, kv_dtype, variant, monkeypatch):
    """Decode steps whose layers run through kvm_decode_layer (C calling the same kernels) give the
    bytes of the Python loop's calls: logits and every layer's K/V, float32 and bfloat16 caches. `variant`: the AVX2 builds of all three kernels
    (on an AVX-512 CPU too), both loops calling them (the linears' AVX2 build gives the AVX-512 one's bits,
    tests/test_gguf_linear.py; the attention's has bits of its own)."""
    from kvmemory.kernels import cpu, few_query_attention, quantized_linear

    runner = CanonicalRunner(smollm.model, kv_dtype=kv_dtype)
    lean = runner._lean_step
    if lean.c_layers is None:
        pytest.skip("the embedded model's linears are not GGUF blocks here (no GGUF-block kernel)")
    if variant is not None:
        if cpu.isa() not in ("AVX512", "AVX2"):
            pytest.skip("no AVX2 here")
        libs = [decode_ops.load_variant(variant), quantized_linear.load_variant(variant),
                few_query_attention.load_variant(variant)]
        assert all(lib is not None for lib in libs)
        monkeypatch.setattr(lean, "kernel", libs[0])
        monkeypatch.setattr(few_query_attention, "load", lambda: libs[2])  # the Python loop's attention too
        monkeypatch.setattr(lean, "_c_fns", (ctypes.cast(libs[1].kvm_qlinear_linear, ctypes.c_void_p).value,
                                             ctypes.cast(libs[2].kvm_fewq_attention, ctypes.c_void_p).value))
    taken = []
    c_step = lean._c_step
    monkeypatch.setattr(lean, "_c_step", lambda *a: taken.append(1) or c_step(*a))
    prompt = torch.randint(0, 49152, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    mine, mine_cache = _steps(lean, runner, prompt, 6, kv_dtype, python_path=False)
    assert len(taken) == 7  # the prefill's last 6 tokens (a grid chunk after 64) and every decode step
    taken.clear()
    theirs, their_cache = _steps(lean, runner, prompt, 6, kv_dtype, python_path=True)
    assert len(taken) == 1  # the prefill's 6 tokens; with marks on the decode steps keep the Python loop
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    for a, b in zip(mine_cache.layers, their_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # the step after a graft: 16 tokens over a cache, under the causal mask
    chunk = torch.tensor([prompt[64:70] + prompt[:10]])
    outs, caches = [], []
    for python_path in (False, True):
        cache = runner.new_cache(len(prompt) + 20)
        runner.forward(prompt[:64], cache=cache, keep_logits=False)
        taken.clear()
        outs.append(lean.step(chunk, 64, cache, marks=[] if python_path else None))
        assert len(taken) == (0 if python_path else 1)
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*(c.layers for c in caches)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_mask_the_kernel_would_refuse_keeps_the_python_loop():
    """The C loop takes a mask only where the attention kernel takes it (rows that are non-empty
    prefixes of trues), checked before any layer runs."""
    T, S = 3, 10
    good = (torch.arange(S) < torch.tensor([[8], [9], [10]]))[None, None]
    assert llama_step.LlamaLeanStep._c_mask(None, T, S) and llama_step.LlamaLeanStep._c_mask(good, T, S)
    holed = good.clone()
    holed[0, 0, 1, 2] = False
    empty = good.clone()
    empty[0, 0, 0] = False
    for bad in (holed, empty, good.float(), good[..., :9], good.transpose(2, 3).contiguous().transpose(2, 3)):
        assert not llama_step.LlamaLeanStep._c_mask(bad, T, S)


@needs_decode_kernel
def test_a_cache_without_room_takes_the_cache_update_path():
    """A cache whose reserved room is full (or is not kvmemory's) gets its K/V through `update`, with
    the same bits."""
    runner = CanonicalRunner(tiny_model("llama"), chunk=16)
    prompt = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    lean = runner._lean_step
    caches = [runner.new_cache(len(prompt)), runner.new_cache(len(prompt))]  # no room past the prompt
    for cache in caches:
        runner.forward(prompt, cache=cache, keep_logits=False)
    assert caches[0].layers[0].next_position(1, 2, 16, torch.float32) is None
    ids, n = torch.tensor([[prompt[-1]]]), len(prompt)
    mine = lean.step(ids, n, caches[0])
    with torch.inference_mode():
        theirs = runner.model(input_ids=ids, position_ids=torch.tensor([[n]]), use_cache=True,
                              **{runner._cache_kwarg: caches[1]}).logits[0]
    assert torch.equal(mine, theirs)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(caches[0].layers, caches[1].layers))


def test_a_qwen2_model_from_gguf_blocks_decodes_transformers_bits(tmp_path, monkeypatch):
    """Qwen2 (biases on q/k/v, fused with their biases) from a GGUF file's blocks: the lean step's logits
    and K/V (through the C layer loop, which adds the biases, where it runs) are transformers' forward's,
    byte for byte."""
    from gguf_files import write_tiny_gguf

    from kvmemory.models.loading import load_model

    if native_qlinear() is None:
        pytest.skip("the GGUF-block kernel does not run here")
    monkeypatch.setenv("KVMEMORY_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "q.gguf", "qwen2", linear_type="Q8_0")[0]
    model = load_model(str(path)).model
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    runner = CanonicalRunner(model, chunk=16)
    assert runner._lean_step is not None and all(f is not None and f.bias is not None for f in runner._lean_step.qkv)
    assert (runner._lean_step.c_layers is not None) == (decode_ops.load() is not None)  # biases added in C too
    prompt = torch.randint(0, 272, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _decode_both_ways(runner, prompt, steps=5)
    for chunk in (16, 7):
        _prefill_both_ways(runner, prompt, chunk)


def test_the_c_layer_loop_runs_unfused_linears_side_by_side(tmp_path, monkeypatch):
    """Where q/k/v or gate/up are not one fused linear (a Q4_K_M file's v is Q6_K in some layers, so they
    cannot fuse), the C loop still runs (decode_ops.cpp's run_side_by_side), each linear into its own
    columns: transformers' bits, byte for byte, decoding and for a several-row chunk."""
    from gguf_files import write_tiny_gguf

    from kvmemory.models.loading import load_model

    if native_qlinear() is None or decode_ops.load() is None:
        pytest.skip("the GGUF-block and decode-step kernels do not run here")
    monkeypatch.setenv("KVMEMORY_CACHE", str(tmp_path / "cache"))
    model = load_model(str(write_tiny_gguf(tmp_path / "q.gguf", "qwen2", linear_type="Q8_0")[0])).model
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    runner = CanonicalRunner(model, chunk=16)
    lean = runner._lean_step
    n = len(lean.layers)
    lean.qkv, lean.gate_up = [None] * n, [None] * n  # as if the block types differed
    lean.c_layers = lean._c_layers()
    assert lean.c_layers is not None and all(layer.k.q and layer.v.q and layer.up.q for layer in lean.c_layers)
    taken = []
    c_step = lean._c_step
    monkeypatch.setattr(lean, "_c_step", lambda *a: taken.append(a) or c_step(*a))
    prompt = torch.randint(0, 272, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _decode_both_ways(runner, prompt, steps=4)
    assert len(taken) >= 4
    taken.clear()
    _prefill_both_ways(runner, prompt, 3)  # 3-row steps through the C loop: rows copied into place
    assert taken


def native_qlinear():
    from kvmemory.kernels import quantized_linear

    return quantized_linear.load()


def test_one_step_per_model():
    model = tiny_model("llama")
    assert CanonicalRunner(model)._lean_step is CanonicalRunner(model)._lean_step


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("mistral", None), ("qwen3", None)])
def test_other_models_and_transformers_own_attention_keep_transformers_forward(arch, attn):
    """The stock profile's attentions (transformers' own) and other architectures never take it."""
    model = tiny_model(arch, attn=attn)
    assert llama_step.why_not(model) is not None
    assert CanonicalRunner(model, chunk=16)._lean_step is None


def test_decode_parts_times_every_part_of_the_step():
    from kvmemory.bench import decode_parts

    r = decode_parts.run(lengths=(64,), steps=3)
    row = r["lengths"]["64"]
    assert list(row["parts_ms"]) == ["embedding, mask, rope tables", "norms + residual adds", "q/k/v linears",
                                     "rope + cache write", "attention", "o linear", "mlp (gate/up, silu, down)",
                                     "final norm + lm_head"]
    assert all(v > 0 for v in row["parts_ms"].values()) and row["step_ms"] > 0 and row["runner_ms_per_token"] > 0
    assert row["unmarked_step_ms"] > 0 and isinstance(row["layers_from_c"], bool)
    assert "| **step** |" in decode_parts.format_table(r)
