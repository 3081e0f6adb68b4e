"""`RetrieverQueryEngine.from_args(retriever, llm=...)` over kvmemory, offline on the embedded model:
with LlamaIndex's default synthesizer (retrieved text pasted into its prompt), and with
`KVGraftSynthesizer` (the retrieved entries' stored KV grafted)."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.llms.kvgraft import REPORT_METADATA_KEY, KVGraftLLM, KVGraftSynthesizer
from llama_index.retrievers.kvmemory import KVMemoryRetriever


def test_query_engine_answers_from_the_retrieved_solution(li_memory, li_recurring):
    # The default synthesizer's prompt is long (its own instructions + the pasted solution): decode
    # only a few tokens of the answer.
    li_llm = KVGraftLLM(memory=li_memory, max_new_tokens=8, namespace=li_recurring.namespace)
    retriever = KVMemoryRetriever(li_memory, similarity_top_k=1, namespace=li_recurring.namespace)
    engine = RetrieverQueryEngine.from_args(retriever, llm=li_llm)
    problem = li_recurring.problems[7]
    query = problem.rewordings[0]

    response = engine.query(query)
    assert isinstance(response, Response) and response.response and response.response.strip()
    # The solution the answer was synthesized from, with its provenance.
    (source,) = response.source_nodes
    assert source.node.node_id == li_recurring.entry_for(7)
    assert source.node.metadata["verified"] is True and source.node.metadata["answer"] == str(problem.answer)
    # It was our model that answered: the synthesizer's prompt carried the solution's text ...
    ans = li_llm.last_answer
    assert ans.text == response.response.strip()
    assert ans.report.tokens_decoded > 0
    assert ans.report.tokens_total > len(li_memory.engine.encode(problem.solution))
    # ... and routing that prompt (system + context + query) found the same entry to graft.
    assert ans.entries == [li_recurring.entry_for(7)]

    # The same prompt again: its grid-aligned prefix was stored the first time and is grafted now.
    again = asyncio.run(engine.aquery(query))
    assert again.response == response.response
    assert li_llm.last_answer.report.tokens_grafted > ans.report.tokens_grafted
    assert li_llm.last_answer.report.tokens_computed < ans.report.tokens_computed


def test_kvgraft_synthesizer_grafts_the_retrieved_entry(li_memory, li_llm, li_recurring, capsys):
    retriever = KVMemoryRetriever(li_memory, similarity_top_k=2, namespace=li_recurring.namespace)
    synth = KVGraftSynthesizer(li_llm, answer_prefix="The answer is")
    engine = RetrieverQueryEngine.from_args(retriever, llm=li_llm, response_synthesizer=synth)
    problem = li_recurring.problems[8]
    entry = li_memory.entry(li_recurring.entry_for(8), li_recurring.namespace)

    response = engine.query(problem.rewordings[1])
    with capsys.disabled():
        print(f"\nKVGraftSynthesizer: {response.response!r} (verified answer {problem.answer}); "
              f"{response.metadata[REPORT_METADATA_KEY]}")
    assert response.response.startswith("The answer is ")
    report = response.metadata[REPORT_METADATA_KEY]
    assert report["entries"] == [entry.id]  # max_entries=1 of the two retrieved
    # The entry's stored chain is the prompt's prefix: all of it grafted (its tail block ends at the
    # entry's end, a cut), only the question and the answer prefix computed.
    assert report["tokens_grafted"] == len(entry.token_ids) > 0
    assert report["tokens_grafted"] + report["tokens_computed"] == report["tokens_total"]
    assert 0 < report["tokens_decoded"] <= li_llm.max_new_tokens
    assert response.source_nodes[0].node.node_id == entry.id

    streaming = KVGraftSynthesizer(li_llm, answer_prefix="The answer is", streaming=True)
    streamed = RetrieverQueryEngine.from_args(retriever, llm=li_llm, response_synthesizer=streaming).query(
        problem.rewordings[1])
    assert isinstance(streamed, StreamingResponse)
    assert "".join(streamed.response_gen) == response.response

    # Nothing routed: the synthesizer is not called with nodes, LlamaIndex's empty response comes back.
    assert str(engine.query("What is the tallest mountain on Mars?")) == "Empty Response"


def test_kvgraft_synthesizer_choices_gives_the_verified_answers(li_memory, li_llm, li_recurring):
    """choices="numbers": the model picks among the numbers of the grafted solution, for every
    reworded question of five problems (and streamed, the same text)."""
    retriever = KVMemoryRetriever(li_memory, similarity_top_k=1, namespace=li_recurring.namespace)
    synth = KVGraftSynthesizer(li_llm, answer_prefix="The answer is", choices="numbers")
    engine = RetrieverQueryEngine.from_args(retriever, llm=li_llm, response_synthesizer=synth)
    for i in range(5):
        problem = li_recurring.problems[i]
        response = engine.query(problem.rewordings[0])
        assert response.response == f"The answer is {problem.answer}.", (i, response.response)
        report = response.metadata[REPORT_METADATA_KEY]
        assert report["entries"] == [li_recurring.entry_for(i)] and report["tokens_grafted"] > 0
    streaming = KVGraftSynthesizer(li_llm, answer_prefix="The answer is", choices="numbers", streaming=True)
    streamed = RetrieverQueryEngine.from_args(retriever, llm=li_llm, response_synthesizer=streaming).query(
        li_recurring.problems[0].rewordings[0])
    assert "".join(streamed.response_gen) == f"The answer is {li_recurring.problems[0].answer}."


def test_kvgraft_synthesizer_refuses_foreign_nodes(li_llm):
    synth = KVGraftSynthesizer(li_llm)
    with pytest.raises(ValueError, match="not a kvmemory entry"):
        synth.synthesize("q", [NodeWithScore(node=TextNode(text="some text"), score=1.0)])
    with pytest.raises(TypeError):
        KVGraftSynthesizer(object())
