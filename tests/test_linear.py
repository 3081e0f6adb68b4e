"""Packed linears (packed_linear.py): what they replace, what they keep, and that the profile records them."""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_graft_equals_recompute, tiny_engine, tiny_model

from kvmemory.models import attention
from kvmemory.models import packed_linear
from kvmemory.models.loading import linear_implementation
from kvmemory.engine.engine import Engine
from kvmemory.errors import ProfileMismatch
from kvmemory.models.loading import LoadedModel
from kvmemory.engine.profile import ExecutionProfile
from kvmemory.store.local import LocalStore

pytestmark = pytest.mark.skipif(not packed_linear.AVAILABLE, reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("dtype", sorted(packed_linear.PACKABLE_DTYPES, key=str))
def test_every_linear_is_packed_and_the_weights_stay(dtype):
    plain = tiny_model("llama", dtype, pack=False)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    n_linear = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert linear_implementation(plain) == packed_linear.PLAIN
    assert packed_linear.pack_linears(plain) == n_linear > 0
    assert linear_implementation(plain) == packed_linear.NAME
    after = plain.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_tied_lm_head_stays_tied():
    model = tiny_model("gemma3")  # ties lm_head to the embeddings
    assert model.config.tie_word_embeddings
    assert isinstance(model.lm_head, packed_linear.PackedLinear)
    assert model.lm_head.weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("dtype", sorted(packed_linear.PACKABLE_DTYPES, key=str))
def test_packed_linear_is_deterministic_and_computes_the_same_map(dtype):
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 160, bias=True).to(dtype)
    packed = packed_linear.PackedLinear.from_linear(plain)
    x = torch.randn(1, 16, 96, dtype=dtype)
    with torch.inference_mode():
        a, b = packed(x), packed(x)
        storage = torch.empty(1 + x.numel(), dtype=dtype)
        shifted = storage[1:].view_as(x).copy_(x)  # another alignment, same values
        c = packed(shifted)
        ref = plain(x)
    assert torch.equal(a, b) and torch.equal(a, c)
    # Other rounding than sgemm (hence the profile field), the same linear map.
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(a.float(), ref.float(), atol=tol, rtol=tol)


def test_profile_records_the_linear_implementation(tmp_path):
    eng = tiny_engine("llama", tmp_path / "s")
    assert eng.profile.linear_impl == packed_linear.NAME
    plain = Engine(LoadedModel(tiny_model("llama", pack=False), eng.tokenizer, "tiny-llama", "tiny-llama"),
                   LocalStore(tmp_path / "s"), chunk=eng.chunk)
    assert plain.profile.linear_impl == packed_linear.PLAIN
    assert tuple(plain.profile.diff(eng.profile)) == ("linear_impl",)
    with pytest.raises(ProfileMismatch, match="linear_impl"):
        plain.require_profile(eng.profile_id, "these blocks")
    # A profile stored before the field existed computed with plain linears.
    old = {k: v for k, v in eng.profile.to_dict().items() if k != "linear_impl"}
    assert ExecutionProfile.from_dict(old).linear_impl == packed_linear.PLAIN


def test_graft_is_exact_with_packed_linears(tmp_path):
    eng = tiny_engine("qwen3", tmp_path / "s")
    assert linear_implementation(eng.model) == packed_linear.NAME
    ids = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_graft_equals_recompute(eng, ids, stored=64, new_tokens=4)


def test_engine_can_keep_plain_linears(tmp_path):
    """The opt-out for memory-tight machines: no packed copies, and a profile that says so."""
    from kvmemory.models.loading import DEFAULT_MODEL

    eng = Engine.open(DEFAULT_MODEL, tmp_path / "s", linears="plain")
    assert eng.profile.linear_impl == packed_linear.PLAIN
    assert not any(isinstance(m, packed_linear.PackedLinear) for m in eng.model.modules())
    assert eng.profile.attn_implementation == attention.for_device("sdpa", "cpu")  # only the linears stay plain
