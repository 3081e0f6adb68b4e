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

It is a `FunctionCallingLLM`, so `FunctionAgent`, `AgentWorkflow`, `predict_and_call` and
`structured_predict` run on it. A call with tools goes through `kvmemory.run_chat`, the very call
LangChain's `ChatKVGraft` makes: the tools are described in the system turn, a required call
(`tool_required`, a `tool_choice`, or the request's `tool_policy`) is written by the model under the
tool's JSON schema (`kvmemory.call_tool`: the model picks the tool by likelihood and decodes every
argument value), an unforced user turn follows the tool policy, and after a tool result the model
answers unless another call is clearly likelier (`kvmemory.adapters.after_tool`). Structured
output (`structured_predict`, `as_structured_llm`) is LlamaIndex's own `FunctionCallingProgram`: a
required call to a tool whose schema is the output class, so its fields are decoded under the schema's
guidance instead of the model echoing the schema.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from collections.abc import Sequence
from contextlib import aclosing, closing
from typing import Any

from kvmemory import (DEFAULT_MODEL, Answer, ChatOutcome, ChatRequest, EntryRecord, InvalidInput, KVMemory, Recalled,
                      StreamChunk, astream_text, borrow_memory, count_chat_tokens, count_tokens, max_tokens_option,
                      memory_lock, normalize_tool_choice, prompt_text, run_chat, sampling_option,
                      stream_text)
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
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, ValidationError
from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from llama_index.llms.kvgraft.messages import openai_tool_calls, to_kv_messages, tool_call_blocks, tool_selections
from llama_index.llms.kvgraft.tokens import KVGraftTokenizer

# Keys of the report copied into every response's additional_kwargs.
REPORT_KEYS = ("tokens_total", "tokens_grafted", "tokens_computed", "tokens_decoded", "bytes_read",
               "blocks_stored")
# Per-call keyword arguments this LLM understands; others (LlamaIndex passes some, e.g. `formatted`)
# are ignored, as other LlamaIndex LLMs do.
_CALL_KEYS = {"max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "route",
              "k", "similarity_top_k", "namespace", "threshold", "tools", "tool_choice", "tool_policy"}
# The keys of a tool call's DecodeStats (kvmemory.run_chat) copied into additional_kwargs.
OUTCOME_KEYS = ("prompt_tokens_grafted", "passes", "tokens_grafted", "tokens_computed", "tokens_decoded",
                "tokens_forced", "bytes_read", "blocks_stored", "stopped_by")


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


def outcome_kwargs(out: ChatOutcome) -> dict[str, Any]:
    """What a response to a call with tools carries: every pass's token counts (a forced tool call
    takes several: the tool's pick, each argument), the entries routed, how it finished."""
    stats = out.stats.to_json()
    kw: dict[str, Any] = {k: stats[k] for k in OUTCOME_KEYS}
    generated = out.stats.tokens_decoded + out.stats.tokens_forced
    kw.update(
        entries=[h.entry.id for h in out.hits],
        scores=[float(h.score) for h in out.hits],
        attestations=[h.entry.attestation.get("attestation_id") for h in out.hits],
        verified=[h.entry.verified for h in out.hits],
        finish_reason=out.finish_reason,
        invalid_tool_calls=list(out.invalid_tool_calls),
        seconds=stats["seconds"],
        # The keys LlamaIndex's token counting reads: the prompt once, and every token written after it.
        prompt_tokens=out.stats.prompt_tokens,
        completion_tokens=generated,
        total_tokens=out.stats.prompt_tokens + generated,
    )
    return kw


def checked_messages(fn):
    """Refuse bad `messages` with kvmemory's typed error before LlamaIndex's callback wrapper sees them
    (its start event would refuse a non-list with pydantic's ValidationError instead)."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def acall(self, messages, **kwargs):
            to_kv_messages(messages, self.tool_role)
            return await fn(self, messages, **kwargs)

        return acall

    @functools.wraps(fn)
    def call(self, messages, **kwargs):
        to_kv_messages(messages, self.tool_role)
        return fn(self, messages, **kwargs)

    return call


class KVGraftLLM(FunctionCallingLLM):
    """A frozen HF model (the embedded SmolLM2 by default) answering with grafted KV from kvmemory.

    Pass a shared `memory` (`kvmemory.KVMemory`), or `model` / `store` to open one (one per
    (model, store, device, dtype) per process); `device` ("auto", "cpu", "cuda", "cuda:N"; "auto" takes
    a GPU where one and kvmemory's CUDA graft kernel are usable, the embedded model stays on the CPU) and
    `dtype` ("auto": the checkpoint's on the CPU, bfloat16 on a GPU) say where and in what it runs.
    """

    model: str = Field(default=DEFAULT_MODEL,
                       description="Model the memory was opened with (HF id, local path or embedded:...).")
    # Ranges are checked by kvmemory's shared checks (`_options`), the same on every integration.
    max_new_tokens: int = Field(default=256, description="Most tokens decoded per call (a positive integer).")
    temperature: float = Field(default=0.0, description="0 decodes greedily (exact and repeatable).")
    top_p: float = Field(default=1.0, description="Nucleus sampling cut, in (0, 1].")
    top_k: int = Field(default=0, description="Top-k cut (0: none).")
    seed: int = Field(default=0, description="Seed of the sampler when temperature > 0.")
    stop: list[str] = Field(default_factory=list, description="Decoding stops at (and cuts) any of these.")
    route: bool = Field(default=True, description="Route the last user message to stored verified solutions.")
    similarity_top_k: int = Field(default=1, description="At most this many routed solutions per call.")
    namespace: str | None = Field(default=None, description="Namespace routed in (default: the memory's).")
    threshold: float | None = Field(default=None, description="Routing threshold (default: calibrated).")
    tool_role: str = Field(default="tool", description=(
        "Chat-template role of TOOL / FUNCTION messages; 'user' for templates that refuse other roles "
        "(then routing follows the latest tool output instead of the question)."))
    tool_policy: str | None = Field(default=None, description=(
        "What a user turn with tools bound and no required call does (kvmemory.ChatRequest.tool_policy: "
        "'scored' (the default) calls a tool when the model's likelihood of the call clears a margin, "
        "'model' only when its free output begins one, 'user_turn' always calls a tool); after a tool "
        "result every policy answers, stating the result, unless another call is clearly likelier "
        "(kvmemory.adapters.after_tool). None: kvmemory's default, the same as LangChain's ChatKVGraft."))
    cache_prefixes: bool = Field(default=True, description=(
        "Store the blocks of a system turn (with its tool descriptions) the first time it is computed, "
        "so later calls graft it."))

    _memory: KVMemory = PrivateAttr()
    _last: Answer | None = PrivateAttr(default=None)
    _last_outcome: ChatOutcome | None = PrivateAttr(default=None)

    def __init__(self, memory: KVMemory | None = None, *, store: str | os.PathLike[str] | None = None,
                 callback_manager: CallbackManager | None = None, device: str = "auto", dtype: str = "auto",
                 **kwargs: Any) -> None:
        if memory is not None and not isinstance(memory, KVMemory):
            raise TypeError(f"memory must be a kvmemory.KVMemory, got {type(memory).__name__}")
        if memory is not None and "model" not in kwargs:
            kwargs["model"] = memory.engine.loaded.source
        try:
            super().__init__(callback_manager=callback_manager, **kwargs)
        except ValidationError as exc:
            # pydantic's error for a field of the wrong type, as kvmemory's typed one (both ValueErrors).
            raise InvalidInput(f"KVGraftLLM: {exc}") from exc
        self._options({})  # the fields' values, checked as a call's are (before the model is loaded)
        self._memory = borrow_memory(memory, self.model, store, device=device, dtype=dtype).memory

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
            is_function_calling_model=True,
            model_name=str(eng.loaded.source),
        )

    @property
    def last_answer(self) -> Answer | None:
        """The last call's `kvmemory` answer (text, token ids, graft report, entries), if any (calls
        without tools)."""
        return self._last

    # ------------------------------------------------------------------ token counting
    @property
    def tokenizer(self) -> KVGraftTokenizer:
        """LlamaIndex's tokenizer hook (`text -> token ids`) with this model's own tokenizer:
        `Settings.tokenizer = llm.tokenizer`, or `tokenizer_fn=llm.tokenizer` for a memory's token_limit."""
        return KVGraftTokenizer(self._memory.engine.tokenizer)

    def count_tokens(self, text: str) -> int:
        """How many tokens `text` is for this model."""
        return count_tokens(self._memory.engine.tokenizer, text)

    def count_message_tokens(self, messages: Sequence[ChatMessage], tools: Sequence[Any] = ()) -> int:
        """How many tokens the model reads for `messages` (with `tools` described in the system turn, as
        a call with tools puts them), rendered by the chat template with the assistant turn opened: the
        prompt of a call that routes nothing."""
        opts = self._tool_options({"tools": tools})
        return count_chat_tokens(self._memory.engine.tokenizer, to_kv_messages(messages, self.tool_role),
                                 tools=opts["tools"])

    @property
    def last_outcome(self) -> ChatOutcome | None:
        """The last call with tools: its text, tool calls, routed entries and every pass's counts."""
        return self._last_outcome

    # ------------------------------------------------------------------ the one code path
    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's options: its keyword arguments over the fields, each checked by kvmemory's shared
        checks (`max_tokens_option`, `sampling_option`), so bad values are refused with InvalidInput
        exactly as LangChain's ChatKVGraft refuses them."""
        # None means "not given" (LlamaIndex components pass e.g. max_tokens=None through).
        kw = {k: v for k, v in kwargs.items() if k in _CALL_KEYS and v is not None}
        if "max_new_tokens" in kw:
            max_new = max_tokens_option(kw["max_new_tokens"], "max_new_tokens")
        elif "max_tokens" in kw:
            max_new = max_tokens_option(kw["max_tokens"], "max_tokens")
        else:
            max_new = max_tokens_option(self.max_new_tokens, "max_new_tokens")
        stop = kw.get("stop", self.stop)
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise InvalidInput(f"stop must be a string or a list of strings, got {stop!r}")
        sampling = sampling_option(kw.get("temperature", self.temperature), kw.get("top_p", self.top_p),
                                   kw.get("top_k", self.top_k), kw.get("seed", self.seed))
        k = kw.get("k", kw.get("similarity_top_k", self.similarity_top_k))
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidInput(f"similarity_top_k (k) must be a positive integer, got {k!r}")
        route = kw.get("route", self.route)
        if not isinstance(route, bool):
            raise InvalidInput(f"route must be True or False, got {route!r}")
        namespace = kw.get("namespace", self.namespace)
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidInput(f"namespace must be a string, got {type(namespace).__name__}")
        threshold = kw.get("threshold", self.threshold)
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise InvalidInput(f"threshold must be a number, got {threshold!r}")
        return {
            "max_new_tokens": max_new,
            "sampling": sampling,
            "stop": [s for s in stop if s],
            "route": route,
            "k": k,
            "namespace": namespace,
            "threshold": threshold,
            **self._tool_options(kw),
        }

    def _tool_options(self, kw: dict[str, Any]) -> dict[str, Any]:
        """The call's tools as OpenAI tool dicts (LlamaIndex tools are converted), its tool_choice in
        kvmemory's spelling ("auto", "none", "any" or a tool's name) and its tool policy."""
        tools = []
        for t in kw.get("tools") or ():
            meta = getattr(t, "metadata", None)
            if callable(getattr(meta, "to_openai_tool", None)):
                tools.append(meta.to_openai_tool(skip_length_check=True))
            elif isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name"):
                tools.append(t)
            else:
                raise InvalidInput(f"tools must be LlamaIndex tools or OpenAI tool dicts, got {type(t).__name__}")
        choice = kw.get("tool_choice")
        if not tools and choice in (None, "auto", "none"):
            return {"tools": [], "tool_choice": "auto", "tool_policy": None}
        # A required call with no tools bound, or a name no bound tool has: ToolChoiceError.
        choice = normalize_tool_choice(choice, [t["function"]["name"] for t in tools])
        # The policy is checked where it is applied (kvmemory.run_chat), as for LangChain's ChatKVGraft.
        return {"tools": tools, "tool_choice": choice, "tool_policy": kw.get("tool_policy", self.tool_policy)}

    def _run_chat(self, messages: Sequence[ChatMessage], opts: dict[str, Any], on_text=None) -> Answer:
        msgs = to_kv_messages(messages, self.tool_role)
        with memory_lock(self._memory):
            ans = self._memory.chat(msgs, route=opts["route"], k=opts["k"], namespace=opts["namespace"],
                                    threshold=opts["threshold"], max_new_tokens=opts["max_new_tokens"],
                                    sampling=opts["sampling"], stop=opts["stop"], on_text=on_text)
        self._last = ans
        return ans

    def _tool_request(self, messages: Sequence[ChatMessage], opts: dict[str, Any]) -> ChatRequest:
        """The call with tools as `kvmemory.run_chat` takes it (the request LangChain's ChatKVGraft builds)."""
        extra = {"tool_policy": opts["tool_policy"]} if opts["tool_policy"] is not None else {}
        return ChatRequest(turns=to_kv_messages(messages, self.tool_role), tools=opts["tools"],
                           tool_choice=opts["tool_choice"], stop=opts["stop"], max_tokens=opts["max_new_tokens"],
                           sampling=opts["sampling"], namespace=opts["namespace"], route=opts["route"], k=opts["k"],
                           threshold=opts["threshold"], cache_prefixes=self.cache_prefixes, **extra)

    def _run_tools(self, request: ChatRequest, on_text=None) -> ChatOutcome:
        out = run_chat(borrow_memory(self._memory), request, on_text)
        self._last_outcome = out
        return out

    def _run_completion(self, prompt: str, formatted: bool, opts: dict[str, Any], on_text=None) -> Answer:
        if not formatted:
            return self._run_chat([ChatMessage(role=MessageRole.USER, content=prompt)], opts, on_text)
        mem = self._memory
        if not prompt:
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

    @staticmethod
    def _outcome_response(out: ChatOutcome, delta: str | None = None) -> ChatResponse:
        # The tool calls ride in the message as ToolCallBlocks, where LlamaIndex's agents look for them
        # (and where they are replayed from on the next turn), and in OpenAI's spelling in
        # additional_kwargs["tool_calls"], where LlamaIndex's streaming structured output looks.
        message = ChatMessage(role=MessageRole.ASSISTANT,
                              blocks=[TextBlock(text=out.text), *tool_call_blocks(out.tool_calls)],
                              additional_kwargs={"tool_calls": openai_tool_calls(out.tool_calls)}
                              if out.tool_calls else {})
        raw = {"text": out.text, "tool_calls": out.tool_calls, "invalid_tool_calls": out.invalid_tool_calls,
               "finish_reason": out.finish_reason, **out.provenance()}
        return ChatResponse(message=message, raw=raw, delta=delta, additional_kwargs=outcome_kwargs(out))

    # ------------------------------------------------------------------ function calling
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: Any = None, **kwargs: Any) -> dict[str, Any]:
        """`chat`'s arguments for a turn with `tools`. `tool_required` (or a `tool_choice` naming a tool,
        or "required") makes the model write a call under the tool's schema. A turn makes at most one
        call, so `allow_parallel_tool_calls` changes nothing."""
        del verbose, allow_parallel_tool_calls
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        if tool_choice is None:
            tool_choice = "required" if tool_required else "auto"
        return {"messages": messages, "tools": list(tools), "tool_choice": tool_choice, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The tool calls in `response` (a valid call only: one the model wrote for an unknown tool, or
        with arguments that are not an object, is in `additional_kwargs["invalid_tool_calls"]`)."""
        calls = tool_selections(response)
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call in the response, got none: {response.message.content!r}")
        return calls

    # ------------------------------------------------------------------ LlamaIndex endpoints
    @checked_messages
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        opts = self._options(kwargs)
        if opts["tools"]:
            return self._outcome_response(self._run_tools(self._tool_request(messages, opts)))
        return self._chat_response(self._run_chat(messages, opts))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        prompt = prompt_text(prompt)  # None, bytes, a number: InvalidInput, before the model
        return self._completion_response(self._run_completion(prompt, formatted, self._options(kwargs)))

    def _chat_chunk(self, chunk: StreamChunk[Answer | ChatOutcome]) -> ChatResponse:
        if chunk.result is None:
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=chunk.text), delta=chunk.delta)
        # The last chunk: the final text and the report (and the tool calls of a call with tools).
        if isinstance(chunk.result, ChatOutcome):
            return self._outcome_response(chunk.result, delta=chunk.delta)
        return self._chat_response(chunk.result, delta=chunk.delta)

    def _chat_work(self, messages: Sequence[ChatMessage], opts: dict[str, Any]):
        """A chat call as a streamable unit of work, and where its streamed text stops being the answer."""
        if opts["tools"]:
            request = self._tool_request(messages, opts)
            return (lambda on_text: self._run_tools(request, on_text)), request.held_back
        to_kv_messages(messages, self.tool_role)  # bad messages are refused here, not in the worker thread
        return (lambda on_text: self._run_chat(messages, opts, on_text)), opts["stop"]

    def _completion_chunk(self, chunk: StreamChunk[Answer]) -> CompletionResponse:
        if chunk.result is None:
            return CompletionResponse(text=chunk.text, delta=chunk.delta)
        return self._completion_response(chunk.result, delta=chunk.delta)

    @checked_messages
    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        opts = self._options(kwargs)

        work, held_back = self._chat_work(messages, opts)

        def gen() -> ChatResponseGen:
            # Decoding runs in a worker thread; closing this generator stops it (and frees the memory).
            with closing(stream_text(work, held_back)) as chunks:
                for chunk in chunks:
                    yield self._chat_chunk(chunk)

        return gen()

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        prompt = prompt_text(prompt)  # None, bytes, a number: InvalidInput, before the model
        opts = self._options(kwargs)

        def gen() -> CompletionResponseGen:
            with closing(stream_text(lambda on_text: self._run_completion(prompt, formatted, opts, on_text),
                                     opts["stop"])) as chunks:
                for chunk in chunks:
                    yield self._completion_chunk(chunk)

        return gen()

    @checked_messages
    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        # Decoding blocks for seconds: do it in a worker thread so the event loop keeps running.
        opts = self._options(kwargs)
        if opts["tools"]:
            request = self._tool_request(messages, opts)
            return self._outcome_response(await asyncio.to_thread(self._run_tools, request))
        return self._chat_response(await asyncio.to_thread(self._run_chat, messages, opts))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        prompt = prompt_text(prompt)  # None, bytes, a number: InvalidInput, before the model
        ans = await asyncio.to_thread(self._run_completion, prompt, formatted, self._options(kwargs))
        return self._completion_response(ans)

    @checked_messages
    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        opts = self._options(kwargs)

        work, held_back = self._chat_work(messages, opts)

        async def gen() -> ChatResponseAsyncGen:
            # Cancelling the consuming task (or closing this generator) stops the decode.
            async with aclosing(astream_text(work, held_back)) as chunks:
                async for chunk in chunks:
                    yield self._chat_chunk(chunk)

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        prompt = prompt_text(prompt)  # None, bytes, a number: InvalidInput, before the model
        opts = self._options(kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async with aclosing(astream_text(lambda on_text: self._run_completion(prompt, formatted, opts, on_text),
                                             opts["stop"])) as chunks:
                async for chunk in chunks:
                    yield self._completion_chunk(chunk)

        return gen()


# LlamaIndex names an LLM integration's class after the provider (`OpenAI`, `Ollama`); both work.
KVGraft = KVGraftLLM
