"""Issue 41, item 3: short memories are grafted, whole.

An entry's last chunk, partial, is a tail block (its end is a cut: memory/layout.py, engine/runner.py), so
an entry shorter than the grid C = 64 is grafted whole instead of not at all, and a longer one is grafted to
its last token instead of to its last multiple of 64. On the embedded model, through the public API: the
grafted share of every entry, the answers' logits against a recompute with the same cuts, and `verify`.
"""

from __future__ import annotations

import pytest
import torch

from kvmemory.engine.engine import graft_point_for
from kvmemory.memory.layout import entry_probe

FACTS = [  # (problem, solution): notes of several lengths, the shortest well under one block
    ("Alice's pet?", "A cat."),
    ("Which tea does Alice like?", "Alice likes green tea, no sugar."),
    ("When is the team meeting?", "The team meets every Tuesday at 10 am in room 4B, and the agenda is sent "
     "the evening before."),
    ("What is the capital of Australia?", "Canberra is the capital of Australia. It was chosen as a compromise "
     "between Sydney and Melbourne and became the seat of government in 1927, when Parliament moved there from "
     "Melbourne. It lies in the Australian Capital Territory."),
]


@pytest.fixture
def noted(real_memory):
    mem = real_memory
    entries = [mem.remember(p, s, verifier="none", allow_unverified=True) for p, s in FACTS]
    return mem, entries


def test_every_entry_is_grafted_whole(noted):
    mem, entries = noted
    C = mem.engine.chunk
    lengths = [len(e.token_ids) for e in entries]
    assert min(lengths) < C < max(lengths)  # shorter and longer than a block: both cases are here
    for e in entries:
        # its chain: every chunk of its ids, the last one cut at its end
        assert [mem.store.get_block(h).n_tokens for h in e.chain] == [C] * (len(e.token_ids) // C) + (
            [len(e.token_ids) % C] if len(e.token_ids) % C else [])
        ans = mem.ask(e.id, "Say it again, briefly.", max_new_tokens=6)
        assert ans.report.tokens_grafted == len(e.token_ids)  # 100 % of the entry's tokens
        assert ans.report.fallback is None and ans.entries == [e.id]


def test_grafted_answers_equal_a_recompute_with_the_same_cuts(noted):
    mem, entries = noted
    eng = mem.engine
    for e in entries[:2]:
        prompt = mem.question_layout("Say it again, briefly.", [e])
        assert prompt.cuts == (len(e.token_ids),)
        got, rep = eng.forward(prompt.ids, max_new_tokens=5, stop_token_ids=(), keep_logits=True, cuts=prompt.cuts)
        ref = eng.recompute(prompt.ids, max_new_tokens=5, stop_token_ids=(), cuts=prompt.cuts)
        g = rep.tokens_grafted
        assert g == len(e.token_ids)
        assert torch.equal(got.prefill_logits, ref.prefill_logits[g:])
        assert torch.equal(got.decode_logits, ref.decode_logits) and got.generated == ref.generated


def test_verify_proves_every_entry_at_its_end(noted):
    mem, entries = noted
    summary = mem.verify()
    assert summary.checked == summary.bit_identical == summary.attested_match == len(entries)
    for e, r in zip(entries, summary.results):
        assert r["graft_point"] == len(e.token_ids) > 0  # grafted whole, not from position 0
    # the attestation names the layout it proved: the entry, then the probe question, cut at the entry's end
    e = entries[0]
    probe = entry_probe(mem.engine.tokenizer, e.token_ids, e.problem, e.solution, e.answer)
    assert e.attestation["token_ids"] == probe.ids and e.attestation["cuts"] == [len(e.token_ids)]


def test_two_entries_are_both_grafted_the_second_time(real_memory):
    """Two routed entries: the first one's chain is grafted and the second computed and stored (block
    policy "multi"), up to its own end; asked again, both are grafted."""
    mem = real_memory
    a = mem.remember("Alice's pet?", "A cat.", verifier="none", allow_unverified=True)
    b = mem.remember("Bob's pet?", "A dog.", verifier="none", allow_unverified=True)
    hits = mem.recall("Alice's pet?", k=1) + mem.recall("Bob's pet?", k=1)
    assert [h.entry.id for h in hits] == [a.id, b.id]
    first = mem.answer_from("Which pets do they have?", hits, max_new_tokens=4)
    assert first.report.tokens_grafted == len(a.token_ids) and first.report.blocks_stored > 0
    prompt = mem.question_layout("Which pets do they have?", [a, b])
    assert len(prompt.cuts) == 2 and prompt.cuts[0] == len(a.token_ids)
    again = mem.answer_from("Which pets do they have?", hits, max_new_tokens=4)
    # both entries, and the same question's chunks up to the last boundary before its last token
    point = graft_point_for(len(prompt.ids), mem.engine.chunk, prompt.cuts)
    assert again.report.tokens_grafted == point >= prompt.cuts[1] and again.text == first.text
