"""The OpenAI-compatible routes: `POST /v1/chat/completions` (plain and SSE streaming),
`POST /v1/completions` (plain and streaming) and `GET /v1/models`.

A chat call is `adapters.chat.run_chat` (the one the LangChain and LlamaIndex chat models run): the
last user turn routed to verified entries in the caller's scope, the longest stored chain grafted,
tools and JSON schemas through the guided decoder. Every call stores the blocks of its prompt up to
its last cut (unless `kvmemory.cache` is false): the grid blocks and a tail block at the end of each
of its segments (routed entries, the system message, earlier turns, the prompt itself:
memory/layout.py), so the next turn of the same conversation, whose prompt starts with this one,
grafts all of this one's prompt, however short, and computes only what is new: a prefix cache that
outlives the process and is shared by every server on the same store.

The prefix cache is content-addressed (a block's chain hash covers the profile and every token
before it), shared across tenants: a tenant can learn that an identical prompt prefix, ending where
one of its own segments ends, was sent before (`cached_tokens` > 0), never what any other prompt
held. Entries (problems, solutions) are isolated per namespace.

Handlers never compute: the work goes to the compute worker (worker.py). A stream waits for its first
event before the response starts, so an error found before any text (a prompt past the limit, a bad
tool choice) is still a proper 4xx; after that, an error ends the stream with an SSE `error` event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvmemory.adapters.chat import ChatOutcome, run_chat
from kvmemory.adapters.streaming import VisibleText
from kvmemory.errors import KVMemoryError
from kvmemory.memory.prompts import render_ids
from kvmemory.server.completions import Completion, RawText, complete, prompt_ids
from kvmemory.server.errors import ApiError, from_kvmemory
from kvmemory.server.openai_schema import (ChatCompletionRequest, CompletionRequest, chat_chunk, chat_kvmemory,
                                           chat_request, chat_response, chat_usage, completion_prompt, fingerprint,
                                           max_tokens_of, new_id, one_tool_call, openai_tool_calls, sampling_of,
                                           scope_fields, sse, stops_of, options_of)
from kvmemory.server.state import ServerState
from kvmemory.server.worker import TextStream

router = APIRouter()
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def state(request: Request) -> ServerState:
    return request.app.state.kv


def check_model(st: ServerState, model: str) -> None:
    if model not in st.model_names:
        raise ApiError(404, f"model {model!r} is not served here; GET /v1/models lists {st.model_ids}",
                       "invalid_request_error", code="model_not_found", param="model")


def check_prompt_tokens(n: int, limit: int) -> None:
    if n > limit:
        raise ApiError(400, f"the prompt is {n} tokens; this server takes at most {limit} "
                       "(kvmemory serve --max-prompt-tokens)", code="context_length_exceeded", param="messages")


def record(st: ServerState, *, grafted: int, computed: int, decoded: int, entries: int = 0, quarantined: int = 0) -> None:
    st.metrics.model_call(grafted=grafted, computed=computed, decoded=decoded, entries=entries, quarantined=quarantined)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    st = state(request)
    # Every id a request may name (the 404 for any other lists the same ids), each the same model
    return {"object": "list", "data": [
        {"id": mid, "object": "model", "created": int(st.started), "owned_by": "kvmemory",
         "kvmemory": {"model": st.config.model, "profile_id": st.memory.engine.profile_id,
                      "chunk": st.memory.engine.chunk}} for mid in st.model_ids]}


# ---------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = state(request)
    check_model(st, body.model)
    req = chat_request(body, st.config.limits)
    scope = request.state.principal.resolve(scope_fields(body, request.headers))
    req.namespace = namespace = scope.to_namespace()
    request.state.namespace = namespace
    limit = st.config.limits.max_prompt_tokens

    def work(on_text=None) -> ChatOutcome:
        check_prompt_tokens(len(render_ids(st.memory.engine.tokenizer, req.turns, add_generation_prompt=True)), limit)
        out = run_chat(st.shared, req, on_text)
        if body.parallel_tool_calls is False:
            out = one_tool_call(out)
        s = out.stats
        record(st, grafted=s.tokens_grafted, computed=s.tokens_computed, decoded=s.tokens_decoded, entries=len(out.hits))
        return out

    rid = new_id("chatcmpl")
    if not body.stream:
        out = await st.compute(work)
        return JSONResponse(chat_response(out, rid=rid, model=body.model, namespace=namespace))
    stream = st.stream(work, VisibleText(req.held_back))
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    first, events = await _first(stream)
    return StreamingResponse(_chat_events(first, events, stream, rid, body.model, namespace, include_usage),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _first(stream: TextStream):
    """The stream's first event (its error raised here, before the response starts) and the rest."""
    events = stream.__aiter__()
    try:
        return await events.__anext__(), events
    except BaseException:
        stream.cancel()
        raise


def _error_event(exc: BaseException) -> bytes:
    err = exc if isinstance(exc, ApiError) else from_kvmemory(exc) if isinstance(exc, KVMemoryError) else \
        ApiError(500, f"{type(exc).__name__}: {exc}", "server_error")
    return sse(err.body())


async def _chat_events(first, events: AsyncIterator, stream: TextStream, rid: str, model: str, namespace: str,
                       include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
    try:
        event = first
        while True:
            kind, value = event
            if kind == "text":
                yield sse(chat_chunk(rid, model, created, {"content": value}))
            else:
                out: ChatOutcome = value
                calls = openai_tool_calls(out)
                if calls:
                    yield sse(chat_chunk(rid, model, created,
                                         {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
                elif tail := stream.visible.finish(out.text):
                    yield sse(chat_chunk(rid, model, created, {"content": tail}))
                yield sse(chat_chunk(rid, model, created, {}, out.finish_reason,
                                     system_fingerprint=fingerprint(out.profile_id),
                                     kvmemory=chat_kvmemory(out, namespace)))
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": chat_usage(out)})
                break
            event = await events.__anext__()
    except StopAsyncIteration:
        pass
    except Exception as exc:  # after the first byte: the stream ends with an error event
        yield _error_event(exc)
    finally:
        stream.cancel()
    yield sse("[DONE]")


# ---------------------------------------------------------------------- completions
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = state(request)
    check_model(st, body.model)
    prompt = completion_prompt(body)
    limits = st.config.limits
    max_tokens = max_tokens_of(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, limits.max_tokens_limit)
    sampling, stop, opts = sampling_of(body), stops_of(body), options_of(body)
    # No routing here (module docstring), but the key must still be good for the scope it names.
    request.state.namespace = request.state.principal.resolve(scope_fields(body, request.headers)).to_namespace()

    def work(on_text=None) -> Completion:
        check_prompt_tokens(len(prompt_ids(st.memory, prompt)), limits.max_prompt_tokens)
        c = complete(st.memory, prompt, max_tokens=max_tokens, sampling=sampling, stop=stop,
                     store_blocks=opts.cache, on_text=on_text)
        r = c.report
        record(st, grafted=r.tokens_grafted, computed=r.tokens_computed, decoded=r.tokens_decoded,
               quarantined=len(r.quarantined))
        return c

    rid, created = new_id("cmpl"), int(time.time())

    def body_of(c: Completion | None, text: str, finish: str | None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": body.model,
               "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        if c is not None:
            out.update(system_fingerprint=fingerprint(c.profile_id), usage=c.usage(), kvmemory=c.kvmemory())
        return out

    if not body.stream:
        c = await st.compute(work)
        return JSONResponse(body_of(c, c.text, c.finish_reason))
    stream = st.stream(work, RawText(stop))
    first, events = await _first(stream)

    async def gen() -> AsyncIterator[bytes]:
        try:
            event = first
            while True:
                kind, value = event
                if kind == "text":
                    yield sse(body_of(None, value, None))
                else:
                    tail = stream.visible.finish(value.text)
                    yield sse(body_of(value, tail, value.finish_reason))
                    break
                event = await events.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as exc:
            yield _error_event(exc)
        finally:
            stream.cancel()
        yield sse("[DONE]")

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
