"""OpenAI's chat / completion requests as kvmemory calls, and kvmemory's outcomes as OpenAI responses.

Requests (pydantic models, so FastAPI documents them) accept what the official clients send and
refuse, with a 400 naming the field, what this server cannot honour rather than ignoring it:
`n` > 1, `logprobs`, penalties, `logit_bias`, images and audio in messages. `response_format` takes
`json_schema` (the guided decoder writes JSON that follows it) and `json_object` (any JSON object: the
model writes the keys and values, the guide the punctuation, adapters/open_json.py); a field that is not OpenAI's (nor `kvmemory`) is a 400 too, and OpenAI's
fields that would change nothing here are accepted (openai_fields.py). Decoding: `temperature` 0 or
omitted is greedy (the default here, not OpenAI's 1.0: answers from verified memory should be
reproducible); with a temperature, `top_p` and `seed` (default 0) give seeded, reproducible sampling.

kvmemory's own options ride in the body as `kvmemory` (the `openai` client's `extra_body`) or as
headers (`X-KVMemory-User-Id`, `-Agent-Id`, `-Run-Id`, `-Namespace`):

    {"kvmemory": {"memory": true,    # route the last user turn to verified entries in the scope
                  "cache": true,     # store this prompt's grid blocks, so the next turn grafts them
                  "k": 1, "threshold": null, "tool_policy": "scored",
                  "user_id": "alice", "agent_id": null, "run_id": null, "namespace": null}}

Responses are OpenAI's, plus what kvmemory did: `usage.prompt_tokens_details.cached_tokens` is the
number of prompt tokens grafted from the store (not recomputed), `system_fingerprint` names the
execution profile, and a `kvmemory` object lists the routed entries (id, score, verified,
attestation id), the scope's namespace and the tokens grafted / computed / decoded over every
decoding pass (a JSON schema or a forced tool call takes several; `adapters.guided`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmemory.adapters.chat import ChatOutcome, ChatRequest
from kvmemory.adapters.messages import Message, normalize_tool_choice, to_turns
from kvmemory.engine.runner import Sampling
from kvmemory.server.errors import ApiError
from kvmemory.server.openai_fields import check_extra_fields

SCOPE_HEADERS = {"user_id": "x-kvmemory-user-id", "agent_id": "x-kvmemory-agent-id",
                 "run_id": "x-kvmemory-run-id", "namespace": "x-kvmemory-namespace"}
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
MAX_STOP = 4
MAX_TOOLS = 64


class KVMemoryOptions(BaseModel):
    """The `kvmemory` object of a request (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    memory: bool = True
    cache: bool = True
    k: int = Field(1, ge=1, le=8)
    threshold: float | None = Field(None, ge=-1.0, le=1.0)
    # What an unforced call with tools does on a user turn: "scored" (kvmemory's default, as in the
    # LangChain and LlamaIndex integrations: the model's likelihood of each call decides, see
    # adapters/chat.py), "model" (only a call the model writes by itself), "user_turn" (always a call).
    tool_policy: Literal["scored", "model", "user_turn"] = "scored"
    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    namespace: str | None = None


class _Common(BaseModel):
    # Fields not declared here land in `model_extra` and are checked by openai_fields.py: OpenAI's
    # fields that change nothing here are accepted, anything else is a 400 naming it.
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    kvmemory: KVMemoryOptions | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one tool call (the first the model wrote)
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


# ---------------------------------------------------------------------- requests
def _refuse_unsupported(body: _Common) -> None:
    if body.n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported: send one request per completion", param="n")
    if body.logprobs not in (None, False):
        raise ApiError(400, "logprobs are not returned by this server", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (the canonical runner decodes without penalties)", param=name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")


def options_of(body: _Common) -> KVMemoryOptions:
    return body.kvmemory or KVMemoryOptions()


def scope_fields(body: _Common, headers) -> dict[str, str]:
    """The scope a request names: its `kvmemory` fields, else the X-KVMemory-* headers."""
    opts = options_of(body)
    from_body = {k: getattr(opts, k) for k in SCOPE_HEADERS if getattr(opts, k) is not None}
    if from_body:
        return from_body
    return {k: headers[h] for k, h in SCOPE_HEADERS.items() if headers.get(h)}


def sampling_of(body: _Common) -> Sampling:
    t = body.temperature or 0.0
    return Sampling(temperature=float(t), top_p=float(body.top_p if body.top_p is not None else 1.0),
                    seed=int(body.seed or 0))


def stops_of(body: _Common) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in stop):
        raise ApiError(400, f"stop takes up to {MAX_STOP} non-empty strings", param="stop")
    return stop


def max_tokens_of(requested: int | None, default: int, limit: int) -> int:
    n = requested if requested is not None else min(default, limit)
    if n > limit:
        raise ApiError(400, f"max_tokens is {n}; this server decodes at most {limit} tokens per call "
                       "(kvmemory serve --max-tokens-limit)", param="max_tokens", code="max_tokens_exceeded")
    return n


def _messages(raw: list[dict[str, Any]]) -> list[Message]:
    out = []
    for i, m in enumerate(raw):
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}", param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, f"messages[{i}].content must be text or a list of content parts", param=f"messages[{i}].content")
        calls = []
        for j, tc in enumerate(m.get("tool_calls") or []):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs function.name", param=f"messages[{i}].tool_calls")
            args = fn.get("arguments") or "{}"
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                               param=f"messages[{i}].tool_calls") from None
            calls.append((fn["name"], parsed if isinstance(parsed, dict) else {"value": parsed}))
        out.append(Message(role=role, content=content or "", tool_calls=tuple(calls)))
    return out


def _tools(raw: list[dict[str, Any]] | None) -> list[dict]:
    tools = list(raw or [])
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools per request", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                           param=f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}]")
    return tools


JSON_OBJECT = {"type": "object"}  # response_format json_object: an open object (adapters/open_json.py)


def _schema(fmt: dict[str, Any] | None) -> dict | None:
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object", param="response_format")
        return schema
    if fmt.get("type") == "json_object":  # any JSON object: the guided decoder lets the model write the keys
        return dict(JSON_OBJECT)
    raise ApiError(400, f"unknown response_format type {fmt.get('type')!r}", param="response_format")


def chat_request(body: ChatCompletionRequest, limits) -> ChatRequest:
    """The adapter call a chat completion request asks for (without its namespace: the route sets it
    from the scope the key may use)."""
    check_extra_fields(body.model_extra, route="chat")
    _refuse_unsupported(body)
    if body.top_logprobs:
        raise ApiError(400, "top_logprobs are not returned by this server", param="top_logprobs")
    opts = options_of(body)
    tools = _tools(body.tools)
    names = [t["function"]["name"] for t in tools]
    choice = normalize_tool_choice(body.tool_choice, names) if tools or body.tool_choice not in (None, "auto", "none") else "auto"
    turns = to_turns(_messages(body.messages))
    if not turns:
        raise ApiError(400, "messages hold no turn for the model (only empty system messages?)", param="messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return ChatRequest(
        turns=turns, tools=tools, tool_choice=choice, tool_policy=opts.tool_policy,
        response_schema=_schema(body.response_format), stop=stops_of(body),
        max_tokens=max_tokens_of(requested, limits.default_max_tokens, limits.max_tokens_limit),
        sampling=sampling_of(body), route=opts.memory, k=opts.k, threshold=opts.threshold,
        store_blocks=opts.cache,
    )


def completion_prompt(body: CompletionRequest) -> str:
    check_extra_fields(body.model_extra, route="completions")
    _refuse_unsupported(body)
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
    if body.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported", param="best_of")
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError(400, "prompt must be one string (batches and token arrays are not supported)", param="prompt")
        prompt = prompt[0]
    if not prompt.strip():
        raise ApiError(400, "prompt is empty", param="prompt")
    return prompt


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def fingerprint(profile_id: str) -> str:
    return "kvm-" + profile_id[:16]


def one_tool_call(outcome: ChatOutcome) -> ChatOutcome:
    """`parallel_tool_calls: false`: keep only the first call the model wrote (what a model held to
    one call would have stopped after)."""
    calls = [*outcome.tool_calls, *outcome.invalid_tool_calls]
    if len(calls) > 1:
        first = calls[0]
        valid = bool(outcome.tool_calls) and first is outcome.tool_calls[0]
        outcome.tool_calls, outcome.invalid_tool_calls = ([first], []) if valid else ([], [first])
    return outcome


def openai_tool_calls(outcome: ChatOutcome) -> list[dict]:
    """The adapter's tool calls as OpenAI's (arguments as a JSON string; a call whose arguments the
    model did not write as their type keeps its raw text, which the client reports as invalid)."""
    out = []
    for c in [*outcome.tool_calls, *outcome.invalid_tool_calls]:
        args = c["args"] if isinstance(c["args"], str) else json.dumps(c["args"], ensure_ascii=False)
        out.append({"id": c["id"], "type": "function", "function": {"name": c.get("name") or "", "arguments": args}})
    return out


def chat_usage(outcome: ChatOutcome) -> dict:
    s = outcome.stats
    prompt = s.prompt_tokens if s else 0
    completion = (s.tokens_decoded + s.tokens_forced) if s else 0
    cached = (s.prompt_grafted or 0) if s else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_kvmemory(outcome: ChatOutcome, namespace: str) -> dict:
    s = outcome.stats
    return {
        "namespace": namespace,
        "entries": [{"id": h.entry.id, "score": round(h.score, 4), "verified": h.entry.verified,
                     "attestation_id": h.entry.attestation.get("attestation_id")} for h in outcome.hits],
        "attestation_ids": [h.entry.attestation.get("attestation_id") for h in outcome.hits],
        "tokens_grafted": s.tokens_grafted if s else 0,
        "tokens_computed": s.tokens_computed if s else 0,
        "tokens_decoded": s.tokens_decoded if s else 0,
        "tokens_forced": s.tokens_forced if s else 0,
        "passes": s.passes if s else 0,
        "blocks_stored": s.blocks_stored if s else 0,
        "profile_id": outcome.profile_id,
        # a recurring problem answered from its verified solution (memory/recurrence.py): the entry and answer
        **({"recurrence": outcome.notes["recurrence"]} if "recurrence" in outcome.notes else {}),
    }


def chat_response(outcome: ChatOutcome, *, rid: str, model: str, namespace: str) -> dict:
    calls = openai_tool_calls(outcome)
    message: dict[str, Any] = {"role": "assistant", "content": outcome.text if (outcome.text or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": fingerprint(outcome.profile_id),
        "choices": [{"index": 0, "message": message, "finish_reason": outcome.finish_reason, "logprobs": None}],
        "usage": chat_usage(outcome),
        "kvmemory": chat_kvmemory(outcome, namespace),
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None, **extra) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
