"""Hit rate and MRR of KVMemoryRetriever on the recurring-problems set, by LlamaIndex's RetrieverEvaluator."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.evaluation import RetrieverEvaluator
from llama_index.retrievers.kvmemory import KVMemoryRetriever, aevaluate_retriever


def test_recurring_problems_hit_rate_and_mrr(li_memory, li_recurring, capsys):
    retriever = KVMemoryRetriever(li_memory, similarity_top_k=5, namespace=li_recurring.namespace)
    result = asyncio.run(aevaluate_retriever(retriever, li_recurring.cases))

    assert result.problems == 10 and result.queries == 20
    assert result.hit_rate >= 0.9
    assert result.mrr >= 0.85
    assert result.mrr <= result.hit_rate
    with capsys.disabled():
        print(f"\nRetrieverEvaluator on the recurring-problems set: {result.to_json()}")

    # The numbers are LlamaIndex's own: re-score one query with a RetrieverEvaluator built here.
    evaluator = RetrieverEvaluator.from_metric_names(["hit_rate", "mrr"], retriever=retriever)
    entry_id, queries = li_recurring.cases[3]
    one = evaluator.evaluate(query=queries[0], expected_ids=[entry_id])
    row = next(r for r in result.per_query if r["query"] == queries[0])
    assert row["retrieved"] == one.retrieved_ids
    assert row["hit_rate"] == pytest.approx(one.metric_vals_dict["hit_rate"])
    assert row["mrr"] == pytest.approx(one.metric_vals_dict["mrr"])
    # A wrong expected id scores zero: the metrics can fail.
    miss = evaluator.evaluate(query=queries[0], expected_ids=["e-not-an-entry"])
    assert miss.metric_vals_dict["hit_rate"] == 0.0 and miss.metric_vals_dict["mrr"] == 0.0
