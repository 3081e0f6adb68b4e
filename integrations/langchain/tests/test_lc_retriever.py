"""KVMemoryRetriever beyond the standard suite: Document content and provenance metadata, the
calibrated threshold (an unrelated question finds nothing), namespaces, k per call."""

from __future__ import annotations

import asyncio

from langchain_kvmemory import KVMemoryRetriever
from kvmemory import shared_memory
from lc_testutil import PROBLEMS, seeded_store


def test_documents_carry_problem_solution_and_provenance():
    r = KVMemoryRetriever(store=seeded_store(), k=2)
    docs = r.invoke(PROBLEMS[0].rewordings[1])
    mem = shared_memory(None, seeded_store())
    entry = next(e for e in mem.store.list_entries("default") if e.problem == PROBLEMS[0].text)
    assert docs and docs[0].id == entry.id
    d = docs[0]
    assert d.page_content.startswith(f"Problem: {PROBLEMS[0].text}\nSolution: ")
    assert PROBLEMS[0].steps[0] in d.page_content and str(PROBLEMS[0].answer) in d.page_content
    m = d.metadata
    assert m["entry_id"] == entry.id and m["answer"] == str(PROBLEMS[0].answer) and m["verified"] is True
    assert m["attestation_id"] == entry.attestation["attestation_id"] and m["namespace"] == "default"
    assert 0.83 <= m["score"] <= 1.0001
    assert all(x.metadata["score"] <= m["score"] for x in docs)


def test_unrelated_question_finds_nothing_unless_the_threshold_is_lowered():
    r = KVMemoryRetriever(store=seeded_store())
    assert r.invoke("What is the capital of Australia?") == []
    assert len(r.invoke("What is the capital of Australia?", score_threshold=-1.0, k=2)) == 2


def test_k_and_namespace_per_call():
    r = KVMemoryRetriever(store=seeded_store(), k=4, score_threshold=-1.0)
    assert len(r.invoke(PROBLEMS[1].text)) == 4
    assert len(r.invoke(PROBLEMS[1].text, k=2)) == 2
    assert r.invoke(PROBLEMS[1].text, namespace="nobody-here") == []
    assert len(asyncio.run(r.ainvoke(PROBLEMS[1].text, k=1))) == 1


def test_a_question_about_a_stored_fact_finds_its_note():
    """A note (a plain statement) is found at the note threshold, as `answer` routes it: a question
    about a fact scores below the threshold that routes solutions (0.83 for MiniLM)."""
    from lc_testutil import fresh_store

    path = fresh_store() + "-notes"
    mem = shared_memory(None, path)
    note = mem.note("Alice has a cat named Tom.", namespace="facts")
    r = KVMemoryRetriever(store=path, namespace="facts")
    docs = r.invoke("What pet does Alice have?")
    assert [d.id for d in docs] == [note.id] and docs[0].metadata["kind"] == "note"
    assert docs[0].metadata["score"] < 0.83
    assert r.invoke("What pet does Alice have?", score_threshold=0.83) == []  # a threshold given gates both kinds
    assert r.invoke("What is the capital of Australia?") == []
