"""`KVMemoryRetriever`: stored verified solutions as LangChain Documents, routed by kvmemory's FAISS router.

A Document's content is the problem and its solution (ending with the answer); its metadata carries
the entry id, the routing score, the answer, the verified flag, the attestation id and the namespace,
so an agent can cite exactly what it used and anyone can re-check the entry (`kvmemory verify`).
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables.config import run_in_executor
from pydantic import ConfigDict, Field, model_validator

from kvmemory import (DEFAULT_MODEL, KVMemory, Recalled, SharedMemory, borrow_memory, env_store, resolve_device,
                      resolve_dtype)


def to_document(hit: Recalled) -> Document:
    return Document(id=hit.entry.id, page_content=hit.text(), metadata=hit.metadata())


class KVMemoryRetriever(BaseRetriever):
    """Retrieve stored verified solutions close to a question.

    Setup: `pip install langchain-kvmemory`; entries are added with `KVMemory.remember`, the
    `remember_solution` tool, `KVMemoryStore.put` or `kvmemory remember`.

    Key init args: `store` (folder; `$KVMEMORY_STORE` or the per-user default), `namespace`, `k`,
    `score_threshold` (None = the router's calibrated threshold, so an unrelated question finds
    nothing; -1.0 = the k nearest however far), `model` (the model whose store it is), `device` /
    `dtype` (where and in what that model runs when the retriever opens it: "auto" by default).

    Instantiate and invoke:
        ```python
        from langchain_kvmemory import KVMemoryRetriever

        retriever = KVMemoryRetriever(store="./my-store", k=2)
        docs = retriever.invoke("How many eggs are left?", k=1)
        docs[0].metadata["entry_id"], docs[0].metadata["verified"], docs[0].metadata["score"]
        ```
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    store: str | None = None
    namespace: str = "default"
    k: int = 4
    score_threshold: float | None = None
    model_name: str = Field(default=DEFAULT_MODEL, alias="model")
    device: str = "auto"
    """Where the model runs ("auto", "cpu", "cuda", "cuda:N"), as `ChatKVGraft.device`."""
    dtype: str = "auto"
    memory: KVMemory | None = Field(default=None, exclude=True, repr=False)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.memory is None:  # a device that is not here is refused now (typed), not at the first search
            resolve_dtype(self.dtype, resolve_device(self.device, model=self.model_name))

    @model_validator(mode="before")
    @classmethod
    def _store_from_env(cls, values: Any) -> Any:
        if isinstance(values, dict) and not values.get("store") and values.get("memory") is None:
            env = env_store()
            if env:
                values = {**values, "store": env}
        return values

    def shared(self) -> SharedMemory:
        return borrow_memory(self.memory, self.model_name, self.store, device=self.device, dtype=self.dtype)

    def _search(self, query: str, k: int | None, namespace: str | None, score_threshold: float | None) -> list[Document]:
        sm = self.shared()
        threshold = score_threshold if score_threshold is not None else self.score_threshold
        with sm.lock:
            hits = sm.memory.recall(query, k if k is not None else self.k, namespace=namespace or self.namespace,
                                    threshold=threshold)
        return [to_document(h) for h in hits]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, namespace: str | None = None,
                                score_threshold: float | None = None) -> list[Document]:
        return self._search(query, k, namespace, score_threshold)

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       k: int | None = None, namespace: str | None = None,
                                       score_threshold: float | None = None) -> list[Document]:
        # Embedding and the index search are blocking work: run them off the event loop.
        return await run_in_executor(None, self._search, query, k, namespace, score_threshold)
