"""LlamaIndex retriever over kvmemory: verified solutions as `NodeWithScore`s with their provenance."""

from llama_index.retrievers.kvmemory.base import METADATA_KEYS, KVMemoryRetriever, node_from_recalled
from llama_index.retrievers.kvmemory.evaluation import (
    RecurringEval,
    aevaluate_retriever,
    evaluate_recurring,
    remember_recurring,
)

__all__ = [
    "KVMemoryRetriever",
    "METADATA_KEYS",
    "node_from_recalled",
    "RecurringEval",
    "aevaluate_retriever",
    "evaluate_recurring",
    "remember_recurring",
]
