"""`KVMemoryRetriever`: LlamaIndex's `BaseRetriever` over kvmemory's router and entry catalogue.

A thin adapter: `KVMemory.recall` does the routing (FAISS, namespace, calibrated threshold); this
module only turns each routed entry into a `NodeWithScore` whose node id is the entry id (so
LlamaIndex's evaluators can compare ids), whose text is the problem and the solution, and whose
metadata carries the provenance: entry id, score, answer, verified flag, attestation id, namespace.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kvmemory import DEFAULT_MODEL, TEXT_TEMPLATE, InvalidInput, KVMemory, Recalled, borrow_memory, prompt_text
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType, TextNode

DEFAULT_TEXT_TEMPLATE = TEXT_TEMPLATE
# The keys every kvmemory adapter (LangChain and LlamaIndex) puts on a retrieved solution
# (`Recalled.metadata`), besides `problem` and `matched_text` (the problem or alias the query matched).
METADATA_KEYS = ("entry_id", "score", "answer", "verified", "kind", "attestation_id", "namespace")
# Provenance is for the caller, not for the model: a 135M model given "attestation_id: 3f9a..." in its
# context only has more tokens to read, and an embedder would embed the hashes.
_HIDDEN_KEYS = [*METADATA_KEYS, "problem", "matched_text"]


def node_from_recalled(hit: Recalled, text_template: str = DEFAULT_TEXT_TEMPLATE) -> NodeWithScore:
    """One routed entry as a LlamaIndex node (id = entry id) with its cosine score."""
    node = TextNode(id_=hit.entry.id, text=hit.text(text_template), metadata=hit.metadata(),
                    excluded_llm_metadata_keys=list(_HIDDEN_KEYS), excluded_embed_metadata_keys=list(_HIDDEN_KEYS))
    return NodeWithScore(node=node, score=float(hit.score))


class KVMemoryRetriever(BaseRetriever):
    """Retrieve verified solutions (problem + solution) from a kvmemory store.

    Args:
        memory: the `KVMemory` to search (share one per process: it holds the model). Without it,
            `store` (a folder; default: kvmemory's default store) and `model` open a shared one, on
            `device` ("auto", "cpu", "cuda", "cuda:N") in `dtype` ("auto" ...), as kvmemory.KVMemory's.
        similarity_top_k: at most this many solutions per query, best first.
        namespace: the namespace searched (default: the memory's own).
        threshold: cosine score below which a hit is dropped (default: the router's calibrated one).
        verified_only: drop entries stored with `allow_unverified=True`.
        text_template: how a node's text is made from `problem`, `solution` and `answer`.
    """

    def __init__(self, memory: KVMemory | None = None, *, store: str | os.PathLike[str] | None = None,
                 model: str = DEFAULT_MODEL, similarity_top_k: int = 5, namespace: str | None = None,
                 threshold: float | None = None, verified_only: bool = False,
                 text_template: str = DEFAULT_TEXT_TEMPLATE, callback_manager: CallbackManager | None = None,
                 verbose: bool = False, device: str = "auto", dtype: str = "auto") -> None:
        if memory is None or isinstance(memory, KVMemory):  # a memory given must run where device / dtype say
            memory = borrow_memory(memory, model, store, device=device, dtype=dtype).memory
        if not isinstance(memory, KVMemory):
            raise TypeError(f"memory must be a kvmemory.KVMemory, got {type(memory).__name__}")
        # Bad options: kvmemory's typed InvalidInput (a ValueError), as the LLM and LangChain's retriever.
        if isinstance(similarity_top_k, bool) or not isinstance(similarity_top_k, int) or similarity_top_k < 1:
            raise InvalidInput(f"similarity_top_k must be a positive integer, got {similarity_top_k!r}")
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidInput(f"namespace must be a string, got {type(namespace).__name__}")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise InvalidInput(f"threshold must be a number, got {threshold!r}")
        if not isinstance(verified_only, bool):
            raise InvalidInput(f"verified_only must be True or False, got {verified_only!r}")
        prompt_text(text_template, "text_template")
        self._memory = memory
        self.similarity_top_k = similarity_top_k
        self.namespace = namespace
        self.threshold = threshold
        self.verified_only = verified_only
        self.text_template = text_template
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    @property
    def memory(self) -> KVMemory:
        return self._memory

    @classmethod
    def class_name(cls) -> str:
        return "KVMemoryRetriever"

    @staticmethod
    def _check_query(query: Any) -> None:
        # Before LlamaIndex's start event and callbacks, which fail on a non-string with an
        # unrelated AttributeError / ValidationError.
        prompt_text(query.query_str if isinstance(query, QueryBundle) else query, "query")

    def retrieve(self, str_or_query_bundle: QueryType) -> list[NodeWithScore]:
        self._check_query(str_or_query_bundle)
        return super().retrieve(str_or_query_bundle)

    async def aretrieve(self, str_or_query_bundle: QueryType) -> list[NodeWithScore]:
        self._check_query(str_or_query_bundle)
        return await super().aretrieve(str_or_query_bundle)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self._memory.recall(query_bundle.query_str, k=self.similarity_top_k, namespace=self.namespace,
                                   threshold=self.threshold)
        if self.verified_only:
            hits = [h for h in hits if h.entry.verified]
        return [node_from_recalled(h, self.text_template) for h in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # Embedding the query and reading the catalogue block; keep the event loop free.
        return await asyncio.to_thread(self._retrieve, query_bundle)
