"""End to end on the embedded SmolLM2: remember, ask with a graft, verify bit-identical, bad input."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvmemory.engine.engine import Engine
from kvmemory.errors import InvalidInput, ProfileMismatch, UnknownEntry, VerificationFailed
from kvmemory.memory.facade import KVMemory
from kvmemory.store.local import LocalStore

PROBLEM = ("A library lends 37 books on Monday and 45 on Tuesday. On Wednesday it lends twice as many as on "
           "Monday. 19 books come back on Thursday. How many books are still out?")
SOLUTION = ("Monday and Tuesday: 37 + 45 = 82 books.\nWednesday: 2 * 37 = 74 books.\nTotal lent: 82 + 74 = 156 "
            "books.\nAfter Thursday: 156 - 19 = 137 books.\nThe answer is 137.")


def test_embedded_model_is_converted_once(smollm):
    from pathlib import Path

    from kvmemory.models.loading import resolve_model_path

    path = Path(resolve_model_path())
    assert path == Path(smollm.path)
    assert (path / "model.safetensors").exists() and (path / "config.json").exists()
    assert "quantization_config" not in (path / "config.json").read_text()


def test_remember_ask_verify_bit_identical(real_memory):
    mem = real_memory
    e = mem.remember(PROBLEM, SOLUTION, answer="137", verifier="arithmetic")
    assert e.verified and e.attestation["bit_identical"] and len(e.chain) >= 1
    ans = mem.ask(e.id, "How many books were lent on Wednesday?", max_new_tokens=12)
    r = ans.report
    assert r.tokens_grafted == len(e.token_ids)  # every token of the entry, its last partial chunk too
    assert r.tokens_computed == r.tokens_total - r.tokens_grafted and r.tokens_decoded > 0
    assert r.bytes_read > 0 and ans.entries == [e.id]
    # The grafted answer is the recomputed answer, token for token.
    prompt = mem.question_layout("How many books were lent on Wednesday?", [e])
    ref = mem.engine.recompute(prompt.ids, max_new_tokens=len(ans.token_ids), stop_token_ids=mem.engine.eos_token_ids,
                               cuts=prompt.cuts)
    assert ref.generated == ans.token_ids
    summary = mem.verify()
    assert summary.checked == 1 and summary.bit_identical == 1 and summary.kl_max == 0.0
    assert summary.argmax_agreement == 1.0 and summary.attested_match == 1


def test_grafted_logits_equal_recompute_on_unseen_text(real_memory):
    eng = real_memory.engine
    text = ("In the quiet valley of Oren, the river bends three times before it meets the sea. Each bend has a "
            "mill, and each mill grinds a different grain: barley at the first, rye at the second, millet at the "
            "third. The millers trade flour every full moon, and their ledgers, kept in three colours of ink, "
            "record every sack that crosses the water.") * 4
    ids = eng.encode(text)
    eng.store_prefix(ids[:200])
    got, report = eng.forward(ids, max_new_tokens=6, stop_token_ids=(), keep_logits=True)
    ref = eng.recompute(ids, max_new_tokens=6, stop_token_ids=())
    g = report.tokens_grafted
    assert len(ids) > 260 and g == 192
    assert torch.equal(got.prefill_logits, ref.prefill_logits[g:])
    assert torch.equal(got.decode_logits, ref.decode_logits)
    assert got.logits_sha256 != ref.logits_sha256 or g == 0  # ref hashes from position 0
    vr = eng.verify_tokens(ids, decode_tokens=6)
    assert vr.bit_identical and vr.comparison.kl_max == 0.0
    assert vr.single_pass_max_abs_diff is not None  # reported, never asserted
    # logits="last", as answers run: only the rows tokens are chosen from, the same bytes as those rows of
    # the all-rows run where every row is computed on its own (the GGUF-block linears, the lean step)
    last, rep_last = eng.forward(ids, max_new_tokens=6, stop_token_ids=(), logits="last")
    assert rep_last.tokens_grafted == g and last.generated == ref.generated
    if eng.profile.linear_impl == "gguf-blocks":
        rows = torch.cat([ref.prefill_logits[-1:], ref.decode_logits]).contiguous()
        assert last.logits_sha256 == hashlib.sha256(rows.numpy().tobytes()).hexdigest()


def test_bad_input_is_refused_before_the_model(real_memory):
    mem = real_memory
    with pytest.raises(InvalidInput):
        mem.remember("", SOLUTION, "137")
    with pytest.raises(InvalidInput):
        mem.remember(PROBLEM, "   ", "137")
    with pytest.raises(InvalidInput, match="exceed"):
        mem.remember(PROBLEM, "word " * 9000, allow_unverified=True)
    with pytest.raises(InvalidInput):
        mem.engine.forward([])
    with pytest.raises(InvalidInput):
        mem.engine.forward([10 ** 9])
    with pytest.raises(UnknownEntry):
        mem.ask("e000000000000000", "why?")
    with pytest.raises(VerificationFailed):
        mem.remember(PROBLEM, SOLUTION.replace("137", "138"), answer="137")
    assert mem.store.stats().entries == 0


def test_unverified_is_refused_unless_allowed_and_then_marked(real_memory):
    mem = real_memory
    with pytest.raises(VerificationFailed):
        mem.remember(PROBLEM, SOLUTION)  # no answer, no verifier: nothing vouches for it
    e = mem.remember(PROBLEM, SOLUTION, allow_unverified=True)
    assert not e.verified and mem.store.get_entry(e.id).verifier["ok"] is False
    ans = mem.ask(e.id, "What is the answer?", max_new_tokens=4)
    assert ans.verified == [False]


def test_entry_under_another_profile_is_refused(smollm, tmp_path):
    mem = KVMemory(Engine(smollm, LocalStore(tmp_path / "s")))
    e = mem.remember(PROBLEM, SOLUTION, answer="137")
    other = KVMemory(Engine(smollm, LocalStore(tmp_path / "s"), chunk=32))
    with pytest.raises(ProfileMismatch, match="chunk"):
        other.ask(e.id, "And on Monday?")
    assert tuple(other.engine.profile.diff(mem.engine.profile)) == ("chunk",)
