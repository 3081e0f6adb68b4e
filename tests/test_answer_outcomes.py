"""Where an answer came from, and `choices` with nothing to choose among (memory/answers.py): a typed
outcome at once, or the model's own answer capped to a sentence and flagged; never a silent free decode."""

from __future__ import annotations

import time

import pytest

from kvmemory.bench.problems import generate_problems
from kvmemory.errors import InvalidInput
from kvmemory.memory.answers import MODEL_ALONE, NOTHING_ROUTED, SENTENCE_TOKENS


def test_choices_with_nothing_routed_return_at_once_with_a_typed_outcome(real_memory):
    mem = real_memory
    t0 = time.perf_counter()
    ans = mem.answer("How many legs do seven spiders have?", choices="numbers", answer_prefix="The answer is")
    took = time.perf_counter() - t0
    assert ans.outcome == NOTHING_ROUTED and ans.source == "none" and ans.text == ""
    assert "remember" in ans.reason and "nothing_to_choose" in ans.reason
    r = ans.report
    assert r.tokens_computed == r.tokens_decoded == r.tokens_scored == 0 and ans.stopped_by == "nothing_to_choose"
    assert took < 30  # sanity only: no model time is spent (the embedding of the question is all)
    j = ans.to_json()
    assert j["outcome"] == NOTHING_ROUTED and j["source"] == "none" and j["reason"]
    with pytest.raises(InvalidInput, match="nothing_to_choose"):
        mem.answer("How many legs?", choices="numbers", nothing_to_choose="ramble")


def test_the_models_own_answer_is_capped_to_a_sentence_and_flagged(real_memory):
    ans = real_memory.answer("Write a long story about a dragon.", choices="numbers", nothing_to_choose="decode",
                             max_new_tokens=200)
    assert ans.outcome == MODEL_ALONE and ans.source == "model" and "capped" in ans.reason
    assert 0 < len(ans.token_ids) <= SENTENCE_TOKENS
    plain = real_memory.answer("What is two plus two?", max_new_tokens=4)  # no choices: as before, unflagged
    assert plain.outcome is None and plain.source == "model"


def test_answers_say_whether_they_came_from_memory_or_a_note(real_memory):
    mem = real_memory
    p, = generate_problems(1, seed=47, rewordings=1)
    mem.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic")
    ans = mem.answer(p.rewordings[0], choices="numbers", answer_prefix="The answer is")
    assert ans.entries and ans.source == "memory" and ans.outcome is None
    mem.note("Alice's favourite colour is teal.")
    got = mem.answer("What is Alice's favourite colour?", max_new_tokens=4)
    assert got.kinds == ["note"] and got.source == "note"
