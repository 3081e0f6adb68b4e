"""The memory API over HTTP: remember (with the verifier), recall, answer, get, update, history, list,
forget, verify, stats, under `/v1/memory/`.

Every call names its scope (`user_id`, `agent_id`, `run_id`, or `namespace`; in the JSON body of a
POST, in the query of a GET / DELETE, else in `X-KVMemory-*` headers, else the key's default) and is
confined to the one namespace it maps to (auth.py, memory_ops.py):

    POST   /v1/memory/remember        {problem, solution?, answer?, verifier?, allow_unverified?, metadata?, aliases?}
                                      (no solution: the problem is a statement, stored as a note)
                                      or several: {items: [{problem, ...}, ...]} or [{problem, ...}, ...]:
                                      one batch, {results: [each item's fate, in order], counts}
    POST   /v1/memory/recall          {query, k?, threshold?, where?}
    POST   /v1/memory/answer          {query, k?, max_tokens?, answer_prefix?, choices?, prior?, memory?, temperature?, top_p?, seed?, where?}
    GET    /v1/memory/entries         ?limit=&offset=&verified=&metadata={"k": "v"}
    GET    /v1/memory/entries/{id}
    PATCH  /v1/memory/entries/{id}    {problem?, solution?, answer?, metadata?, aliases?, verifier?, allow_unverified?}
    GET    /v1/memory/entries/{id}/history
    DELETE /v1/memory/entries/{id}
    POST   /v1/memory/forget          {entry_ids: [...]} or {all: true}
    POST   /v1/memory/verify          {entry_ids?: [...]}: recompute from scratch, compare logits byte for byte
    GET    /v1/memory/stats           the scope's counts (and the whole store's for an admin key)
    GET    /v1/memory/export          ?entry_ids=a,b: a bundle (store/bundle.py) of the scope's entries
    POST   /v1/memory/import          the bundle's bytes as the body, ?verify_all=true: into the scope only

`where` (and the list's `metadata`) is a metadata filter as `KVMemory.recall(where=...)` takes it
(memory/filters.py: {"topic": "eggs"}, {"n": {"$gte": 3}}); a malformed one is a 400 naming it. A
PATCH is `KVMemory.update`: only the fields sent change (`answer: null` removes the answer, a metadata
key set to null is removed); new texts are verified and proven as `remember` does, the old version
is kept in the history, and the entry (as GET shows it, with its new `version`) is returned.

A remember that the verifier refuses is a 422 and stores nothing; an entry is written only once its
graft has been proved bit-identical (KVMemory.remember). An import is refused (403) when the bundle
holds entries of any other namespace than the caller's scope, and (422) when the proof of its
entries fails on this machine; bundles in transit live in `<store>/serve-tmp/` and are removed after.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmemory.engine.runner import Sampling
from kvmemory.server import memory_ops as ops
from kvmemory.server.errors import ApiError
from kvmemory.server.openai_schema import SCOPE_HEADERS
from kvmemory.server.state import ServerState

def _no_unknown_query(request: Request) -> None:
    """A query parameter the route does not take is a 400 naming it, as an unknown body field is: a
    mistyped scope (`?usr_id=alice`), or a scope sent in the query of a POST (whose scope is in its
    body), would otherwise be ignored and the call run in another scope."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    known = {f.alias for f in dependant.query_params} if dependant is not None else set()
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        takes = ", ".join(sorted(known)) or "none (its fields go in the JSON body)"
        raise ApiError(400, f"unknown query parameter(s) {', '.join(map(repr, unknown))}; this route takes {takes}",
                       param=unknown[0], code="unknown_field")


router = APIRouter(prefix="/v1/memory", dependencies=[Depends(_no_unknown_query)])


class Scoped(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    namespace: str | None = None


class RememberItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    problem: str
    solution: str | None = None  # none: the problem is a statement, stored as a note (memory/notes.py)
    answer: str | int | float | None = None
    verifier: Literal["exact-answer", "arithmetic", "none"] | None = None
    allow_unverified: bool = False
    metadata: dict[str, Any] | None = None
    aliases: list[str] = Field(default_factory=list, max_length=16)


class RememberBody(Scoped, RememberItem):
    pass


class RememberBatch(Scoped):
    """Several items in one call (one scope for all): remembered as one batch."""

    items: list[RememberItem] = Field(min_length=1, max_length=ops.MAX_BATCH)


class RecallBody(Scoped):
    query: str
    k: int = Field(5, ge=1, le=50)
    threshold: float | None = Field(None, ge=-1.0, le=1.0)
    where: dict[str, Any] | None = None


class AnswerBody(Scoped):
    query: str
    k: int = Field(1, ge=1, le=8)
    max_tokens: int = Field(64, ge=1)
    answer_prefix: str | None = None
    choices: Literal["numbers"] | list[str] | None = None
    prior: float | None = Field(None, ge=0.0, le=100.0)  # nats on a routed verified answer among choices
    memory: bool = True
    threshold: float | None = Field(None, ge=-1.0, le=1.0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    where: dict[str, Any] | None = None


class UpdateBody(Scoped):
    """Only the fields sent change (`model_fields_set`): `answer: null` removes the answer."""

    problem: str | None = None
    solution: str | None = None
    answer: str | int | float | None = None
    metadata: dict[str, Any] | None = None
    aliases: list[str] | None = Field(None, max_length=16)
    verifier: Literal["exact-answer", "arithmetic", "none"] | None = None
    allow_unverified: bool | None = None


class ForgetBody(Scoped):
    entry_ids: list[str] = Field(default_factory=list, max_length=1000)
    all: bool = False


class VerifyBody(Scoped):
    entry_ids: list[str] | None = Field(None, max_length=ops.MAX_VERIFY)


def _state(request: Request) -> ServerState:
    return request.app.state.kv


def _namespace(request: Request, fields: dict) -> str:
    """The namespace of the scope a call names (body or query fields, else X-KVMemory-* headers),
    checked against the caller's key."""
    given = {k: v for k, v in fields.items() if k in SCOPE_HEADERS and v is not None}
    if not given:
        given = {k: request.headers[h] for k, h in SCOPE_HEADERS.items() if request.headers.get(h)}
    ns = request.state.principal.resolve(given).to_namespace()
    request.state.namespace = ns
    return ns


def _private(request: Request) -> bool:
    """Whether the caller is a tenant, told nothing of other namespaces (tenancy.py)."""
    return not request.state.principal.admin


def _query_scope(user_id, agent_id, run_id, namespace) -> dict:
    return {"user_id": user_id, "agent_id": agent_id, "run_id": run_id, "namespace": namespace}


def _validated(model: type[BaseModel], data: Any, loc: tuple = ()) -> Any:
    """`data` as `model`, a validation error reported as FastAPI reports a body's (a 400 naming the field)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *loc, *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from None


_REMEMBER_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    RememberBody.model_json_schema(), RememberBatch.model_json_schema(),
    {"type": "array", "items": RememberBody.model_json_schema()}]}}}}}


@router.post("/remember", openapi_extra=_REMEMBER_BODY)
async def remember(request: Request, raw: Any = Body(None)) -> dict:
    """One item (the entry, as before), or several: {"items": [...], scope} or a JSON array of items
    (every item naming the same scope, or none): remembered as one batch, each item's fate returned."""
    st = _state(request)
    if isinstance(raw, list) or (isinstance(raw, dict) and "items" in raw):
        if isinstance(raw, list):
            if not raw:
                raise ApiError(400, "invalid request: an empty list of items", param="items")
            if len(raw) > ops.MAX_BATCH:
                raise ApiError(400, f"invalid request: {len(raw)} items; one call remembers at most {ops.MAX_BATCH}",
                               param="items")
            bodies = [_validated(RememberBody, x, (i,)) for i, x in enumerate(raw)]
            named = {tuple(sorted((k, v) for k, v in b.model_dump(include=set(Scoped.model_fields)).items()
                                  if v is not None)) for b in bodies} - {()}
            if len(named) > 1:
                raise ApiError(400, "invalid request: the items of one call name one scope (user_id, agent_id, "
                               "run_id, namespace); send each scope's items in its own call", param="items")
            ns = _namespace(request, dict(next(iter(named))) if named else {})
            items = [b.model_dump(exclude=set(Scoped.model_fields)) for b in bodies]
        else:
            batch = _validated(RememberBatch, raw)
            ns = _namespace(request, batch.model_dump())
            items = [it.model_dump() for it in batch.items]
        return await st.compute(lambda: ops.remember_many(st.memory, ns, items))
    body = _validated(RememberBody, raw)
    ns = _namespace(request, body.model_dump())
    answer = None if body.answer is None else str(body.answer)
    return await st.compute(lambda: ops.remember(
        st.memory, ns, problem=body.problem, solution=body.solution, answer=answer, verifier=body.verifier,
        allow_unverified=body.allow_unverified, metadata=body.metadata, aliases=body.aliases))


@router.post("/recall")
async def recall(body: RecallBody, request: Request) -> dict:
    st, ns = _state(request), _namespace(request, body.model_dump())
    return await st.compute(lambda: ops.recall(st.memory, ns, query=body.query, k=body.k, threshold=body.threshold,
                                               where=body.where))


@router.post("/answer")
async def answer(body: AnswerBody, request: Request) -> dict:
    st, ns = _state(request), _namespace(request, body.model_dump())
    limit = st.config.limits.max_tokens_limit
    if body.max_tokens > limit:
        raise ApiError(400, f"max_tokens is {body.max_tokens}; this server decodes at most {limit} tokens per call",
                       param="max_tokens", code="max_tokens_exceeded")
    sampling = Sampling(temperature=body.temperature or 0.0, top_p=body.top_p or 1.0, seed=body.seed or 0)

    def work() -> dict:
        out, ans = ops.answer(st.memory, ns, query=body.query, k=body.k, max_tokens=body.max_tokens,
                              answer_prefix=body.answer_prefix, choices=body.choices, memory=body.memory,
                              sampling=sampling, threshold=body.threshold, where=body.where, prior=body.prior)
        r = ans.report
        st.metrics.model_call(grafted=r.tokens_grafted, computed=r.tokens_computed, decoded=r.tokens_decoded,
                              entries=len(ans.entries), quarantined=len(r.quarantined))
        return out

    return await st.compute(work)


@router.get("/entries")
async def list_entries(request: Request, limit: int = Query(20, ge=1), offset: int = Query(0, ge=0),
                       verified: bool | None = None, metadata: str | None = None, user_id: str | None = None,
                       agent_id: str | None = None, run_id: str | None = None, namespace: str | None = None) -> dict:
    st = _state(request)
    ns = _namespace(request, _query_scope(user_id, agent_id, run_id, namespace))
    if limit > st.config.limits.page_size_limit:
        raise ApiError(400, f"limit is at most {st.config.limits.page_size_limit}", param="limit")
    filters = None
    if metadata:
        try:
            filters = json.loads(metadata)
        except ValueError:
            filters = None
        if not isinstance(filters, dict):
            raise ApiError(400, 'metadata must be a JSON object, e.g. metadata={"topic": "eggs"}', param="metadata")
    return await st.compute(lambda: ops.list_entries(st.memory, ns, limit=limit, offset=offset, verified=verified,
                                                     metadata=filters))


@router.get("/entries/{entry_id}")
async def get_entry(entry_id: str, request: Request, user_id: str | None = None, agent_id: str | None = None,
                    run_id: str | None = None, namespace: str | None = None) -> dict:
    st = _state(request)
    ns = _namespace(request, _query_scope(user_id, agent_id, run_id, namespace))
    private = _private(request)
    return await st.compute(lambda: ops.get(st.memory, ns, entry_id, private=private))


@router.patch("/entries/{entry_id}")
async def update_entry(entry_id: str, body: UpdateBody, request: Request) -> dict:
    st, ns = _state(request), _namespace(request, body.model_dump())
    private = _private(request)
    changes = {k: getattr(body, k) for k in body.model_fields_set if k in ops.UPDATE_FIELDS}
    return await st.compute(lambda: ops.update(st.memory, ns, entry_id, private=private, **changes))


@router.get("/entries/{entry_id}/history")
async def entry_history(entry_id: str, request: Request, user_id: str | None = None, agent_id: str | None = None,
                        run_id: str | None = None, namespace: str | None = None) -> dict:
    st = _state(request)
    ns = _namespace(request, _query_scope(user_id, agent_id, run_id, namespace))
    private = _private(request)
    return await st.compute(lambda: ops.history(st.memory, ns, entry_id, private=private))


@router.delete("/entries/{entry_id}")
async def delete_entry(entry_id: str, request: Request, user_id: str | None = None, agent_id: str | None = None,
                       run_id: str | None = None, namespace: str | None = None) -> dict:
    st = _state(request)
    ns = _namespace(request, _query_scope(user_id, agent_id, run_id, namespace))
    private = _private(request)
    return await st.compute(lambda: ops.forget(st.memory, ns, entry_ids=[entry_id], private=private))


@router.post("/forget")
async def forget(body: ForgetBody, request: Request) -> dict:
    st, ns = _state(request), _namespace(request, body.model_dump())
    private = _private(request)
    return await st.compute(lambda: ops.forget(st.memory, ns, entry_ids=body.entry_ids, all_entries=body.all,
                                               private=private))


@router.post("/verify")
async def verify(body: VerifyBody, request: Request) -> dict:
    st, ns = _state(request), _namespace(request, body.model_dump())
    private = _private(request)
    return await st.compute(lambda: ops.verify(st.memory, ns, entry_ids=body.entry_ids, private=private))


@router.get("/stats")
async def stats(request: Request, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                namespace: str | None = None) -> dict:
    st = _state(request)
    ns = _namespace(request, _query_scope(user_id, agent_id, run_id, namespace))
    admin = request.state.principal.admin
    return await st.compute(lambda: ops.stats(st.memory, ns, store_wide=admin))


@router.get("/export")
async def export(request: Request, entry_ids: str | None = None, user_id: str | None = None,
                 agent_id: str | None = None, run_id: str | None = None, namespace: str | None = None):
    st = _state(request)
    ns = _namespace(request, _query_scope(user_id, agent_id, run_id, namespace))
    ids = [x.strip() for x in (entry_ids or "").split(",") if x.strip()]
    private = _private(request)
    path, report = await st.compute(lambda: ops.export(st.memory, ns, entry_ids=ids or None, private=private))
    return FileResponse(path, media_type="application/x-tar", filename=f"kvmemory-{ns.replace(':', '-').replace('/', '_')}.kvmb",
                        headers={"X-KVMemory-Bundle-SHA256": str(report.get("sha256", "")),
                                 "X-KVMemory-Entries": str(report.get("entries", ""))},
                        background=BackgroundTask(path.unlink, missing_ok=True))


@router.post("/import")
async def import_bundle(request: Request, verify_all: bool = False, user_id: str | None = None,
                        agent_id: str | None = None, run_id: str | None = None, namespace: str | None = None) -> dict:
    st = _state(request)
    ns = _namespace(request, _query_scope(user_id, agent_id, run_id, namespace))
    path = await asyncio.to_thread(ops.scratch_file, st.memory, ".kvmb")
    try:
        with open(path, "wb") as fh:
            async for chunk in request.stream():
                if chunk:
                    await asyncio.to_thread(fh.write, chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if path.stat().st_size == 0:
        path.unlink(missing_ok=True)
        raise ApiError(400, "send the bundle's bytes as the request body (kvmemory export --out FILE writes one)")
    out = await st.compute(lambda: ops.import_(st.memory, ns, path, verify_all=verify_all))
    if not out.get("ok", True):
        raise ApiError(422, f"the bundle's entries {out.get('failed')} are not bit-identical on this machine; "
                       "nothing was imported", "verification_error", code="import_proof_failed")
    return out
