"""The memory facade with routing on the embedded model: recall, answer, namespaces, forget, policies."""

from __future__ import annotations

import pytest

from kvmemory.errors import InvalidInput, RouterMismatch
from kvmemory.bench.problems import generate_problems
from kvmemory.memory.verifiers import extract_answer, numbers_in
from kvmemory.memory.prompts import render_ids, solution_text
from kvmemory.memory.layout import preamble


@pytest.fixture
def library(real_memory):
    probs = generate_problems(4, seed=11, rewordings=2)
    entries = {p.id: real_memory.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic")
               for p in probs}
    return real_memory, probs, entries


def test_recall_ranks_the_right_entry_and_refuses_unrelated(library):
    mem, probs, entries = library
    for p in probs:
        hits = mem.recall(p.rewordings[0], k=3)
        assert hits and hits[0].entry.id == entries[p.id].id
        assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    assert mem.recall("What is the capital of Australia?", k=3) == []
    assert mem.recall("Write a haiku about autumn leaves.", k=3) == []
    with pytest.raises(InvalidInput):
        mem.recall("", k=3)
    with pytest.raises(InvalidInput):
        mem.recall("hello", k=0)


def test_answer_grafts_and_reports_provenance(library):
    mem, probs, entries = library
    p = probs[0]
    ans = mem.answer(p.rewordings[1], answer_prefix="As in my solution above, the final answer is",
                     max_new_tokens=8, stop=["\n"])
    e = entries[p.id]
    assert ans.entries == [e.id] and ans.attestations == [e.attestation["attestation_id"]]
    assert ans.verified == [True] and 0.83 <= ans.scores[0] <= 1.0001
    assert ans.report.tokens_grafted >= 64 and ans.report.tokens_decoded <= 8
    assert ans.text.startswith("As in my solution above") and extract_answer(ans.text) is not None
    # (accuracy over many rewordings is measured by `kvmemory bench recurring`, not on one case)


def test_answer_chosen_among_the_solution_numbers(library):
    mem, probs, entries = library
    p = probs[2]
    q = p.rewordings[0]
    prefix = "As in my solution above, the final answer is"
    ans = mem.answer(q, answer_prefix=prefix, choices="numbers")
    e = entries[p.id]
    assert ans.entries == [e.id] and ans.stopped_by == "choice"
    assert ans.choices == numbers_in(solution_text(e.solution, e.answer)) and str(p.answer) in ans.choices
    assert len(ans.choice_scores) == len(ans.choices)
    best = max(range(len(ans.choices)), key=lambda i: ans.choice_scores[i])
    assert ans.text == f"{prefix} {ans.choices[best]}."
    eng = mem.engine
    tokenized = [eng.encode(f" {c}.") for c in ans.choices]
    assert ans.report.tokens_decoded == len(tokenized[best]) and ans.report.tokens_grafted >= 64
    # The scores do not depend on where the prefix's KV came from: grafted or recomputed, the same floats.
    # the ids, cut at the entry's end and at the question's, before the prefix (memory/layout.py)
    prompt = mem.question_layout(q, [e], prefix)
    asked = mem.followup_ids([e], q)
    assert prompt.ids == asked + eng.encode(prefix) and prompt.cuts == (len(e.token_ids), len(asked))
    g_best, g_scores, g_rep = eng.choose(prompt.ids, tokenized, cuts=prompt.cuts)
    r_best, r_scores, r_rep = eng.choose(prompt.ids, tokenized, graft=False, cuts=prompt.cuts)
    assert g_rep.tokens_grafted == len(e.token_ids) and r_rep.tokens_grafted == 0  # the whole entry, tail too
    assert g_scores == r_scores and g_best == r_best
    assert g_rep.tokens_scored == sum(map(len, tokenized))
    plain = mem.answer(q, answer_prefix=prefix, choices="numbers", contrast=0.0, prior=0.0)
    assert plain.choice_scores == g_scores and plain.report.tokens_scored == g_rep.tokens_scored
    # The default: minus half the likelihood after the question alone (without memory), plus the prior
    # (2.5 nats) on the one choice that is the entry's verified answer.
    # The question alone is cut after the template's preamble (memory/layout.py), whose block the answer
    # stored and grafted: it computes the rest.
    alone = mem.question_layout(q, (), prefix)
    assert alone.ids == render_ids(eng.tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True) + eng.encode(prefix)
    assert alone.cuts == (len(preamble(eng.tokenizer)), len(alone.ids) - len(eng.encode(prefix)))
    assert alone.cuts[0] >= 16
    _, a_scores, a_rep = eng.choose(alone.ids, tokenized, graft=False, cuts=alone.cuts)
    known = [float(c) == float(p.answer) for c in ans.choices]
    assert sum(known) == 1
    assert ans.choice_scores == [s - 0.5 * a + 2.5 * k for s, a, k in zip(g_scores, a_scores, known)]
    assert ans.report.tokens_scored == 2 * g_rep.tokens_scored + len(alone.ids) - alone.cuts[0]
    # Each batched score is the choice's log-likelihood, as a plain forward over prompt + choice gives it.
    for c, score in zip(tokenized[:3], g_scores):
        full = eng.recompute(prompt.ids + c[:-1], cuts=prompt.cuts).prefill_logits.float().log_softmax(-1)
        ref = sum(float(full[len(prompt.ids) - 1 + t, tok]) for t, tok in enumerate(c))
        assert abs(ref - score) < 1e-3
    with pytest.raises(InvalidInput):
        mem.answer(q, choices="numbers", contrast=2.0)
    for bad in (-1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(InvalidInput):
            mem.answer(q, choices="numbers", prior=bad)


def test_a_verified_answer_outweighs_an_intermediate_result(real_memory):
    """The calibration set's case: reading the verified solution, the small model prefers the sum it
    wrote on the way (255) to the average it concluded (85). The prior keeps it to the verified answer;
    prior=0 is the model's own choice, unchanged."""
    mem = real_memory
    e = mem.remember("Lena scored 78, 85 and 92 on three tests. What is her average score?",
                     "78 + 85 + 92 = 255. 255 / 3 = 85. The answer is 85.", answer="85")
    q = "Test scores: 78 pts, 85 pts, 92 pts (n = 3). Average in pts = ?"
    own = mem.answer(q, answer_prefix="The answer is", choices="numbers", prior=0.0)
    ans = mem.answer(q, answer_prefix="The answer is", choices="numbers")
    assert own.entries == ans.entries == [e.id]
    assert own.text == "The answer is 255." and ans.text == "The answer is 85."
    i = ans.choices.index("85")
    assert [round(b - a, 9) for a, b in zip(own.choice_scores, ans.choice_scores)] == \
        [2.5 if j == i else 0.0 for j in range(len(ans.choices))]


def test_no_prior_for_notes_or_unverified_entries(real_memory):
    mem = real_memory
    mem.remember("A box holds 12 pens and 3 are taken out. How many pens are in the box?",
                 "12 - 3 = 9 pens remain. The answer is 9.", answer="9", verifier="none", allow_unverified=True)
    q = "A box has 12 pens; 3 are removed. How many pens are left in the box?"
    a0 = mem.answer(q, answer_prefix="The answer is", choices="numbers", prior=0.0)
    a1 = mem.answer(q, answer_prefix="The answer is", choices="numbers", prior=50.0)
    assert a0.entries and a0.verified == [False]
    assert a1.choice_scores == a0.choice_scores  # nothing verified: nothing favoured


def test_answer_choices_given_and_refused(library):
    mem, probs, _ = library
    ans = mem.answer(probs[0].rewordings[0], choices=["Yes", "No"], choice_end="")
    assert ans.text in {"Yes", "No"} and ans.choices == ["Yes", "No"]
    with pytest.raises(InvalidInput):
        mem.answer(probs[0].rewordings[0], choices="letters")
    with pytest.raises(InvalidInput):
        mem.answer(probs[0].rewordings[0], choices=[])
    with pytest.raises(InvalidInput):
        mem.answer(probs[0].rewordings[0], choices=["ok", ""])
    # No entry routed: nothing to offer, the model decodes, and the answer says so.
    free = mem.answer("Name a primary colour.", choices="numbers", max_new_tokens=4)
    assert free.entries == [] and free.choices == [] and free.stopped_by != "choice"


def test_routing_checks_the_numbers(real_memory):
    e = real_memory.remember("What is 1234 multiplied by 56?", "1234 * 56 = 69104. The answer is 69104.",
                             answer="69104", verifier="arithmetic")
    same, other = "Compute 1234 multiplied by 56.", "What is 1234 multiplied by 57?"
    assert [h.entry.id for h in real_memory.recall(same, number_check=True)] == [e.id]
    assert real_memory.recall(other, number_check=True) == []  # close in words, another problem
    assert [h.entry.id for h in real_memory.recall(other)] == [e.id]  # listed, for a retriever to rank
    assert real_memory.answer(same, max_new_tokens=1).entries == [e.id]
    assert real_memory.answer(other, max_new_tokens=1).entries == []  # not answered from the 56 entry
    real_memory.number_check = False
    assert real_memory.answer(other, max_new_tokens=1).entries == [e.id]


def test_unrelated_question_answers_without_memory(library):
    mem, _, _ = library
    ans = mem.answer("Name a primary colour.", max_new_tokens=6)
    assert ans.entries == [] and ans.report.tokens_grafted == 0


def test_several_entries_store_the_combination_for_next_time(library):
    mem, probs, entries = library
    q = probs[1].rewordings[0]
    mem.number_check = False  # the second entry is another problem (other numbers): combined on purpose
    first = mem.answer(q, k=2, threshold=0.0, max_new_tokens=2)
    assert len(first.entries) == 2 and first.report.blocks_stored > 0  # block_policy "multi"
    second = mem.answer(q, k=2, threshold=0.0, max_new_tokens=2)
    assert second.entries == first.entries
    assert second.report.tokens_grafted > first.report.tokens_grafted
    assert second.token_ids == first.token_ids  # same logits, so the same greedy tokens


def test_namespaces_isolate_tenants(library):
    mem, probs, entries = library
    p = probs[2]
    assert mem.recall(p.rewordings[0], k=5, namespace="tenant-b") == []
    other = mem.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic", namespace="tenant-b")
    hits = mem.recall(p.rewordings[0], k=5, namespace="tenant-b")
    assert [h.entry.id for h in hits] == [other.id]
    assert all(h.entry.namespace == "default" for h in mem.recall(p.rewordings[0], k=5))
    with pytest.raises(KeyError):
        mem.entry(other.id)  # default namespace cannot read tenant-b's entry
    mem.forget_namespace("tenant-b")
    assert mem.recall(p.rewordings[0], k=5, namespace="tenant-b") == []
    assert mem.recall(p.rewordings[0], k=1)[0].entry.id == entries[p.id].id


def test_forget_removes_blocks_and_route(library):
    mem, probs, entries = library
    p = probs[3]
    e = entries[p.id]
    before = mem.store.stats()
    removed = mem.forget(e.id)
    assert removed >= 1 and mem.store.stats().blocks == before.blocks - removed
    assert all(h.entry.id != e.id for h in mem.recall(p.rewordings[0], k=5, threshold=0.0))
    for h in e.chain:
        assert not mem.store.block_path(h).exists() or mem.store.get_block(h) is not None


def test_router_refuses_another_embedder_until_reindex(library, tmp_path):
    from kvmemory.routing.router import Router

    mem, probs, _ = library
    folder = mem.store.path / "router"
    manifest = folder / "manifest.json"
    import json

    data = json.loads(manifest.read_text())
    data["embedder"]["weights_sha256"] = "0" * 64  # as if another embedder had built it
    manifest.write_text(json.dumps(data))
    with pytest.raises(RouterMismatch, match="reindex"):
        Router(folder)
    mem._router = None
    assert mem.reindex() == 4
    assert mem.recall(probs[0].rewordings[0], k=1)


def test_entries_remembered_elsewhere_are_routed(library, smollm):
    """Another process (or machine, on a shared store) remembers an entry: this one routes to it."""
    from kvmemory.engine.engine import Engine
    from kvmemory.memory.facade import KVMemory
    from kvmemory.store.local import LocalStore

    mem, _, _ = library
    p = generate_problems(1, seed=99)[0]
    other = KVMemory(Engine(smollm, LocalStore(mem.store.path)),
                     router=__import__("kvmemory.routing.router", fromlist=["Router"]).Router(mem.store.path / "router-other"))
    e = other.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic")
    hits = mem.recall(p.rewordings[0], k=1)
    assert hits and hits[0].entry.id == e.id
