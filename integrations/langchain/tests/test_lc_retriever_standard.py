"""LangChain's published retriever suite, run on KVMemoryRetriever over a store of verified solutions."""

from __future__ import annotations

from langchain_tests.integration_tests import RetrieversIntegrationTests

from langchain_kvmemory import KVMemoryRetriever
from lc_testutil import PROBLEMS, seeded_store


class TestKVMemoryRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[KVMemoryRetriever]:
        return KVMemoryRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        # -1.0: the k nearest entries however far, the suite's notion of "k results" (the calibrated
        # default threshold, which drops unrelated entries, is tested in test_lc_retriever.py).
        return {"store": seeded_store(), "score_threshold": -1.0}

    @property
    def retriever_query_example(self) -> str:
        return PROBLEMS[0].rewordings[0]
