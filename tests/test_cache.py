"""The runner's cache (cache.py) and CPU attention (attention.py): room reserved up front, memory kept
between grafts, grouped-query SDPA. None of it may change a logit bit."""

from __future__ import annotations

import pytest
import torch
from tiny_models import IdTokenizer, tiny_engine, tiny_model
from transformers import DynamicCache

from kvmemory.kernels import few_query_attention
from kvmemory.models.attention import FEWQ, NAME, for_device
from kvmemory.engine.cache import ReservedLayer, new_cache
from kvmemory.engine.engine import Engine
from kvmemory.errors import InvalidInput, UnsupportedArchitecture
from kvmemory.models.loading import LoadedModel
from kvmemory.store.local import LocalStore


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_room_does_not_change_logits(arch, store_dir):
    """Logits are equal whatever room the cache reserved (none: it grows; exact; far more), and equal
    to transformers' own DynamicCache, which concatenates."""
    eng = tiny_engine(arch, store_dir)
    ids = _ids(75)
    runs = []
    for cache in (new_cache(eng.model, 0), new_cache(eng.model, 75 + 4), new_cache(eng.model, 4096),
                  DynamicCache(config=eng.model.config)):
        res = eng.runner.forward(ids, cache=cache, max_new_tokens=4, stop_token_ids=())
        runs.append(res.all_logits())
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    if arch == "gemma3":  # sliding layers keep transformers' own layer; full ones reserve room
        assert any(isinstance(l, ReservedLayer) for l in new_cache(eng.model).layers)
        assert not all(isinstance(l, ReservedLayer) for l in new_cache(eng.model).layers)


def test_reserved_layer_writes_in_place_and_regrows():
    layer = ReservedLayer(capacity=8)
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    keys, _ = layer.update(k, k + 1)
    buf = layer.k_buf
    keys, values = layer.update(k * 2, k * 2 + 1)
    assert layer.k_buf is buf and keys.data_ptr() == buf.data_ptr() and keys.shape == (1, 2, 6, 4)
    assert torch.equal(keys, torch.cat([k, k * 2], -2)) and torch.equal(values, torch.cat([k + 1, k * 2 + 1], -2))
    layer.update(k * 3, k * 3)  # 9 > 8 positions: one regrowth, the content kept
    assert layer.k_buf is not buf and layer.k_buf.shape[-2] >= 9
    assert torch.equal(layer.keys, torch.cat([k, k * 2, k * 3], -2))
    layer.batch_repeat_interleave(2)  # transformers replaces keys: the layer notices and reallocates
    keys, _ = layer.update(k.repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1))
    assert keys.shape == (2, 2, 12, 4) and torch.equal(keys[1], torch.cat([k, k * 2, k * 3, k], -2)[0])


def test_a_layer_marked_filled_makes_its_views_when_read():
    """mark_filled(end): the views of the first `end` positions are made when next read (a write through
    update, a crop, the length asked for all see them); only assignments of the views count as writes."""
    layer = ReservedLayer(capacity=8)
    k = torch.arange(2 * 2 * 4, dtype=torch.float32).view(1, 2, 2, 4)
    layer.update(k, k + 1)
    writes = layer.writes
    layer.k_buf[:, :, 2:4], layer.v_buf[:, :, 2:4] = k * 2, k * 2 + 1  # as a C step writes them
    layer.mark_filled(4)
    assert layer.writes == writes and layer.get_seq_length() == 4
    assert torch.equal(layer.keys, torch.cat([k, k * 2], -2))
    assert torch.equal(layer.values, torch.cat([k + 1, k * 2 + 1], -2))
    assert layer.keys.data_ptr() == layer.k_buf.data_ptr() and layer.writes == writes
    layer.mark_filled(5)
    keys, values = layer.update(k[:, :, :1] * 3, k[:, :, :1] * 3)  # appended after the 5 marked, not the 4 seen
    assert keys.shape[-2] == 6 and torch.equal(keys[:, :, 5:], k[:, :, :1] * 3) and layer.writes > writes
    layer.mark_filled(6)
    layer.crop(-3)  # drop the last 3
    assert layer.get_seq_length() == 3 and torch.equal(layer.values, torch.cat([k + 1, k[:, :, :1] * 2 + 1], -2))


def test_room_is_reused_and_stays_exact(store_dir):
    """The second graft reads into the first one's memory; stale positions past the new prompt never
    reach attention, so the logits still equal the recompute's."""
    eng = tiny_engine("llama", store_dir)
    long, short = _ids(200, seed=1), _ids(90, seed=2)
    eng.store_prefix(long[:192])
    eng.store_prefix(short[:80])
    got, rep = eng.forward(long, max_new_tokens=3, stop_token_ids=(), keep_logits=True)
    assert rep.tokens_grafted == 192
    whole = eng.room._whole
    assert whole is not None and whole.shape[3] >= 203
    for ids in (short, long):
        got, rep = eng.forward(ids, max_new_tokens=3, stop_token_ids=(), keep_logits=True)
        ref = eng.recompute(ids, max_new_tokens=3, stop_token_ids=())
        assert rep.tokens_grafted == (80 if ids is short else 192)
        assert torch.equal(got.prefill_logits, ref.prefill_logits[rep.tokens_grafted:])
        assert torch.equal(got.decode_logits, ref.decode_logits)
        assert eng.room._whole is whole  # the same memory, handed back after each forward
    eng.room.clear()
    assert eng.room._whole is None


def test_cpu_loads_grouped_sdpa(store_dir):
    # On an AVX-512 or AVX2 CPU the few-query kernel must build and be chosen (CI proves it builds);
    # elsewhere the grouped SDPA alone.
    cpu_default = FEWQ if few_query_attention.isa() in few_query_attention.BUILDS else NAME
    assert for_device("sdpa", "cpu") == cpu_default
    assert for_device(NAME, "cpu") == NAME  # asked for by name: kept
    assert for_device("sdpa", "cuda") == "sdpa" and for_device("eager", "cpu") == "eager"
    eng = tiny_engine("llama", store_dir)  # 4 query heads over 2 K/V heads
    assert eng.profile.attn_implementation == cpu_default
    m = tiny_model("llama", attn="sdpa")
    assert m.config._attn_implementation == "sdpa"


def test_reserved_layer_keeps_a_narrower_kv_dtype():
    """K/V written into a bfloat16 cache are rounded once, the way `Tensor.to` rounds them."""
    layer = ReservedLayer(capacity=8, kv_dtype=torch.bfloat16)
    k = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    keys, values = layer.update(k, k * 3)
    assert keys.dtype == torch.bfloat16 and torch.equal(keys, k.bfloat16()) and torch.equal(values, (k * 3).bfloat16())
    buf = layer.k_buf
    keys, _ = layer.update(k * 2, k)
    assert layer.k_buf is buf and torch.equal(keys, torch.cat([k, k * 2], -2).bfloat16())


@pytest.mark.parametrize("attn", [FEWQ, NAME])
def test_bfloat16_kv_under_a_float32_model_is_exact(attn, store_dir):
    """kv_dtype=bfloat16: blocks hold bfloat16 K/V (half the bytes), the profile says so, and a graft
    gives the recompute's logits bit for bit, under the kernel and under SDPA alike."""
    if attn == FEWQ and few_query_attention.load() is None:
        pytest.skip(f"the few-query kernel does not run here: {few_query_attention.why_unavailable()}")
    model = tiny_model("llama", torch.float32, attn=for_device(attn, "cpu"))
    eng = Engine(LoadedModel(model, IdTokenizer(), "tiny-llama", "tiny-llama"), LocalStore(store_dir / "bf16"),
                 chunk=16, kv_dtype="bfloat16")
    full = tiny_engine("llama", store_dir / "f32")
    assert (eng.profile.dtype, eng.profile.kv_dtype) == ("float32", "bfloat16")
    assert eng.profile.attn_implementation == attn and eng.profile_id != full.profile_id
    ids = _ids(120, seed=3)
    reports = []
    for e in (eng, full):
        e.store_prefix(ids[:96])
        got, rep = e.forward(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True)
        ref = e.recompute(ids, max_new_tokens=4, stop_token_ids=())
        assert rep.tokens_grafted == 96 and got.prefill_logits.dtype == torch.float32
        assert torch.equal(got.prefill_logits, ref.prefill_logits[96:])
        assert torch.equal(got.decode_logits, ref.decode_logits)
        reports.append((rep, got, ref))
    (rep16, got16, _), (rep32, got32, _) = reports
    assert rep16.bytes_read * 2 == rep32.bytes_read  # half the bytes read and verified
    assert eng.room._whole.dtype == torch.bfloat16 and full.room._whole.dtype == torch.float32  # the grafted caches
    assert not torch.equal(got16.prefill_logits, got32.prefill_logits)  # another profile, other bits


def test_kv_dtype_is_checked(store_dir):
    with pytest.raises(InvalidInput, match="kv_dtype must be 'auto' or a dtype name"):
        tiny_engine("llama", store_dir, kv_dtype="int8")
    with pytest.raises(InvalidInput, match="not supported"):
        tiny_engine("llama", store_dir, dtype=torch.bfloat16, kv_dtype="float32")
    with pytest.raises(InvalidInput, match="needs attention"):
        Engine(LoadedModel(tiny_model("llama", attn="eager"), IdTokenizer(), "t", "t"), LocalStore(store_dir),
               chunk=16, kv_dtype="bfloat16")
    with pytest.raises(UnsupportedArchitecture, match="full-attention layers only"):
        tiny_engine("gemma3", store_dir, kv_dtype="bfloat16")
    # "auto" narrows only where it may: not with sliding-window layers, not for a bfloat16 model
    assert tiny_engine("gemma3", store_dir, kv_dtype="auto").profile.kv_dtype == "float32"
    assert tiny_engine("llama", store_dir, dtype=torch.bfloat16, kv_dtype="auto").profile.kv_dtype == "bfloat16"
    assert tiny_engine("llama", store_dir, kv_dtype="auto").profile.kv_dtype == "bfloat16"


def test_models_opened_by_name_keep_bfloat16_kv_by_default(tmp_path):
    """Engine.open's "auto": the embedded float32 model keeps bfloat16 K/V on the CPU; the graft is
    bit-identical to the recompute under it; float32 K/V is one argument away, and a store made
    under one is refused under the other with the field and the way back named."""
    from kvmemory.errors import ProfileMismatch
    from kvmemory.models.loading import DEFAULT_MODEL

    eng = Engine.open(DEFAULT_MODEL, tmp_path / "s")
    assert (eng.profile.dtype, eng.profile.kv_dtype) == ("float32", "bfloat16")
    ids = torch.randint(100, 40000, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    eng.store_prefix(ids[:128])
    got, rep = eng.forward(ids, max_new_tokens=2, stop_token_ids=(), keep_logits=True)
    ref = eng.recompute(ids, max_new_tokens=2, stop_token_ids=())
    assert rep.tokens_grafted == 128 and rep.bytes_read == 128 * 30 * 2 * 3 * 64 * 2  # bfloat16 bytes
    assert torch.equal(got.prefill_logits, ref.prefill_logits[128:]) and torch.equal(got.decode_logits, ref.decode_logits)
    f32 = Engine(eng.loaded, eng.store, kv_dtype="float32")
    assert f32.profile.kv_dtype == "float32" and f32.profile_id != eng.profile_id
    with pytest.raises(ProfileMismatch, match=r"kv_dtype: stored 'bfloat16' vs current 'float32'.*--kv-dtype bfloat16"):
        f32.require_profile(eng.profile_id, "these blocks")
