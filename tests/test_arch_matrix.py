"""The architecture matrix: tiny random-init models of each family, fp32 and bf16.

For each: a graft plus a computed suffix gives logits `torch.equal` to the canonical recompute; a
shifted graft is refused; a graft under another profile is refused; a corrupted block is caught and
recomputed. Architectures that cannot be exact are refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, tiny_engine, tiny_model
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvmemory.errors import InvalidInput, NotOnGrid, ProfileMismatch, UnsupportedArchitecture
from kvmemory.engine.graft import GraftReport, load_chain, plan_chain
from kvmemory.engine.runner import CanonicalRunner

DTYPES = [torch.float32, torch.bfloat16]
SLIDING = {"mistral", "qwen2", "gemma2", "gemma3"}


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_graft_plus_suffix_is_bit_identical(arch, dtype, store_dir):
    eng = tiny_engine(arch, store_dir, dtype)
    if arch in SLIDING:  # the windows must really be crossed for the test to mean something
        assert any(isinstance(l, DynamicSlidingWindowLayer) for l in eng.runner.new_cache().layers)
    ids = _ids(130)
    assert eng.store_prefix(ids[:100]) == 6  # 6 full blocks of C=16
    got, report = eng.forward(ids, max_new_tokens=5, stop_token_ids=(), keep_logits=True)
    ref = eng.recompute(ids, max_new_tokens=5, stop_token_ids=())
    assert report.tokens_grafted == 96 and report.tokens_computed == 34 and report.fallback is None
    assert torch.equal(got.prefill_logits, ref.prefill_logits[96:])
    assert torch.equal(got.decode_logits, ref.decode_logits)
    assert got.generated == ref.generated
    vr = eng.verify_tokens(ids, decode_tokens=3)
    assert vr.bit_identical and vr.comparison.kl_max == 0.0 and vr.comparison.argmax_agreement == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_last_logits_mode_grafts_bit_identical(arch, dtype, store_dir):
    """logits="last" (what answers compute: the rows a token is chosen from): the graft's and the
    recompute's rows are the same bytes, so their hashes over every row computed are equal."""
    eng = tiny_engine(arch, store_dir, dtype)
    ids = _ids(130)
    eng.store_prefix(ids[:100])
    got, report = eng.forward(ids, max_new_tokens=5, stop_token_ids=(), logits="last")
    ref = eng.recompute(ids, max_new_tokens=5, stop_token_ids=(), keep_logits=False, logits="last")
    assert report.tokens_grafted == 96 and got.prefill_logits is None
    assert got.logits_sha256 == ref.logits_sha256 and got.generated == ref.generated
    assert len(got.argmax) == len(ref.argmax) == 5  # the prompt's last row, then 4 decode steps
    full = eng.recompute(ids, max_new_tokens=5, stop_token_ids=())
    assert got.generated == full.generated  # the same tokens as the all-rows reference
    with pytest.raises(InvalidInput):
        eng.forward(ids, max_new_tokens=1, keep_logits=True, logits="last")  # no prefill rows to keep
    with pytest.raises(InvalidInput):
        eng.recompute(ids, logits="first")


@pytest.mark.parametrize("arch", ARCHS)
def test_shifted_graft_is_refused(arch, store_dir):
    eng = tiny_engine(arch, store_dir)
    ids = _ids(80)
    eng.store_prefix(ids)
    report = GraftReport()
    chain = load_chain(eng.store, plan_chain(eng.store, eng.profile_id, ids, eng.chunk), report)
    assert len(chain.metas) == 4
    with pytest.raises(NotOnGrid, match="shifted|cannot be grafted"):
        eng.graft_chain([0] * 16 + ids, chain, report, start=16)
    with pytest.raises(NotOnGrid):
        eng.graft_chain(ids, chain, report, start=8)  # off the grid
    # The same tokens behind another prefix are other positions: nothing is found, all is computed.
    shifted = _ids(16, seed=9) + ids
    got, rep = eng.forward(shifted, keep_logits=True)
    assert rep.tokens_grafted == 0
    assert torch.equal(got.prefill_logits, eng.recompute(shifted).prefill_logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_graft_under_another_profile_is_refused(arch, tmp_path):
    a = tiny_engine(arch, tmp_path / "s", seed=0)
    b = tiny_engine(arch, tmp_path / "s", seed=1)  # same store, other weights
    ids = _ids(70)
    a.store_prefix(ids)
    report = GraftReport()
    chain = load_chain(a.store, plan_chain(a.store, a.profile_id, ids, a.chunk), report)
    with pytest.raises(ProfileMismatch) as err:
        b.graft_chain(ids, chain, report)
    assert "model_sha256" in err.value.fields and "model_sha256" in str(err.value)
    # Lookups under the other profile find nothing to graft (the profile is in the chain hash).
    assert plan_chain(b.store, b.profile_id, ids, b.chunk) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_corrupted_block_is_caught(arch, dtype, store_dir):
    eng = tiny_engine(arch, store_dir, dtype)
    ids = _ids(90)
    eng.store_prefix(ids[:80])
    hashes = [r.hash for r in plan_chain(eng.store, eng.profile_id, ids, eng.chunk)]
    victim = eng.store.block_path(hashes[2])
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x10  # one bit of the payload
    victim.write_bytes(bytes(data))
    got, report = eng.forward(ids, keep_logits=True)
    assert report.quarantined == [hashes[2]] and "quarantined" in report.fallback
    assert report.tokens_grafted == 32  # blocks 0 and 1 only
    assert torch.equal(got.prefill_logits, eng.recompute(ids).prefill_logits[32:])
    assert eng.store.get_block(hashes[2]).quarantined
    # Next time the damaged block is simply not found.
    _, again = eng.forward(ids)
    assert again.tokens_grafted == 32 and again.quarantined == []


def test_length_dependent_rope_is_refused():
    import transformers as T
    from tiny_models import _base

    cfg = T.Phi3Config(**_base(pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
                               original_max_position_embeddings=64,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                "original_max_position_embeddings": 64}))
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedArchitecture, match="longrope"):
        CanonicalRunner(model, 16)


def test_sliding_window_smaller_than_grid_is_refused():
    model = tiny_model("mistral")  # window 40
    with pytest.raises(UnsupportedArchitecture, match="sliding window"):
        CanonicalRunner(model, 64)
