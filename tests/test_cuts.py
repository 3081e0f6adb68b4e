"""Cuts: prefill chunks that end where a prompt's segment ends (runner.chunk_spans), and tail blocks.

A stored segment shorter than the grid, or one whose last chunk is partial, is kept whole: its last
chunk is computed on its own (a cut at its end) and stored as a tail block; a later prompt that starts
with it and declares the same cut grafts every one of its tokens. Exactness is unchanged: a graft and
a recompute with the same cuts give the same bytes (torch.equal), on the architecture matrix, in both
dtypes and in the static step mode.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, tiny_engine

from kvmemory.engine.engine import graft_point_for
from kvmemory.engine.graft import GraftReport, graft_spans, load_chain, plan_chain
from kvmemory.engine.runner import chunk_spans
from kvmemory.errors import InvalidInput, NotOnGrid
from kvmemory.store.blocks import chain_hashes, span_hashes

DTYPES = [torch.float32, torch.bfloat16]


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _store_segment(eng, ids, cuts):
    """Compute `ids` with `cuts` and store every block that ends on the grid or at a cut."""
    _, blocks = eng.compute_blocks(ids, keep_logits=False, logits="last", cuts=cuts)
    eng.store.put_blocks(blocks)
    return blocks


def _assert_exact(eng, ids, cuts, grafted, new_tokens=4):
    got, rep = eng.forward(ids, max_new_tokens=new_tokens, stop_token_ids=(), keep_logits=True, cuts=cuts)
    ref = eng.recompute(ids, max_new_tokens=new_tokens, stop_token_ids=(), cuts=cuts)
    assert rep.tokens_grafted == grafted and rep.fallback is None
    assert torch.equal(got.prefill_logits, ref.prefill_logits[grafted:])
    assert torch.equal(got.decode_logits, ref.decode_logits)
    assert got.generated == ref.generated
    return got, ref


def test_chunk_spans_with_cuts():
    assert chunk_spans(0, 40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert chunk_spans(0, 40, 16, [10]) == [(0, 10), (10, 16), (16, 32), (32, 40)]
    assert chunk_spans(0, 40, 16, [10, 37, 16, 99, 0]) == [(0, 10), (10, 16), (16, 32), (32, 37), (37, 40)]
    assert chunk_spans(10, 40, 16, [10, 20]) == [(10, 16), (16, 20), (20, 32), (32, 40)]
    assert graft_spans(37, 16, [37]) == [(0, 16), (16, 32)]  # never the last token
    assert graft_spans(38, 16, [37]) == [(0, 16), (16, 32), (32, 37)]
    assert graft_point_for(38, 16, [37]) == 37 and graft_point_for(38, 16) == 32 and graft_point_for(10, 16, [5]) == 5


def test_span_hashes_agree_with_chain_hashes():
    pid = "ab" * 32
    ids = _ids(100)
    full = chain_hashes(pid, ids, 16)
    assert span_hashes(pid, ids, [(s, s + 16) for s in range(0, 96, 16)]) == full
    with_tail = chain_hashes(pid, ids, 16, tail=True)
    assert with_tail[:-1] == full and with_tail[-1] == span_hashes(pid, ids, chunk_spans(0, 100, 16))[-1]
    assert chain_hashes(pid, ids[:96], 16, tail=True) == full  # no partial chunk: nothing more
    # chunks cut elsewhere are other chunks: other hashes, from the cut on
    cut = span_hashes(pid, ids, chunk_spans(0, 48, 16, [10]))
    assert not set(cut) & set(full)
    with pytest.raises(ValueError):
        span_hashes(pid, ids, [(0, 16), (20, 32)])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tail_block_grafts_bit_identical(arch, dtype, store_dir):
    """A 37-token segment at C=16: 2 whole blocks and a 5-token tail block; a prompt that starts with it
    and cuts there grafts all 37 tokens, and its logits equal the recompute's with the same cut."""
    eng = tiny_engine(arch, store_dir, dtype)
    ids = _ids(90)
    blocks = _store_segment(eng, ids[:37], [37])
    assert [m.n_tokens for m, _ in blocks] == [16, 16, 5] and [m.position for m, _ in blocks] == [0, 16, 32]
    _assert_exact(eng, ids, [37], 37)
    vr = eng.verify_tokens(ids, decode_tokens=3, cuts=[37], single_pass=False)
    assert vr.bit_identical and vr.graft_point == 37 and vr.attestation["cuts"] == [37]
    # Without the cut the chunk [32, 48) is computed whole: the tail block is not that chunk, so only the
    # whole blocks are grafted, and the result is the uncut recompute's.
    _assert_exact(eng, ids, (), 32)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_segment_shorter_than_the_grid(arch, store_dir):
    """An entry of 10 tokens (less than C = 16) is one tail block at position 0, and is grafted whole."""
    eng = tiny_engine(arch, store_dir)
    ids = _ids(40, seed=3)
    blocks = _store_segment(eng, ids[:10], [10])
    assert [(m.position, m.n_tokens, m.parent) for m, _ in blocks] == [(0, 10, None)]
    _assert_exact(eng, ids, [10], 10)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_several_segments(arch, store_dir):
    """Two segments (ends at 10 and 40) before a question: chunks [0,10) [10,16) [16,32) [32,40), all
    stored, all grafted."""
    eng = tiny_engine(arch, store_dir)
    ids = _ids(70, seed=4)
    blocks = _store_segment(eng, ids[:40], [10, 40])
    assert [(m.position, m.n_tokens) for m, _ in blocks] == [(0, 10), (10, 6), (16, 16), (32, 8)]
    _assert_exact(eng, ids, [10, 40], 40)
    _assert_exact(eng, ids, [10], 32)  # the cut at 40 not declared: the chunk [32, 48) is computed whole


def test_turns_store_their_tails(store_dir):
    """A chat: turn 1's forward (cut at its own end) stores its chunks, its tail included; turn 2, which
    starts with turn 1's prompt and cuts there, grafts all of it."""
    eng = tiny_engine("llama", store_dir)
    ids = _ids(90, seed=5)
    _, rep1 = eng.forward(ids[:50], max_new_tokens=2, store_new_blocks=True, cuts=[50])
    assert rep1.tokens_grafted == 0 and rep1.blocks_stored == 4  # [0,16) [16,32) [32,48) [48,50)
    _assert_exact(eng, ids, [50], 50)
    assert eng.stored_prefix_tokens(ids, [50]) == 50 and eng.stored_prefix_tokens(ids) == 48


def test_static_steps_with_cuts(store_dir):
    """The static step mode (padded chunks; CUDA graphs on a GPU) computes a chunk that starts at a cut
    padded to C rows: a graft and a recompute there agree too."""
    eng = tiny_engine("llama", store_dir, step="static")
    assert eng.runner.step_mode == "static"
    ids = _ids(90, seed=6)
    _store_segment(eng, ids[:37], [37])
    _assert_exact(eng, ids, [37], 37)
    _store_segment(eng, ids[:10], [10])
    _assert_exact(eng, ids, [10], 10)


def test_tail_block_off_its_cut_is_refused(store_dir):
    eng = tiny_engine("llama", store_dir)
    ids = _ids(60, seed=7)
    _store_segment(eng, ids[:37], [37])
    rows = plan_chain(eng.store, eng.profile_id, ids, eng.chunk, [37])
    assert [r.n_tokens for r in rows] == [16, 16, 5]
    report = GraftReport()
    chain = load_chain(eng.store, rows, report)
    with pytest.raises(NotOnGrid):
        eng.graft_chain(ids, chain, report)  # the prompt declares no cut at 37: [32, 37) is not its chunk
    with pytest.raises(NotOnGrid):
        eng.graft_chain(ids, chain, report, cuts=[36])
    assert eng.graft_chain(ids, chain, report, cuts=[37])[1] == 37


def test_damaged_tail_block_is_quarantined(store_dir):
    """A damaged tail block is quarantined, the whole blocks before it are grafted, and the answer stays
    the recompute's."""
    eng = tiny_engine("llama", store_dir)
    ids = _ids(60, seed=8)
    blocks = _store_segment(eng, ids[:37], [37])
    tail = blocks[-1][0]
    path = eng.store.block_path(tail.hash)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    got, rep = eng.forward(ids, max_new_tokens=3, stop_token_ids=(), keep_logits=True, cuts=[37])
    ref = eng.recompute(ids, max_new_tokens=3, stop_token_ids=(), cuts=[37])
    assert rep.tokens_grafted == 32 and rep.quarantined == [tail.hash]
    assert torch.equal(got.prefill_logits, ref.prefill_logits[32:]) and got.generated == ref.generated


def test_bad_cuts_are_refused(store_dir):
    eng = tiny_engine("llama", store_dir)
    ids = _ids(40)
    for bad in ([0], [-3], ["x"], [1.5], [True]):
        with pytest.raises(InvalidInput):
            eng.forward(ids, cuts=bad)
    with pytest.raises(InvalidInput):  # a prefill starts on the grid or at a cut
        eng.runner.forward(ids, start=10, cache=eng.runner.new_cache(40))


def test_graft_and_recompute_run_the_chunks_of_their_cuts(store_dir, monkeypatch):
    """What the runner computes, step by step: a recompute with cuts runs chunk_spans' chunks, and a
    graft at a cut runs exactly the recompute's chunks after it (the shapes every kernel sees)."""
    eng = tiny_engine("llama", store_dir)
    ids = _ids(50, seed=9)
    _store_segment(eng, ids[:37], [37])
    steps: list[tuple[int, int]] = []
    step = eng.runner._step
    monkeypatch.setattr(eng.runner, "_step", lambda x, start, cache, rows=None: (
        steps.append((start, int(x.shape[1]))), step(x, start, cache, rows))[1])
    eng.recompute(ids, max_new_tokens=2, stop_token_ids=(), cuts=[10, 37])
    assert steps == [(0, 10), (10, 6), (16, 16), (32, 5), (37, 11), (48, 2), (50, 1)]
    steps.clear()
    eng.recompute(ids, max_new_tokens=2, stop_token_ids=(), cuts=[37])
    full = list(steps)
    steps.clear()
    _, rep = eng.forward(ids, max_new_tokens=2, stop_token_ids=(), cuts=[37])
    assert rep.tokens_grafted == 37 and steps == [s for s in full if s[0] >= 37] == [(37, 11), (48, 2), (50, 1)]
