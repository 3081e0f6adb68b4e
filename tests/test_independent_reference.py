"""kvmemory's canonical runner and its grafts, checked against a reference that shares none of its code.

The reference is `reference_logits` in examples/check_attestation.py (the attestation checker, so there
is one independent implementation): a chunk-grid loop written with torch and transformers alone
(transformers' `DynamicCache`, the model's own forward, prefill chunks at absolute multiples of C with
logits for every position, then greedy decode one token at a time). Under the stock profile
(transformers' own attention, torch's linears, float32 weights and K/V) the runner's logits
(`Engine.recompute`) and every graft's (`Engine.store_prefix`, then `Engine.forward` grafting at
several block boundaries) must equal it byte for byte (the uint8 views compared with torch.equal, and
their SHA-256): on the real embedded model (SmolLM2, loaded by transformers from the folder kvmemory
converts it into) and on the 7-architecture matrix of tests/tiny_models.py.

The reference model is a separate instance loaded (or built) by transformers; that the reference code
imports nothing of kvmemory is checked from its source and by running it in a fresh interpreter. A
control shows the comparison has teeth: the default profile (kvmemory's attention, packed linears,
bfloat16 K/V) gives other bytes than the reference.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, IdTokenizer, tiny_config, tiny_model

from kvmemory.engine.engine import Engine
from kvmemory.engine.graft import plan_chain
from kvmemory.models.loading import LoadedModel, resolve_model_path
from kvmemory.store.local import LocalStore

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "examples" / "check_attestation.py"


def _load_reference():
    spec = importlib.util.spec_from_file_location("check_attestation", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_reference()


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality: same dtype and shape, the same uint8 view, the same SHA-256."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ua, ub = a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8)
    return torch.equal(ua, ub) and (hashlib.sha256(ua.numpy().tobytes()).digest()
                                    == hashlib.sha256(ub.numpy().tobytes()).digest())


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(_bytes_equal(sa[k], sb[k]) for k in sa)


def _check_against_reference(eng: Engine, ref_model: torch.nn.Module, ids: list[int], graft_points: list[int],
                             decode: int) -> None:
    """recompute and a graft at each point: every prefill and decode logit byte-equal to the reference."""
    with reference.pinned_settings(eng.profile.to_dict()):  # the profile's threads and torch settings
        pre, dec, gen = reference.reference_logits(ref_model, ids, eng.chunk, decode)
    assert pre.shape == (len(ids), eng.runner.vocab_size) and dec.shape[0] == decode - 1 and len(gen) == decode
    got = eng.recompute(ids, max_new_tokens=decode)
    assert got.generated == gen
    assert _bytes_equal(got.prefill_logits, pre), "recompute's prefill logits differ from the reference"
    assert _bytes_equal(got.decode_logits, dec), "recompute's decode logits differ from the reference"
    # The blocks up to the last graft point are stored once; the last point is grafted as `forward` finds
    # it (the longest stored chain), the others from that chain's first g / C blocks (`rows`).
    last = max(graft_points)
    assert eng.store_prefix(ids[:last]) == last // eng.chunk
    chain = plan_chain(eng.store, eng.profile_id, ids, eng.chunk)
    assert len(chain) == last // eng.chunk
    for g in graft_points:
        assert g % eng.chunk == 0 and 0 < g < len(ids)
        rows = None if g == last else chain[: g // eng.chunk]
        res, rep = eng.forward(ids, max_new_tokens=decode, stop_token_ids=(), keep_logits=True, rows=rows)
        assert rep.tokens_grafted == g and rep.fallback is None, (g, rep)
        assert res.generated == gen, g
        assert _bytes_equal(res.prefill_logits, pre[g:]), f"graft at {g}: prefill logits differ from the reference"
        assert _bytes_equal(res.decode_logits, dec), f"graft at {g}: decode logits differ from the reference"


# ---------------------------------------------------------------------- the reference is independent
def test_the_reference_imports_only_stdlib_torch_and_transformers():
    tree = ast.parse(CHECKER.read_text())
    imported = set()
    for node in ast.walk(tree):  # module level and inside functions alike
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add((node.module or "").split(".")[0])
    allowed = set(sys.stdlib_module_names) | {"__future__", "torch", "transformers"}
    assert "torch" in imported and "transformers" in imported
    assert imported <= allowed, f"the reference imports {sorted(imported - allowed)}"
    # nothing the loaded module holds comes from kvmemory
    held = {getattr(v, "__module__", None) or getattr(v, "__name__", "") for v in vars(reference).values()}
    assert not [m for m in held if str(m).split(".")[0] == "kvmemory"]


def test_the_reference_runs_with_no_kvmemory_module_loaded(tmp_path):
    code = f"""
import importlib.util, sys
import torch, transformers
spec = importlib.util.spec_from_file_location("check_attestation", {str(CHECKER)!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
pre, dec, gen = mod.reference_logits(model, list(range(40)), 16, 3)
assert pre.shape == (40, 64) and dec.shape == (2, 64) and len(gen) == 3
print(sorted(m for m in sys.modules if m.split(".")[0] == "kvmemory"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# ---------------------------------------------------------------------- the real embedded model
_TEXT = (
    "A bakery bakes 14 trays of 24 rolls every morning. On Monday it sold 275 rolls, on Tuesday 301 and "
    "on Wednesday every roll but 12. The owner keeps a ledger: flour, yeast, salt and water are bought "
    "weekly, butter twice a week, and the ovens are cleaned each Sunday. A new oven would bake 20 trays "
    "at once but costs as much as four months of rent. The baker's daughter computes how many rolls "
    "were left each day, how many trays the bakery would need to sell 400 rolls a day, and whether the "
    "new oven pays for itself within a year if each roll earns 35 cents. She writes every step down: "
    "14 * 24 = 336 rolls baked each day; 336 - 275 = 61 left on Monday; 336 - 301 = 35 left on Tuesday; "
    "12 left on Wednesday by the owner's count."
)  # 212 tokens: grafts at 64, 128 and 192, then a tail of 20


@pytest.fixture(scope="module")
def stock_engine(tmp_path_factory):
    return Engine.open(store=tmp_path_factory.mktemp("stock") / "store", profile="stock")


def test_stock_profile_is_transformers_own_computation(stock_engine):
    p = stock_engine.profile
    assert (p.attn_implementation, p.linear_impl, p.dtype, p.kv_dtype, p.chunk) == ("sdpa", "aten", "float32",
                                                                                   "float32", 64)
    assert {type(m) for m in stock_engine.model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    assert stock_engine.runner.kv_dtype == torch.float32


def test_stock_profile_refuses_contradicting_options(stock_engine, tmp_path):
    from kvmemory.errors import InvalidInput
    from kvmemory.memory.facade import KVMemory

    for kw, named in (({"kv_dtype": "bfloat16"}, "kv_dtype"), ({"linears": "gguf"}, "linears"),
                      ({"dtype": "bfloat16"}, "dtype"), ({"attn_implementation": "kvmemory_fewq"}, "attn_implementation")):
        with pytest.raises(InvalidInput, match=f"profile='stock'.*{named}="):
            Engine.open(store=tmp_path / "s", profile="stock", **kw)
    with pytest.raises(InvalidInput, match="profile must be one of default, stock"):
        Engine.open(store=tmp_path / "s", profile="fast")
    with pytest.raises(InvalidInput, match="chosen when the engine is opened"):
        KVMemory(stock_engine, profile="stock")
    assert not (tmp_path / "s").exists()  # refused before the store was opened


@pytest.mark.slow
def test_real_model_runner_and_grafts_equal_the_independent_reference(stock_engine):
    from transformers import AutoModelForCausalLM

    eng = stock_engine
    ref_model = AutoModelForCausalLM.from_pretrained(resolve_model_path(), dtype=torch.float32,
                                                     attn_implementation="sdpa")
    reference.in_fresh_memory(ref_model.eval().requires_grad_(False))
    assert ref_model is not eng.model and _same_weights(ref_model, eng.model)
    ids = eng.encode(_TEXT)
    assert 3 * eng.chunk < len(ids) <= 4 * eng.chunk, len(ids)  # three graft points, then a tail
    _check_against_reference(eng, ref_model, ids, [64, 128, 192], decode=6)


# ---------------------------------------------------------------------- the architecture matrix
def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stock_attention(arch: str) -> str:
    # transformers' own implementations; Gemma2's softcapped attention has no sdpa path there, it runs eager
    return "eager" if arch == "gemma2" else "sdpa"


def _transformers_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model built by transformers alone (same config and seed as tiny_models.tiny_model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = _stock_attention(arch)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32, attn_implementation=attn)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("arch", ARCHS)
def test_matrix_runner_and_grafts_equal_the_independent_reference(arch, tmp_path):
    model = tiny_model(arch, attn=_stock_attention(arch), pack=False)  # the stock profile: nothing replaced
    eng = Engine(LoadedModel(model, IdTokenizer(), f"tiny-{arch}", f"tiny-{arch}"), LocalStore(tmp_path / "s"),
                 chunk=16, kv_dtype="float32")
    p = eng.profile
    assert (p.attn_implementation, p.linear_impl, p.kv_dtype) == (_stock_attention(arch), "aten", "float32")
    ref_model = _transformers_model(arch)
    assert ref_model is not model and _same_weights(ref_model, model)
    # 130 tokens on a grid of 16 (sliding windows of 40 are crossed); grafts at 1, 3, 6 and 8 blocks
    _check_against_reference(eng, ref_model, _ids(130), [16, 48, 96, 128], decode=6)


def test_the_comparison_tells_another_profile_apart(tmp_path):
    """Control: the default profile (kvmemory's attention, packed linears, bfloat16 K/V) is not the
    stock computation, and the byte comparison says so."""
    model = tiny_model("llama")  # as loading does on the CPU: kvmemory's attention, packed linears
    eng = Engine(LoadedModel(model, IdTokenizer(), "tiny-llama", "tiny-llama"), LocalStore(tmp_path / "s"),
                 chunk=16, kv_dtype="auto")
    assert eng.profile.kv_dtype == "bfloat16" and eng.profile.attn_implementation.startswith("kvmemory_")
    ids = _ids(130)
    with reference.pinned_settings(eng.profile.to_dict()):
        pre, _, _ = reference.reference_logits(_transformers_model("llama"), ids, eng.chunk, 0)
    got = eng.recompute(ids)
    assert not _bytes_equal(got.prefill_logits, pre)
    assert float((got.prefill_logits - pre).abs().max()) < 1.0  # the same model, in other last bits


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_grafts_at_cuts_equal_the_independent_reference(arch, tmp_path):
    """A prompt cut off the grid (an entry of 37 tokens, then a question: memory/layout.py): the runner
    and a graft that reads the cut's tail block equal the reference loop cut at the same place."""
    model = tiny_model(arch, attn=_stock_attention(arch), pack=False)
    eng = Engine(LoadedModel(model, IdTokenizer(), f"tiny-{arch}", f"tiny-{arch}"), LocalStore(tmp_path / "s"),
                 chunk=16, kv_dtype="float32")
    ref_model = _transformers_model(arch)
    ids, cuts, decode = _ids(70, seed=3), (37,), 5
    with reference.pinned_settings(eng.profile.to_dict()):
        pre, dec, gen = reference.reference_logits(ref_model, ids, eng.chunk, decode, cuts=cuts)
        plain, _, _ = reference.reference_logits(ref_model, ids, eng.chunk, decode)
    assert not _bytes_equal(pre, plain), "a cut changes the chunking, so the logits' bytes (the check has teeth)"
    got = eng.recompute(ids, max_new_tokens=decode, cuts=cuts)
    assert got.generated == gen and _bytes_equal(got.prefill_logits, pre) and _bytes_equal(got.decode_logits, dec)
    _, blocks = eng.compute_blocks(ids, cuts=cuts, upto=37)
    assert [m.n_tokens for m, _ in blocks] == [16, 16, 5]  # two grid blocks and the tail block at the cut
    eng.store.put_blocks(blocks)
    res, rep = eng.forward(ids, max_new_tokens=decode, stop_token_ids=(), keep_logits=True, cuts=cuts)
    assert rep.tokens_grafted == 37 and rep.fallback is None, rep
    assert res.generated == gen
    assert _bytes_equal(res.prefill_logits, pre[37:]) and _bytes_equal(res.decode_logits, dec)
