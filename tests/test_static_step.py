"""The static-shape steps (engine/static_step.py): the step modes "static" (run here, on the CPU) and
"cuda-graph" (the same steps captured in CUDA graphs; the GPU-marked tests at the end).

A graft is bit-identical to the recompute under the same step mode, on the architecture matrix; the
static path computes what the dynamic one computes (close, not equal: other shapes); its results do not
depend on the cache's capacity or on what an earlier forward left in it; the mode is part of the profile.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, assert_graft_equals_recompute, tiny_engine

from kvmemory.engine.graft import plan_chain
from kvmemory.engine.static_step import StaticGrid, resolve_step_mode
from kvmemory.errors import InvalidInput, ProfileMismatch

DTYPES = [torch.float32, torch.bfloat16]
CUDA = torch.cuda.is_available()


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_matrix_case(arch, dtype, store_dir, step, device="cpu"):
    eng = tiny_engine(arch, store_dir, dtype, step=step, device=device)
    assert eng.profile.step_mode == step and eng.runner.step_mode == step
    ids = _ids(130)  # 8 whole blocks of C=16 and a 2-token chunk, padded to 16 rows
    assert_graft_equals_recompute(eng, ids, 96, 5)
    vr = eng.verify_tokens(ids, decode_tokens=3, single_pass=False)
    assert vr.bit_identical and vr.comparison.kl_max == 0.0
    # logits="last" (what answers compute): the same rows, the same hash
    got, _ = eng.forward(ids, max_new_tokens=4, stop_token_ids=(), logits="last")
    ref = eng.recompute(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=False, logits="last")
    assert got.logits_sha256 == ref.logits_sha256 and got.generated == ref.generated
    return eng


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_graft_is_bit_identical(arch, dtype, store_dir):
    _check_matrix_case(arch, dtype, store_dir, "static")


@pytest.mark.parametrize("arch", ARCHS)
def test_static_steps_compute_what_the_dynamic_path_computes(arch, tmp_path):
    """Another computation (padded chunks, keys in buckets, sliding windows as masks over every
    position), the same function: float32 logits within rounding of the dynamic path's, the same tokens."""
    ids = _ids(130)
    static = tiny_engine(arch, tmp_path / "a", step="static").recompute(ids, max_new_tokens=6, stop_token_ids=())
    dynamic = tiny_engine(arch, tmp_path / "b", step="dynamic").recompute(ids, max_new_tokens=6, stop_token_ids=())
    assert (static.prefill_logits - dynamic.prefill_logits).abs().max() < 1e-4
    assert (static.decode_logits - dynamic.decode_logits).abs().max() < 1e-4
    assert static.generated == dynamic.generated


def test_bfloat16_kv_under_float32_static(store_dir):
    """The CPU default's narrower K/V (kvmemory's attention widens them) on the static path."""
    eng = tiny_engine("llama", store_dir, torch.float32, kv_dtype="bfloat16", step="static")
    assert_graft_equals_recompute(eng, _ids(90), 80, 4)
    assert eng.runner.kv_dtype == torch.bfloat16 and eng.runner.static.whole.dtype == torch.bfloat16


def test_results_do_not_depend_on_capacity_or_what_an_earlier_forward_left(tmp_path):
    """One engine whose cache grew (and holds another prompt's K/V past every position used below) and a
    fresh one: the same logits, byte for byte; a graft in the grown one equals both."""
    ids = _ids(70, seed=3)
    fresh = tiny_engine("qwen2", tmp_path / "a", step="static")
    ref = fresh.recompute(ids, max_new_tokens=4, stop_token_ids=())
    grown = tiny_engine("qwen2", tmp_path / "b", step="static")
    grown.recompute(_ids(600, seed=4), max_new_tokens=2, stop_token_ids=())
    assert grown.runner.static.capacity >= 608 > fresh.runner.static.capacity
    again = grown.recompute(ids, max_new_tokens=4, stop_token_ids=())
    assert torch.equal(again.prefill_logits, ref.prefill_logits) and torch.equal(again.decode_logits, ref.decode_logits)
    grown.recompute(_ids(600, seed=5), max_new_tokens=2, stop_token_ids=())  # stale K/V everywhere again
    assert_graft_equals_recompute(grown, ids, 64, 4)
    got, _ = grown.forward(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True)
    assert torch.equal(got.decode_logits, ref.decode_logits)
    # every position past the last one that forward wrote (its padded last chunk: 64..79) holds zeros
    static = grown.runner.static
    assert static.dirty == 80 and static.whole[:, :, :, 79].any()
    assert not static.whole[:, :, :, static.dirty:].any()


def test_a_damaged_block_cuts_the_static_graft(store_dir):
    """Blocks read past a quarantined one may have landed in the static cache already: they are zeroed
    before the recompute of those positions reads anything."""
    eng = tiny_engine("llama", store_dir, step="static")
    ids = _ids(90)
    eng.store_prefix(ids[:80])
    hashes = [r.hash for r in plan_chain(eng.store, eng.profile_id, ids, eng.chunk)]
    victim = eng.store.block_path(hashes[2])
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x10
    victim.write_bytes(bytes(data))
    got, report = eng.forward(ids, keep_logits=True, max_new_tokens=3, stop_token_ids=())
    assert report.quarantined == [hashes[2]] and report.tokens_grafted == 32
    ref = eng.recompute(ids, max_new_tokens=3, stop_token_ids=())
    assert torch.equal(got.prefill_logits, ref.prefill_logits[32:]) and torch.equal(got.decode_logits, ref.decode_logits)


def test_choose_scores_alike_grafted_or_not(store_dir):
    eng = tiny_engine("gemma3", store_dir, step="static")
    ids = _ids(75)
    eng.store_prefix(ids[:64])
    choices = [[5, 6, 7], [8], [9, 10]]
    best, scores, rep = eng.choose(ids, choices)
    best2, scores2, rep2 = eng.choose(ids, choices, graft=False)
    assert rep.tokens_grafted == 64 and rep2.tokens_grafted == 0
    assert scores == scores2 and best == best2


def test_step_mode_is_part_of_the_profile(tmp_path):
    static = tiny_engine("llama", tmp_path / "s", step="static")
    dynamic = tiny_engine("llama", tmp_path / "s", step="dynamic")
    assert tiny_engine("llama", tmp_path / "s").runner.step_mode == "dynamic"  # auto on the CPU
    assert static.profile.diff(dynamic.profile) == {"step_mode": ("static", "dynamic")}
    ids = _ids(40)
    static.store_prefix(ids)
    assert plan_chain(dynamic.store, dynamic.profile_id, ids, 16) == []  # the profile is in the chain hash
    with pytest.raises(ProfileMismatch, match="step_mode"):
        dynamic.require_profile(static.profile_id, "these blocks")
    # a profile stored before the field existed ran the dynamic path
    old = dynamic.profile.to_dict()
    old.pop("step_mode")
    assert type(dynamic.profile).from_dict(old) == dynamic.profile


def test_step_modes_are_checked():
    cpu = torch.device("cpu")
    assert resolve_step_mode("auto", cpu) == "dynamic" and resolve_step_mode("static", cpu) == "static"
    assert resolve_step_mode("auto", torch.device("cuda", 0)) == "cuda-graph"
    with pytest.raises(InvalidInput, match="CUDA"):
        resolve_step_mode("cuda-graph", cpu)
    with pytest.raises(InvalidInput, match="step must be"):
        resolve_step_mode("graphs", cpu)


def test_buckets_are_powers_of_two_of_the_grid(store_dir):
    grid: StaticGrid = tiny_engine("llama", store_dir, step="static").runner.static
    assert [grid.bucket_for(e) for e in (1, 16, 17, 32, 33, 100, 512, 1000, 1024)] == \
        [16, 16, 32, 32, 64, 128, 512, 1024, 1024]
    with pytest.raises(InvalidInput):
        grid.bucket_for(grid.limit + 1)


# ---------------------------------------------------------------------------------------------------
# On a GPU (skipped without one): the same on CUDA, eagerly and captured, and captured == eager.

@pytest.mark.parametrize("step", ["static", "cuda-graph"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graft_is_bit_identical(arch, dtype, step, store_dir):
    eng = _check_matrix_case(arch, dtype, store_dir, step, device="cuda")
    if step == "cuda-graph":
        assert eng.runner.static.captures >= 2 and eng.runner.static.fallback is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_captured_steps_equal_eager_static_steps(arch, dtype, tmp_path):
    """Measured, not relied on (two profiles): a graph replays the eager static step's kernels."""
    ids = _ids(130)
    graphs = tiny_engine(arch, tmp_path / "a", dtype, step="cuda-graph", device="cuda")
    eager = tiny_engine(arch, tmp_path / "b", dtype, step="static", device="cuda")
    assert graphs.runner.static.probe_equal is True
    a = graphs.recompute(ids, max_new_tokens=5, stop_token_ids=())
    b = eager.recompute(ids, max_new_tokens=5, stop_token_ids=())
    assert torch.equal(a.prefill_logits, b.prefill_logits) and torch.equal(a.decode_logits, b.decode_logits)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_results_do_not_depend_on_capacity(tmp_path):
    ids = _ids(70, seed=3)
    fresh = tiny_engine("llama", tmp_path / "a", torch.bfloat16, step="cuda-graph", device="cuda")
    grown = tiny_engine("llama", tmp_path / "b", torch.bfloat16, step="cuda-graph", device="cuda")
    grown.recompute(_ids(600, seed=4), max_new_tokens=2, stop_token_ids=())
    a = fresh.recompute(ids, max_new_tokens=4, stop_token_ids=())
    b = grown.recompute(ids, max_new_tokens=4, stop_token_ids=())
    assert torch.equal(a.prefill_logits, b.prefill_logits) and torch.equal(a.decode_logits, b.decode_logits)


# ---------------------------------------------------------------------------------------------------
# The graph bookkeeping, on the CPU: `_capture` replaced by a stand-in whose replay runs the same static
# step eagerly into a kept output (what a graph does, without CUDA), so the probe, the per-(rows, bucket)
# cache of graphs, their output copies, the drop on growth and the failure rules run here.


def _emulated(monkeypatch, fail=lambda kind, bucket: False):
    import kvmemory.engine.runner as runner_mod
    from kvmemory.errors import GraphCaptureError

    real = runner_mod.resolve_step_mode
    monkeypatch.setattr(runner_mod, "resolve_step_mode",
                        lambda req, dev: "cuda-graph" if req in ("auto", "cuda-graph") else real(req, dev))
    captured = []

    def capture(self, kind, bucket):
        if fail(kind, bucket):
            raise GraphCaptureError(f"emulated failure ({kind} rows, {bucket} keys)")
        out = self._forward(kind, bucket).clone()

        class Graph:
            def replay(_):
                out.copy_(self._forward(kind, bucket))

        captured.append((kind, bucket))
        self.captures += 1
        return Graph(), out

    monkeypatch.setattr(StaticGrid, "_capture", capture)
    return captured


def test_emulated_graphs_graft_bit_identical_and_captured_once_per_bucket(monkeypatch, store_dir):
    captured = _emulated(monkeypatch)
    eng = tiny_engine("qwen2", store_dir, step="cuda-graph")
    grid = eng.runner.static
    assert eng.profile.step_mode == "cuda-graph" and grid.probe_equal is True and grid.fallback is None
    assert captured == [(1, 16), (16, 16)]  # the probe: the smallest decode and grid steps
    ids = _ids(130)
    assert_graft_equals_recompute(eng, ids, 96, 5)
    # the cache grew (to 128, then 256 positions: 130 + 5 decoded), dropping the graphs captured over
    # the smaller one each time; now every (rows, bucket) the prompt needs is captured once
    assert grid.capacity == 256
    assert set(grid.graphs) == {(16, 16), (16, 32), (16, 64), (16, 128), (16, 256), (1, 256)}
    assert captured[-len(grid.graphs):] and len(set(captured[-len(grid.graphs):])) == len(grid.graphs)
    before = list(captured)
    # a replay's output is the graph's own tensor: what the runner got was a copy
    static = tiny_engine("qwen2", store_dir, step="static").recompute(ids, max_new_tokens=5, stop_token_ids=())
    again = eng.recompute(ids, max_new_tokens=5, stop_token_ids=())
    assert captured == before  # replayed, not captured again
    assert torch.equal(again.prefill_logits, static.prefill_logits)
    assert torch.equal(again.decode_logits, static.decode_logits)


def test_a_capture_failing_at_open(monkeypatch, store_dir, caplog):
    from kvmemory.errors import GraphCaptureError

    _emulated(monkeypatch, fail=lambda kind, bucket: True)
    with pytest.raises(GraphCaptureError, match="emulated failure"):
        tiny_engine("llama", store_dir, step="cuda-graph")  # asked for: raised, never replaced
    with caplog.at_level("WARNING"):
        eng = tiny_engine("llama", store_dir, step="auto")  # auto: the static steps, once, said and recorded
    assert eng.runner.step_mode == eng.profile.step_mode == "static"
    assert "emulated failure" in eng.runner.static.fallback and "without CUDA graphs" in caplog.text
    assert_graft_equals_recompute(eng, _ids(90), 80, 3)


def test_a_capture_failing_later_raises_and_never_switches(monkeypatch, store_dir):
    from kvmemory.errors import GraphCaptureError

    _emulated(monkeypatch, fail=lambda kind, bucket: bucket > 64)
    eng = tiny_engine("llama", store_dir, step="cuda-graph")
    eng.recompute(_ids(40), max_new_tokens=2)  # buckets up to 64: captured
    with pytest.raises(GraphCaptureError, match="128 keys"):
        eng.recompute(_ids(100), max_new_tokens=2)
    assert eng.runner.step_mode == "cuda-graph" and eng.runner.static.graphs_on
