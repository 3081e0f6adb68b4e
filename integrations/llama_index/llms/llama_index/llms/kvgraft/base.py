"""`KVGraftLLM`: LlamaIndex's `LLM` over a frozen Hugging Face model that grafts stored KV.

Every call goes through `KVMemory.chat`: the last user message is routed to stored verified
solutions (unless `route=False`), they are put before the conversation, the longest stored chain of
KV blocks is grafted at its own positions and only the rest is computed before decoding. Each
response says where its tokens came from: `additional_kwargs` holds `tokens_grafted`,
`tokens_computed`, `tokens_decoded` (plus the entries, scores, attestation ids and verified flags it
used), and `raw` holds the whole report.

`complete(prompt)` is one user turn through the model's chat template; `complete(prompt,
formatted=True)` continues the prompt text as it is (no template, no routing), still grafting any
stored prefix of it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from contextlib import aclosing, closing
from typing import Any

from kvmemory import (DEFAULT_MODEL, Answer, EntryRecord, InvalidInput, KVMemory, Message, Recalled, Sampling,
                      StreamChunk,
                      astream_text, memory_lock, shared_memory, stream_text, to_turns)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

# Keys of the report copied into every response's additional_kwargs.
REPORT_KEYS = ("tokens_total", "tokens_grafted", "tokens_computed", "tokens_decoded", "bytes_read",
               "blocks_stored")
# Per-call keyword arguments this LLM understands; others (LlamaIndex passes some, e.g. `formatted`)
# are ignored, as other LlamaIndex LLMs do.
_CALL_KEYS = {"max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "route",
              "k", "similarity_top_k", "namespace", "threshold"}


def to_kv_messages(messages: Sequence[ChatMessage], tool_role: str = "tool") -> list[dict[str, str]]:
    """LlamaIndex chat messages as chat-template turns (`kvmemory.to_turns`: the text of each message,
    system messages merged into one leading turn). Tool output keeps its own role (`tool_role`):
    kvmemory routes on the last *user* message, so an observation sent as a user turn would replace the
    question as what is routed."""
    return to_turns([Message(m.role.value if isinstance(m.role, MessageRole) else str(m.role), m.content or "")
                     for m in messages], tool_role)


def answer_kwargs(ans: Answer) -> dict[str, Any]:
    """What a response carries about its answer: token provenance, entries used, how it stopped."""
    report = ans.report.to_json()
    out: dict[str, Any] = {k: report[k] for k in REPORT_KEYS}
    prompt_tokens = ans.report.tokens_grafted + ans.report.tokens_computed
    out.update(
        entries=list(ans.entries),
        scores=[float(s) for s in ans.scores],
        attestations=list(ans.attestations),
        verified=list(ans.verified),
        stopped_by=ans.stopped_by,
        seconds=ans.seconds,
        # The keys LlamaIndex's token counting reads.
        prompt_tokens=prompt_tokens,
        completion_tokens=ans.report.tokens_decoded,
        total_tokens=prompt_tokens + ans.report.tokens_decoded,
    )
    return out


class KVGraftLLM(LLM):
    """A frozen HF model (the embedded SmolLM2 by default) answering with grafted KV from kvmemory.

    Pass a shared `memory` (`kvmemory.KVMemory`), or `model` / `store` to open one (one per
    (model, store) per process).
    """

    model: str = Field(default=DEFAULT_MODEL,
                       description="Model the memory was opened with (HF id, local path or embedded:...).")
    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens decoded per call.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 decodes greedily (exact and repeatable).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int = Field(default=0, description="Seed of the sampler when temperature > 0.")
    stop: list[str] = Field(default_factory=list, description="Decoding stops at (and cuts) any of these.")
    route: bool = Field(default=True, description="Route the last user message to stored verified solutions.")
    similarity_top_k: int = Field(default=1, ge=1, description="At most this many routed solutions per call.")
    namespace: str | None = Field(default=None, description="Namespace routed in (default: the memory's).")
    threshold: float | None = Field(default=None, description="Routing threshold (default: calibrated).")
    tool_role: str = Field(default="tool", description=(
        "Chat-template role of TOOL / FUNCTION messages; 'user' for templates that refuse other roles "
        "(then routing follows the latest tool output instead of the question)."))

    _memory: KVMemory = PrivateAttr()
    _last: Answer | None = PrivateAttr(default=None)

    def __init__(self, memory: KVMemory | None = None, *, store: str | os.PathLike[str] | None = None,
                 callback_manager: CallbackManager | None = None, **kwargs: Any) -> None:
        if memory is not None and not isinstance(memory, KVMemory):
            raise TypeError(f"memory must be a kvmemory.KVMemory, got {type(memory).__name__}")
        if memory is not None and "model" not in kwargs:
            kwargs["model"] = memory.engine.loaded.source
        super().__init__(callback_manager=callback_manager, **kwargs)
        self._memory = memory if memory is not None else shared_memory(self.model, store)

    @classmethod
    def class_name(cls) -> str:
        return "KVGraftLLM"

    @property
    def memory(self) -> KVMemory:
        return self._memory

    @property
    def metadata(self) -> LLMMetadata:
        eng = self._memory.engine
        return LLMMetadata(
            context_window=int(eng.runner.max_positions),
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=str(eng.loaded.source),
        )

    @property
    def last_answer(self) -> Answer | None:
        """The last call's `kvmemory` answer (text, token ids, graft report, entries), if any."""
        return self._last

    # ------------------------------------------------------------------ the one code path
    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        # None means "not given" (LlamaIndex components pass e.g. max_tokens=None through).
        kw = {k: v for k, v in kwargs.items() if k in _CALL_KEYS and v is not None}
        max_new = kw.get("max_new_tokens", kw.get("max_tokens", self.max_new_tokens))
        stop = kw.get("stop", self.stop)
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        sampling = Sampling(temperature=float(kw.get("temperature", self.temperature)),
                            top_p=float(kw.get("top_p", self.top_p)), top_k=int(kw.get("top_k", self.top_k)),
                            seed=int(kw.get("seed", self.seed)))
        return {
            "max_new_tokens": int(max_new),
            "sampling": sampling,
            "stop": [s for s in stop if s],
            "route": bool(kw.get("route", self.route)),
            "k": int(kw.get("k", kw.get("similarity_top_k", self.similarity_top_k))),
            "namespace": kw.get("namespace", self.namespace),
            "threshold": kw.get("threshold", self.threshold),
        }

    def _run_chat(self, messages: Sequence[ChatMessage], opts: dict[str, Any], on_text=None) -> Answer:
        msgs = to_kv_messages(messages, self.tool_role)
        with memory_lock(self._memory):
            ans = self._memory.chat(msgs, route=opts["route"], k=opts["k"], namespace=opts["namespace"],
                                    threshold=opts["threshold"], max_new_tokens=opts["max_new_tokens"],
                                    sampling=opts["sampling"], stop=opts["stop"], on_text=on_text)
        self._last = ans
        return ans

    def _run_completion(self, prompt: str, formatted: bool, opts: dict[str, Any], on_text=None) -> Answer:
        if not formatted:
            return self._run_chat([ChatMessage(role=MessageRole.USER, content=prompt)], opts, on_text)
        mem = self._memory
        if not isinstance(prompt, str) or not prompt:
            raise InvalidInput("empty prompt: give the model something to continue")
        with memory_lock(mem):
            ids = mem.engine.encode(prompt)
            ans = mem.generate(ids, max_new_tokens=opts["max_new_tokens"], sampling=opts["sampling"],
                               stop=opts["stop"], on_text=on_text)
        self._last = ans
        return ans

    def answer_entries(self, question: str, entries: Sequence[EntryRecord], *, scores: Sequence[float] = (),
                       answer_prefix: str | None = None, choices: str | Sequence[str] | None = None,
                       on_text=None, **kwargs: Any) -> Answer:
        """Answer `question` after the given entries (e.g. the nodes a retriever returned), without
        routing: the first entry's stored KV is grafted, the rest and the question computed.
        `answer_prefix` (e.g. "The answer is") starts the assistant's turn; `choices` ("numbers", or a
        list of strings) makes the model pick its answer by likelihood instead of decoding it
        (`KVMemory.answer`'s reliable mode for a small model)."""
        opts = self._options(kwargs)
        mem = self._memory
        if not isinstance(question, str) or not question.strip():
            raise InvalidInput("empty question: ask something about the entries")
        if not entries:
            raise InvalidInput("no entries to answer from")
        scores = list(scores) + [0.0] * (len(entries) - len(scores))
        hits = [Recalled(e, float(s), e.problem) for e, s in zip(entries, scores)]
        with memory_lock(mem):
            ans = mem.answer_from(question, hits, max_new_tokens=opts["max_new_tokens"], sampling=opts["sampling"],
                                  stop=opts["stop"], on_text=on_text, answer_prefix=answer_prefix, choices=choices)
        self._last = ans
        return ans

    @staticmethod
    def _chat_response(ans: Answer, delta: str | None = None) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=ans.text), raw=ans.to_json(),
                            delta=delta, additional_kwargs=answer_kwargs(ans))

    @staticmethod
    def _completion_response(ans: Answer, delta: str | None = None) -> CompletionResponse:
        return CompletionResponse(text=ans.text, raw=ans.to_json(), delta=delta, additional_kwargs=answer_kwargs(ans))

    # ------------------------------------------------------------------ LlamaIndex endpoints
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat_response(self._run_chat(messages, self._options(kwargs)))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion_response(self._run_completion(prompt, formatted, self._options(kwargs)))

    def _chat_chunk(self, chunk: StreamChunk[Answer]) -> ChatResponse:
        if chunk.result is None:
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=chunk.text), delta=chunk.delta)
        return self._chat_response(chunk.result, delta=chunk.delta)  # the last chunk: the final text and the report

    def _completion_chunk(self, chunk: StreamChunk[Answer]) -> CompletionResponse:
        if chunk.result is None:
            return CompletionResponse(text=chunk.text, delta=chunk.delta)
        return self._completion_response(chunk.result, delta=chunk.delta)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        opts = self._options(kwargs)

        def gen() -> ChatResponseGen:
            # Decoding runs in a worker thread; closing this generator stops it (and frees the memory).
            with closing(stream_text(lambda on_text: self._run_chat(messages, opts, on_text), opts["stop"])) as chunks:
                for chunk in chunks:
                    yield self._chat_chunk(chunk)

        return gen()

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        opts = self._options(kwargs)

        def gen() -> CompletionResponseGen:
            with closing(stream_text(lambda on_text: self._run_completion(prompt, formatted, opts, on_text),
                                     opts["stop"])) as chunks:
                for chunk in chunks:
                    yield self._completion_chunk(chunk)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        # Decoding blocks for seconds: do it in a worker thread so the event loop keeps running.
        ans = await asyncio.to_thread(self._run_chat, messages, self._options(kwargs))
        return self._chat_response(ans)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        ans = await asyncio.to_thread(self._run_completion, prompt, formatted, self._options(kwargs))
        return self._completion_response(ans)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        opts = self._options(kwargs)

        async def gen() -> ChatResponseAsyncGen:
            # Cancelling the consuming task (or closing this generator) stops the decode.
            async with aclosing(astream_text(lambda on_text: self._run_chat(messages, opts, on_text),
                                             opts["stop"])) as chunks:
                async for chunk in chunks:
                    yield self._chat_chunk(chunk)

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        opts = self._options(kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async with aclosing(astream_text(lambda on_text: self._run_completion(prompt, formatted, opts, on_text),
                                             opts["stop"])) as chunks:
                async for chunk in chunks:
                    yield self._completion_chunk(chunk)

        return gen()


# LlamaIndex names an LLM integration's class after the provider (`OpenAI`, `Ollama`); both work.
KVGraft = KVGraftLLM
