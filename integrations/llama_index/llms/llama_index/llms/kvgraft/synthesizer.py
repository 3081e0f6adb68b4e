"""`KVGraftSynthesizer`: a LlamaIndex response synthesizer that answers from kvmemory entries' KV.

LlamaIndex's default synthesizers paste the retrieved nodes' text into a prompt, so the model reads
every retrieved solution again, at positions where no stored KV can be grafted (KV is only valid at
the positions and after the tokens it was computed with). With nodes from `KVMemoryRetriever` this
synthesizer instead puts the entries themselves before the question the way they were stored: the
first entry's KV blocks are grafted, only the other entries and the question are computed.

    engine = RetrieverQueryEngine.from_args(
        retriever, llm=llm, response_synthesizer=KVGraftSynthesizer(llm, answer_prefix="The answer is"))

Nodes that do not come from kvmemory (no `entry_id` in their metadata) are refused with a
`ValueError`: there is no stored KV to graft for them; use a default synthesizer for those.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Generator, Sequence
from contextlib import closing
from typing import Any

from kvmemory import Answer, EntryRecord, stream_text
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response, StreamingResponse
from llama_index.core.callbacks import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType
from llama_index.core.types import RESPONSE_TEXT_TYPE

from .base import KVGraftLLM, answer_kwargs

# Response.metadata key under which the graft report of the answer is kept (next to the node ids).
REPORT_METADATA_KEY = "kvgraft"


class KVGraftSynthesizer(BaseSynthesizer):
    """Answer from the retrieved kvmemory entries' grafted KV instead of their pasted text.

    Args:
        llm: the `KVGraftLLM` whose memory the nodes came from.
        max_entries: at most this many of the retrieved entries are put before the question.
        answer_prefix: text that starts the assistant's turn (e.g. "The answer is").
        choices: "numbers" (the numbers the entries' verified solutions write) or a list of strings:
            the model picks its answer among them by likelihood instead of decoding it, the reliable
            mode for a small model (`KVMemory.answer`'s `choices`); None decodes freely.
        streaming: return a `StreamingResponse`.
    """

    def __init__(self, llm: KVGraftLLM, *, max_entries: int = 1, answer_prefix: str | None = None,
                 choices: str | Sequence[str] | None = None, streaming: bool = False,
                 callback_manager: CallbackManager | None = None) -> None:
        if not isinstance(llm, KVGraftLLM):
            raise TypeError(f"KVGraftSynthesizer needs a KVGraftLLM, got {type(llm).__name__}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        super().__init__(llm=llm, callback_manager=callback_manager or llm.callback_manager, streaming=streaming)
        self._kv_llm = llm
        self.max_entries = max_entries
        self.answer_prefix = answer_prefix
        self.choices = choices

    def _get_prompts(self) -> PromptDictType:
        return {}  # no prompt template: the entries are placed as stored, the question as a user turn

    def _update_prompts(self, prompts: PromptDictType) -> None:
        pass

    def _entries(self, nodes: Sequence[NodeWithScore]) -> tuple[list[EntryRecord], list[float]]:
        mem = self._kv_llm.memory
        entries, scores = [], []
        for n in nodes[: self.max_entries]:
            md = n.node.metadata
            if "entry_id" not in md:
                raise ValueError(f"node {n.node.node_id} is not a kvmemory entry (no entry_id in its metadata); "
                                 "KVGraftSynthesizer answers from KVMemoryRetriever's nodes only")
            entries.append(mem.entry(md["entry_id"], md.get("namespace")))
            scores.append(float(n.score or 0.0))
        return entries, scores

    def _answer(self, query_str: str, nodes: Sequence[NodeWithScore], on_text=None, **kwargs: Any) -> Answer:
        entries, scores = self._entries(nodes)
        return self._kv_llm.answer_entries(query_str, entries, scores=scores, answer_prefix=self.answer_prefix,
                                           choices=self.choices, on_text=on_text, **kwargs)

    def _stream(self, query_str: str, nodes: Sequence[NodeWithScore], **kwargs: Any) -> Generator[str, None, None]:
        prefix = (self.answer_prefix or "").strip()

        def call(on_text) -> Answer:
            ans = self._answer(query_str, nodes, on_text, **kwargs)
            if prefix and ans.text.startswith(prefix):
                # The deltas are the decoded text only; the prefix is streamed first, below.
                ans = copy.copy(ans)
                ans.text = ans.text[len(prefix):].strip()
            return ans

        sep = ""
        if prefix:
            yield prefix
            sep = " "
        with closing(stream_text(call, kwargs.get("stop", self._kv_llm.stop))) as chunks:
            for chunk in chunks:
                if chunk.delta:
                    yield sep + chunk.delta
                    sep = ""

    def _respond(self, query: QueryType, nodes: list[NodeWithScore],
                 additional_source_nodes: Sequence[NodeWithScore] | None, **kwargs: Any) -> RESPONSE_TYPE:
        query_str = query.query_str if isinstance(query, QueryBundle) else str(query)
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        metadata = self._get_metadata_for_response([n.node for n in source_nodes]) or {}
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query_str}) as event:
            if self._streaming:
                response: RESPONSE_TYPE = StreamingResponse(self._stream(query_str, nodes, **kwargs),
                                                            source_nodes=source_nodes, metadata=metadata)
            else:
                ans = self._answer(query_str, nodes, **kwargs)
                metadata[REPORT_METADATA_KEY] = answer_kwargs(ans)
                response = Response(ans.text, source_nodes=source_nodes, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    def synthesize(self, query: QueryType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any) -> RESPONSE_TYPE:
        if not nodes:  # the base class's "Empty Response" (nothing routed above the threshold)
            return super().synthesize(query, nodes, additional_source_nodes, **kwargs)
        return self._respond(query, nodes, additional_source_nodes, **kwargs)

    async def asynthesize(self, query: QueryType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **kwargs: Any) -> RESPONSE_TYPE:
        if not nodes:
            return await super().asynthesize(query, nodes, additional_source_nodes, **kwargs)
        # Decoding blocks for seconds: in a worker thread, so the event loop keeps running.
        return await asyncio.to_thread(self._respond, query, nodes, additional_source_nodes, **kwargs)

    # BaseSynthesizer's text-chunk interface: there are no entries behind bare text, so these read the
    # chunks as a plain prompt (what a default synthesizer would do), through the same LLM.
    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        context = "\n\n".join(text_chunks)
        return self._kv_llm.complete(f"Context:\n{context}\n\nQuestion: {query_str}", route=False, **kwargs).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        context = "\n\n".join(text_chunks)
        resp = await self._kv_llm.acomplete(f"Context:\n{context}\n\nQuestion: {query_str}", route=False, **kwargs)
        return resp.text


__all__ = ["KVGraftSynthesizer", "REPORT_METADATA_KEY"]
