"""The pipelined graft and the verified-once tier through the Engine (engine/pipeline.py, tier.py).

On the CPU: grafts through the tier equal grafts from the files and the recompute, byte for byte; a
damaged block in the middle of a chain is quarantined, nothing from it or after it is copied (in the
GPU's chain order, which runs here through the graft op's twin) and the answer stays exact; the tier
keeps only verified blocks before the cut, drops what the store quarantines or forgets, evicts within
its budget, and bounds the reads in flight. The same on a GPU in the tests marked `gpu`.
"""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest
import torch

from kvmemory.engine import graft, pipeline
from kvmemory.engine.tier import VerifiedTier
from kvmemory.errors import IntegrityError
from kvmemory.kernels import sha256_lanes

from tiny_models import tiny_engine

C = 16  # the tiny engines' grid


@pytest.fixture(params=["readers", "ordered"])
def mode(request, monkeypatch):
    """'readers': the CPU's own flow (readers copy what they verified); 'ordered': the GPU's (the
    caller copies each unit in chain order through the graft op)."""
    monkeypatch.setattr(pipeline, "CPU_READERS_COPY", request.param == "readers")
    return request.param


def _engine(tmp_path, monkeypatch, arch="llama", dtype=torch.float32, blocks=40, budget=1 << 30, seed=0,
            pinned=True, first_sight=True):
    """A tiny engine (two reader threads) whose store holds a chain of `blocks` blocks, the prompt
    (the chain + 9 tokens) and the chain's catalogue rows. `first_sight`: the tier admits a chain at
    its first graft, as on a GPU (the CPU's own default waits for the second: tested below)."""
    monkeypatch.setattr(pipeline, "READERS", 2)
    eng = tiny_engine(arch, tmp_path / f"s{seed}", dtype)
    eng.tier.set_budget(budget)
    eng.tier.first_sight = first_sight
    ids = torch.randint(0, 512, (blocks * C + 9,), generator=torch.Generator().manual_seed(seed)).tolist()
    eng.store_prefix(ids[: blocks * C], pinned=pinned)
    return eng, ids, graft.plan_chain(eng.store, eng.profile_id, ids, C)


def _exact(eng, ids, new_tokens=2, ref=None):
    """Graft `ids`, recompute them, and require every logit after the graft point byte-equal."""
    got, rep = eng.forward(ids, max_new_tokens=new_tokens, stop_token_ids=(), keep_logits=True)
    ref = ref or eng.recompute(ids, max_new_tokens=new_tokens, stop_token_ids=())
    assert torch.equal(got.prefill_logits, ref.prefill_logits[rep.tokens_grafted :])
    assert torch.equal(got.decode_logits, ref.decode_logits)
    assert got.generated == ref.generated
    return rep, ref


def _launches(monkeypatch) -> list[list[int]]:
    """Spy on the copies the caller launches: the chain positions of each call's blocks."""
    seen: list[list[int]] = []
    real = pipeline._launch

    def spy(good, dst, device, copy):
        seen.append([m.position // C for _, _, m in good])
        return real(good, dst, device, copy)

    monkeypatch.setattr(pipeline, "_launch", spy)
    return seen


def _reads(store, monkeypatch) -> list[int]:
    """Spy on the store's reads: how many blocks each read call asked for."""
    calls: list[int] = []
    for name in ("read_blocks_lanes", "read_block"):
        real = getattr(store, name)

        def spy(rows, *a, _real=real, **k):
            calls.append(len(rows) if isinstance(rows, list) else 1)
            return _real(rows, *a, **k)

        monkeypatch.setattr(store, name, spy)
    return calls


def _flip(store, row, offset: int, bit: int) -> None:
    path = store.block_path(row.hash)
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graft_through_the_tier_equals_the_graft_from_files(tmp_path, monkeypatch, mode, arch, dtype):
    """First graft: every block read, verified and admitted; second: every block from the tier, no read.
    Both equal the recompute byte for byte (sliding-window layers included: mistral, gemma3)."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, arch, dtype, blocks=12)
    reads = _reads(eng.store, monkeypatch)
    rep, ref = _exact(eng, ids)
    assert rep.tokens_grafted == 12 * C and rep.blocks_from_tier == 0 and reads
    assert all(r.hash in eng.tier for r in rows)
    reads.clear()
    rep2, _ = _exact(eng, ids, ref=ref)
    assert rep2.tokens_grafted == 12 * C and rep2.blocks_from_tier == 12 and reads == []
    assert rep2.bytes_read == rep.bytes_read


def test_with_no_budget_the_cpu_reads_straight_into_the_cache(tmp_path, monkeypatch):
    """The CPU's default (no KVMEMORY_TIER_BYTES): no tier, the direct read of graft.load_chain."""
    monkeypatch.delenv("KVMEMORY_TIER_BYTES", raising=False)
    assert tiny_engine("llama", tmp_path / "default").tier.budget == 0
    eng, ids, _ = _engine(tmp_path, monkeypatch, blocks=4, budget=0)
    called = []
    monkeypatch.setattr(pipeline, "load_pipelined", lambda *a, **k: called.append(1))
    rep, _ = _exact(eng, ids)
    assert called == [] and rep.blocks_from_tier == 0 and len(eng.tier) == 0


def test_on_the_cpu_a_chain_enters_the_tier_at_its_second_graft(tmp_path, monkeypatch):
    """A chain grafted once is read straight into the cache (no tier, no extra copy); grafted again it
    goes through the pipeline and is admitted; from the third graft on it comes from the tier."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, blocks=6, first_sight=False)
    assert eng.tier.where == "cpu" and not eng.tier.first_sight
    calls = []
    real = pipeline.load_pipelined
    monkeypatch.setattr(pipeline, "load_pipelined", lambda *a, **k: calls.append(1) or real(*a, **k))
    rep, ref = _exact(eng, ids)
    assert calls == [] and len(eng.tier) == 0
    rep, _ = _exact(eng, ids, ref=ref)
    assert calls == [1] and rep.blocks_from_tier == 0 and len(eng.tier) == 6
    rep, _ = _exact(eng, ids, ref=ref)
    assert calls == [1, 1] and rep.blocks_from_tier == 6


def test_a_damaged_block_mid_chain_cuts_the_chain(tmp_path, monkeypatch, mode):
    """A bit flipped in block 25 of 40: it is quarantined, nothing from it or after it is copied (in the
    GPU's order), the logits equal the recompute's; the tier keeps blocks 0-24 only, and the next graft
    takes those 25 from it without reading a file."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=4)
    _flip(eng.store, rows[25], -1000, 0x10)
    launched = _launches(monkeypatch)
    rep, ref = _exact(eng, ids)
    assert rep.quarantined == [rows[25].hash] and rep.tokens_grafted == 25 * C
    assert "quarantined" in rep.fallback and eng.store.get_block(rows[25].hash).quarantined
    if mode == "ordered":
        assert launched and max(max(x) for x in launched) == 24
        assert sorted(i for x in launched for i in x) == list(range(25))  # each verified block once
    assert [r.hash in eng.tier for r in rows] == [True] * 25 + [False] * 15
    reads = _reads(eng.store, monkeypatch)
    rep2, _ = _exact(eng, ids, ref=ref)
    assert rep2.tokens_grafted == 25 * C and rep2.blocks_from_tier == 25 and reads == []


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_damaged_first_block_grafts_nothing(tmp_path, monkeypatch, mode, where):
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=6)
    _flip(eng.store, rows[0], 20 if where == "header" else -10, 0x01)
    launched = _launches(monkeypatch)
    rep, _ = _exact(eng, ids)
    assert rep.quarantined == [rows[0].hash] and rep.tokens_grafted == 0
    assert launched == [] and len(eng.tier) == 0


def test_a_block_claiming_another_position_is_refused_before_any_copy(tmp_path, monkeypatch, mode):
    """A crafted store whose block 30 says (header and row alike) it sits far away: refused by the
    pipeline's position check, the chain cut before it, nothing of it copied or kept."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=8)
    real = eng.store.read_blocks_lanes

    def far(rows_, place):
        out = real(rows_, place)
        return [dataclasses.replace(m, index=10**6, position=10**6 * C)
                if not isinstance(m, Exception) and m.hash == rows[30].hash else m for m in out]

    monkeypatch.setattr(eng.store, "read_blocks_lanes", far)
    launched = _launches(monkeypatch)
    rep, _ = _exact(eng, ids)
    assert rep.tokens_grafted == 30 * C and rep.quarantined == [] and "refused" in rep.fallback
    if mode == "ordered":
        assert max(max(x) for x in launched) == 29
    assert rows[30].hash not in eng.tier and rows[29].hash in eng.tier


def test_hits_and_reads_interleave_in_chain_order(tmp_path, monkeypatch, mode):
    """The tier holds blocks 0-9 and 20-39: the graft copies those from it and reads 10-19, exactly."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=9)
    _, ref = _exact(eng, ids)
    eng.tier.drop([r.hash for r in rows[10:20]])
    reads = _reads(eng.store, monkeypatch)
    launched = _launches(monkeypatch)
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 40 * C and rep.blocks_from_tier == 30 and sum(reads) == 10
    if mode == "ordered":
        order = [i for x in launched for i in x]
        assert order == list(range(40))


def test_quarantine_and_forget_drop_blocks_from_the_tier(tmp_path, monkeypatch):
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=10, pinned=False)
    _, ref = _exact(eng, ids)
    assert len(eng.tier) == 40
    eng.store.quarantine(rows[10].hash, "test: set aside")  # as fsck or a failed read would
    assert rows[10].hash not in eng.tier and len(eng.tier) == 39
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 10 * C and rep.blocks_from_tier == 10
    eng.store.delete_entries([])  # forgets every loose, unpinned block (the chain's)
    assert len(eng.tier) == 0
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 0


def test_a_quarantine_by_another_process_is_respected(tmp_path, monkeypatch):
    """Another process marks block 10 quarantined (no notice reaches this one): the tier still holds
    its bytes, but the plan no longer returns its row, so it is not served."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=11)
    _, ref = _exact(eng, ids)
    with sqlite3.connect(eng.store.path / "catalogue.sqlite") as db:
        db.execute("UPDATE blocks SET quarantined=1 WHERE hash=?", (rows[10].hash,))
    assert rows[10].hash in eng.tier
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 10 * C and rep.blocks_from_tier == 10


def test_a_damaged_file_of_a_held_block_is_not_read_and_fsck_still_sets_it_aside(tmp_path, monkeypatch):
    """The tier serves the bytes it verified against the catalogue row; a file damaged afterwards is
    not read (the row is unchanged), and once it is quarantined the tier drops the block."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=12)
    _, ref = _exact(eng, ids)
    _flip(eng.store, rows[5], -7, 0x80)
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 40 * C and rep.blocks_from_tier == 40
    from kvmemory.store.fsck import run_fsck

    run_fsck(eng.store, repair=True)
    assert rows[5].hash not in eng.tier
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 5 * C


def test_eviction_between_chains(tmp_path, monkeypatch):
    """A budget of one chain: grafting chain B evicts chain A, which is then read again."""
    eng, ids_a, rows_a = _engine(tmp_path, monkeypatch, blocks=8, seed=13)
    eng.tier.set_budget(8 * rows_a[0].payload_nbytes)
    ids_b = torch.randint(0, 512, (8 * C + 5,), generator=torch.Generator().manual_seed(99)).tolist()
    eng.store_prefix(ids_b[: 8 * C])
    _, ref_a = _exact(eng, ids_a)
    _, ref_b = _exact(eng, ids_b)
    assert all(r.hash not in eng.tier for r in rows_a) and eng.tier.stats.evicted == 8
    rep, _ = _exact(eng, ids_a, ref=ref_a)
    assert rep.blocks_from_tier == 0 and rep.tokens_grafted == 8 * C
    rep, _ = _exact(eng, ids_a, ref=ref_a)
    assert rep.blocks_from_tier == 8


def test_a_chain_larger_than_the_budget_keeps_its_first_blocks(tmp_path, monkeypatch, mode):
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=14)
    eng.tier.set_budget(10 * rows[0].payload_nbytes)
    _, ref = _exact(eng, ids)
    assert [r.hash in eng.tier for r in rows] == [True] * 10 + [False] * 30
    for _ in range(2):
        rep, _ = _exact(eng, ids, ref=ref)
        assert rep.blocks_from_tier == 10 and rep.tokens_grafted == 40 * C


def test_reads_in_flight_are_bounded(tmp_path, monkeypatch, mode):
    """With no budget, one reader and a ring of one group, the arena never holds more slots than one
    group needs (its first chunk): reads wait for the copies instead of staging the whole chain."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=15)
    monkeypatch.setattr(pipeline, "READERS", 1)
    monkeypatch.setattr(pipeline, "RING_PER_READER", 1)
    tier = VerifiedTier(0)
    chain = pipeline.load_pipelined(eng.store, rows, graft.GraftReport(), eng.runner, len(ids) + 4, None, tier)
    assert len(chain.metas) == 40 and len(tier) == 0
    arena = tier._arenas[rows[0].payload_nbytes]
    assert arena.slots <= 16 < 40 and len(arena.free) == arena.slots  # every slot back


class _PlainStore:
    """A store offering only what every store offers (read_block, no header-only read, no lanes), as
    the Redis store does."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name in ("block_meta", "read_blocks_lanes"):
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("damaged", [None, 0, 7])
def test_a_store_without_header_reads_or_lanes(tmp_path, monkeypatch, mode, damaged):
    """Block 0 is read alone first (its header shapes the cache), the rest one by one with hashlib."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, blocks=12, seed=16)
    if damaged is not None:
        _flip(eng.store, rows[damaged], -3, 0x02)
    eng.store = _PlainStore(eng.store)
    rep, ref = _exact(eng, ids)
    want = 12 if damaged is None else damaged
    assert rep.tokens_grafted == want * C and len(eng.tier) == want
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.blocks_from_tier == want


def test_the_redis_store_grafts_through_the_tier_and_its_drops_reach_it(tmp_path, monkeypatch):
    """A real redis-server: a store with neither header-only reads nor the lanes reader. Grafts through
    the tier are exact; its quarantine drops the block from the tier."""
    from redis_server import RedisServer
    from tiny_models import IdTokenizer, tiny_model

    from kvmemory.engine.engine import Engine
    from kvmemory.models.loading import LoadedModel
    from kvmemory.store.redis_store import RedisStore

    monkeypatch.setattr(pipeline, "READERS", 2)
    with RedisServer() as srv:
        st = RedisStore(srv.url, store="pipe", path=tmp_path / "tier", signer="5f" * 32)
        try:
            eng = Engine(LoadedModel(tiny_model("llama"), IdTokenizer(), "tiny-llama", "tiny-llama"), st, chunk=C)
            eng.tier.set_budget(1 << 30)
            eng.tier.first_sight = True
            ids = torch.randint(0, 512, (12 * C + 5,), generator=torch.Generator().manual_seed(21)).tolist()
            eng.store_prefix(ids[: 12 * C])
            rows = graft.plan_chain(st, eng.profile_id, ids, C)
            assert not hasattr(st, "block_meta") and not hasattr(st, "read_blocks_lanes")
            rep, ref = _exact(eng, ids)
            assert rep.tokens_grafted == 12 * C and len(eng.tier) == 12
            rep, _ = _exact(eng, ids, ref=ref)
            assert rep.blocks_from_tier == 12
            st.quarantine(rows[5].hash, "test: set aside")
            assert rows[5].hash not in eng.tier
            rep, _ = _exact(eng, ids, ref=ref)
            assert rep.tokens_grafted == 5 * C and rep.blocks_from_tier == 5
        finally:
            st.close()


def test_an_io_error_leaves_no_slot_leased(tmp_path, monkeypatch):
    """A read that raises (not a verification failure: an I/O error) propagates, after the reads in
    flight finished and every slot went back."""
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=17)
    real = eng.store.read_blocks_lanes
    calls = []

    def failing(rows_, place):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk on fire")
        return real(rows_, place)

    monkeypatch.setattr(eng.store, "read_blocks_lanes", failing)
    with pytest.raises(OSError, match="disk on fire"):
        eng.forward(ids, max_new_tokens=1, stop_token_ids=())
    arena = eng.tier._arenas[rows[0].payload_nbytes]
    leased = arena.slots - len(arena.free) - len(eng.tier)
    assert leased == 0


def test_plan_groups():
    run = list(range(100, 140))
    assert pipeline.plan_groups(run, 2, "avx512") == [run[:14], run[14:28], run[28:]]
    g = pipeline.plan_groups(run, 16, "avx512")  # 16 groups would be too small: 4 of 10
    assert [len(x) for x in g] == [10, 10, 10, 10] and sum(g, []) == run
    assert pipeline.plan_groups(run[:5], 16, "avx512") == [[i] for i in run[:5]]  # hashlib, a block each
    g = pipeline.plan_groups(run, 2, "sha-ni")  # rounds: ceil(40 / (2 * WAVES)) = 5 blocks a group
    assert [len(x) for x in g] == [5] * 8 and sum(g, []) == run
    assert pipeline.plan_groups(run, 2, None) == [[i] for i in run]
    assert pipeline.plan_groups([], 4, "avx512") == []


def test_segment_bytes():
    assert pipeline.segment_bytes(8 << 20) == 64 << 10
    assert pipeline.segment_bytes(1_474_560) == 32 << 10  # SmolLM2's bf16 block
    assert pipeline.segment_bytes(1000) is None and pipeline.segment_bytes(0) is None
    for n in (64, 192, 4096 * 3, 1_474_560, 8 << 20):
        s = pipeline.segment_bytes(n)
        assert n % s == 0 and s % 64 == 0 and s <= pipeline.SEG_MAX


def test_without_the_lanes_library_blocks_are_read_with_hashlib(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(sha256_lanes, "load", lambda: None)
    eng, ids, rows = _engine(tmp_path, monkeypatch, seed=18)
    reads = _reads(eng.store, monkeypatch)
    rep, _ = _exact(eng, ids)
    assert rep.tokens_grafted == 40 * C and reads == [1] * 40


def test_the_embedded_model_grafts_through_the_tier_exactly(smollm, tmp_path):
    """SmolLM2 (the default profile: bfloat16 K/V, its kernels), a CPU tier asked for: five blocks grafted
    straight from the files, then through the pipeline (admitted at the second graft), then from the
    tier, each equal to the recompute byte for byte."""
    from kvmemory.engine.engine import Engine
    from kvmemory.store.local import LocalStore

    eng = Engine(smollm, LocalStore(tmp_path / "store"))
    eng.tier.set_budget(1 << 30)
    ids = eng.encode("The verified-once tier keeps payloads it hashed. " * 40)[: 5 * 64 + 7]
    eng.store_prefix(ids[: 5 * 64])
    rep, ref = _exact(eng, ids)
    assert rep.tokens_grafted == 320 and rep.blocks_from_tier == 0 and len(eng.tier) == 0
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 320 and rep.blocks_from_tier == 0 and len(eng.tier) == 5
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.tokens_grafted == 320 and rep.blocks_from_tier == 5


def test_gpu_check_section_dry_run(tmp_path):
    """scripts/gpu_check.py's pipelined_graft section runs on the CPU with tiny shapes (the GPU's copy
    order, through the twin): cold and hot grafts equal, a damaged block cut and quarantined."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gpu_check.py"), "--dry-run", "--quick", "--out",
                           str(out), "--sections", "pipelined_graft", "--tmpdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    sec = json.loads(out.read_text())["sections"]["pipelined_graft"]
    assert proc.returncode == 0 and sec["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sec["all_equal"] and sec["damage"]["grafted_blocks"] == sec["damage"]["block"]
    assert set(sec["results"]) == {"256", "1024"}
    for r in sec["results"].values():
        assert r["cold"]["equal"] and r["hot"]["equal"]


# ---------------------------------------------------------------------------------------------------
# On a GPU (skipped without one): the kernel copies from pinned slots, in chain order, on the stream.

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_engine(tmp_path, arch="llama", dtype=torch.bfloat16, blocks=40, seed=0):
    from kvmemory.engine.engine import Engine
    from kvmemory.models.loading import LoadedModel
    from kvmemory.store.local import LocalStore
    from tiny_models import IdTokenizer, tiny_model

    model = tiny_model(arch, dtype, seed, attn="sdpa", pack=False).cuda()
    eng = Engine(LoadedModel(model, IdTokenizer(), f"tiny-{arch}", f"tiny-{arch}"), LocalStore(tmp_path / "s"),
                 chunk=C)
    ids = torch.randint(0, 512, (blocks * C + 9,), generator=torch.Generator().manual_seed(seed)).tolist()
    eng.store_prefix(ids[: blocks * C])
    return eng, ids, graft.plan_chain(eng.store, eng.profile_id, ids, C)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graft_through_the_pipeline_and_the_tier_is_exact(tmp_path, arch, dtype):
    from kvmemory.kernels import graft_op

    assert graft_op.IMPL == "cuda", graft_op.IMPL_REASON
    eng, ids, rows = _cuda_engine(tmp_path, arch, dtype)
    assert eng.tier.where == "pinned"
    rep, ref = _exact(eng, ids)
    assert rep.tokens_grafted == 40 * C and rep.blocks_from_tier == 0
    held = eng.tier._held[rows[0].hash]
    assert held.slot.chunk.is_pinned()
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.blocks_from_tier == 40


@pytest.mark.gpu
@needs_gpu
def test_gpu_a_damaged_block_mid_chain_is_never_copied(tmp_path, monkeypatch):
    eng, ids, rows = _cuda_engine(tmp_path, seed=4)
    _flip(eng.store, rows[25], -1000, 0x10)
    launched = _launches(monkeypatch)
    rep, ref = _exact(eng, ids)
    assert rep.quarantined == [rows[25].hash] and rep.tokens_grafted == 25 * C
    assert sorted(i for x in launched for i in x) == list(range(25))
    rep, _ = _exact(eng, ids, ref=ref)
    assert rep.blocks_from_tier == 25


@pytest.mark.gpu
@needs_gpu
def test_gpu_slots_are_reused_only_after_their_copy(tmp_path, monkeypatch):
    """With no budget the ring's slots are reused graft after graft: every reuse waited for the copy
    that read the slot (its event), so repeated grafts from a small ring stay exact."""
    monkeypatch.setattr(pipeline, "READERS", 2)
    monkeypatch.setattr(pipeline, "RING_PER_READER", 1)
    eng, ids, rows = _cuda_engine(tmp_path, seed=5)
    eng.tier.set_budget(0)
    _, ref = _exact(eng, ids)
    for _ in range(3):
        rep, _ = _exact(eng, ids, ref=ref)
        assert rep.blocks_from_tier == 0 and rep.tokens_grafted == 40 * C
    arena = eng.tier._arenas[rows[0].payload_nbytes]
    assert arena.slots < 40

