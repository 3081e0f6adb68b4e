"""KVMemoryRetriever with the real llama-index-core objects and the embedded model's store."""

from __future__ import annotations

import asyncio

import pytest
from kvmemory import unrelated_questions
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.retrievers.kvmemory import METADATA_KEYS, KVMemoryRetriever


def test_rewording_routes_to_its_solution_with_provenance(li_memory, li_recurring):
    retriever = KVMemoryRetriever(li_memory, similarity_top_k=3, namespace=li_recurring.namespace)
    assert isinstance(retriever, BaseRetriever)
    problem = li_recurring.problems[0]
    entry_id = li_recurring.entry_for(0)
    hits = retriever.retrieve(problem.rewordings[0])

    assert hits and all(isinstance(h, NodeWithScore) and isinstance(h.node, TextNode) for h in hits)
    top = hits[0]
    assert top.node.node_id == entry_id
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    entry = li_memory.entry(entry_id, li_recurring.namespace)
    md = top.node.metadata
    assert set(METADATA_KEYS) <= set(md)
    assert md["entry_id"] == entry_id
    assert md["score"] == pytest.approx(top.score) and 0.83 <= top.score <= 1.0 + 1e-6
    assert md["answer"] == str(problem.answer) == entry.answer
    assert md["verified"] is True
    assert md["attestation_id"] == entry.attestation["attestation_id"] and len(md["attestation_id"]) == 64
    assert md["namespace"] == li_recurring.namespace
    assert md["matched_text"] == problem.text
    # Content = problem + solution; provenance stays out of what an LLM or an embedder reads.
    text = top.node.get_content()
    assert problem.text in text and problem.solution in text
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        seen = top.node.get_content(metadata_mode=mode)
        assert md["attestation_id"] not in seen and entry_id not in seen


def test_async_retrieve_matches_sync(li_memory, li_recurring):
    retriever = KVMemoryRetriever(li_memory, similarity_top_k=2, namespace=li_recurring.namespace)
    q = li_recurring.problems[1].rewordings[1]

    async def both():
        a = await retriever.aretrieve(q)
        b = await retriever.aretrieve(QueryBundle(q))
        return a, b

    a, b = asyncio.run(both())
    s = retriever.retrieve(q)
    assert [h.node.node_id for h in a] == [h.node.node_id for h in b] == [h.node.node_id for h in s]
    assert a[0].node.node_id == li_recurring.entry_for(1)
    assert [h.score for h in a] == pytest.approx([h.score for h in s])


def test_unrelated_questions_and_other_namespaces_return_nothing(li_memory, li_recurring):
    retriever = KVMemoryRetriever(li_memory, namespace=li_recurring.namespace)
    misses = [q for q in unrelated_questions(5, 0) if retriever.retrieve(q)]
    assert len(misses) <= 1, misses  # the calibrated threshold rejects ~99.8 % of them
    elsewhere = KVMemoryRetriever(li_memory, namespace="li-empty-namespace")
    assert elsewhere.retrieve(li_recurring.problems[0].text) == []


def test_top_k_and_threshold(li_memory, li_recurring):
    q = li_recurring.problems[2].rewordings[0]
    one = KVMemoryRetriever(li_memory, similarity_top_k=1, namespace=li_recurring.namespace).retrieve(q)
    assert len(one) == 1 and one[0].node.node_id == li_recurring.entry_for(2)
    # With no threshold the namespace's other problems follow, each at most once.
    wide = KVMemoryRetriever(li_memory, similarity_top_k=5, threshold=-1.0, namespace=li_recurring.namespace)
    ids = [h.node.node_id for h in wide.retrieve(q)]
    assert len(ids) == 5 == len(set(ids)) and ids[0] == li_recurring.entry_for(2)


def test_unverified_entries_are_flagged_and_can_be_excluded(li_memory):
    ns = "li-unverified"
    problem = "Lena buys 4 bags with 6 plums each. How many plums does she have?"
    wrong = li_memory.remember(problem, "4 * 6 = 26. The answer is 26.", "26", verifier="arithmetic",
                               namespace=ns, allow_unverified=True)
    hits = KVMemoryRetriever(li_memory, namespace=ns).retrieve(problem)
    assert [h.node.node_id for h in hits] == [wrong.id]
    assert hits[0].node.metadata["verified"] is False
    assert KVMemoryRetriever(li_memory, namespace=ns, verified_only=True).retrieve(problem) == []


def test_bad_arguments_are_refused(li_memory):
    from kvmemory import InvalidInput

    for kwargs in ({"similarity_top_k": 0}, {"similarity_top_k": True}, {"similarity_top_k": "3"},
                   {"namespace": 7}, {"threshold": "high"}, {"verified_only": "yes"}, {"text_template": None}):
        with pytest.raises(InvalidInput):
            KVMemoryRetriever(li_memory, **kwargs)
    with pytest.raises(TypeError):
        KVMemoryRetriever(memory="not a memory")
    retriever = KVMemoryRetriever(li_memory)
    with pytest.raises(InvalidInput):
        retriever.retrieve("   ")
    for bad in (None, 42, b"question", ["question"], QueryBundle(query_str=None)):
        with pytest.raises(InvalidInput):
            retriever.retrieve(bad)
        with pytest.raises(InvalidInput):
            asyncio.run(retriever.aretrieve(bad))


def test_a_component_built_without_an_llm_fails_instead_of_resolving_a_default(li_memory):
    # The guard in integrations/llama_index/conftest.py: LlamaIndex would otherwise reach for OpenAI.
    from llama_index.core import Settings
    from llama_index.core.query_engine import RetrieverQueryEngine

    with pytest.raises(AssertionError, match="default llm"):
        RetrieverQueryEngine.from_args(KVMemoryRetriever(li_memory))
    with pytest.raises(AssertionError, match="default embed_model"):
        Settings.embed_model  # noqa: B018
