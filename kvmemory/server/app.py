"""The FastAPI application: routes, the gate every request passes, error bodies, `/healthz`,
`/metrics`, and the lifespan that shuts down without losing a committed entry.

The gate (a plain ASGI middleware, so streams and the MCP endpoint pass through it untouched):
refuses a body past `max_body_bytes` (413, counted as it arrives, whatever Content-Length says),
authenticates every request but `/healthz` when keys are set (401; the key's principal goes to
`request.state.principal` for the routes' scope checks; on `/mcp` the refusal's body is a JSON-RPC
error whose message names the cause, which MCP clients show), and counts and logs each request once it
ends (route template, status, latency, key name, namespace).

Shutdown: uvicorn stops accepting connections and lets in-flight requests finish (`kvmemory serve
--graceful-timeout`); then the lifespan closes the compute queue (jobs already queued still run, new
ones get 503), waits for the worker, and closes the store. A `remember` that was accepted is either
committed and answered, or (killed mid-way) not committed at all: the store commits an entry in one
SQLite transaction after its blocks are on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmemory.errors import KVMemoryError
from kvmemory.memory.facade import KVMemory
from kvmemory.server import logs
from kvmemory.server.auth import AuthError, Forbidden, bearer_key
from kvmemory.server.config import ServerConfig
from kvmemory.server.errors import ApiError, from_kvmemory
from kvmemory.server.state import ServerState, kvmemory_version
from kvmemory.server.worker import QueueClosed, QueueFull

OPEN_PATHS = {"/healthz"}
MCP_PATH = "/mcp"
MCP_GATE_ERROR = -32001  # JSON-RPC: an error of the server's own range (-32000 to -32099)
BULK_PATHS = {"/v1/memory/import"}  # bundles: their own size limit (max_import_bytes)


class BodyTooLarge(Exception):
    pass


def mcp_error(err: ApiError) -> dict:
    """A refusal of the gate on `/mcp` as a JSON-RPC error: the MCP SDK's client reads the message of a
    JSON-RPC error in a 4xx body and raises it as is (any other body becomes "Server returned an error
    response", which names no cause). The OpenAI-style fields ride along (`type`, and `data`)."""
    return {"jsonrpc": "2.0", "id": None,
            "error": {"code": MCP_GATE_ERROR, "message": f"kvmemory: {err.message} (HTTP {err.status})",
                      "type": err.type, "data": err.body()["error"]}}


class Gate:
    """Body limit, authentication, metrics and the request log (module docstring)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.st = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        st = self.st
        limits = st.config.limits
        limit = limits.max_import_bytes if scope["path"] in BULK_PATHS else limits.max_body_bytes
        status = {"code": 500, "started": False}
        scope.setdefault("state", {})

        async def send_(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        async def reply(err: ApiError):
            body = json.dumps(mcp_error(err) if scope["path"] == MCP_PATH else err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
            await send_({"type": "http.response.start", "status": err.status, "headers": headers})
            await send_({"type": "http.response.body", "body": body})

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            if scope["path"] not in OPEN_PATHS:
                scope["state"]["principal"] = st.keys.authenticate(bearer_key(headers))
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BodyTooLarge()
            seen = 0

            async def receive_():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        raise BodyTooLarge()
                return message

            await self.app(scope, receive_, send_)
        except AuthError as exc:
            await reply(ApiError(401, str(exc), "authentication_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"}))
        except BodyTooLarge:
            if status["started"]:
                raise
            option = "--max-import-bytes" if scope["path"] in BULK_PATHS else "--max-body-bytes"
            await reply(ApiError(413, f"the request body is larger than {limit} bytes (kvmemory serve {option})",
                                 code="request_too_large"))
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "other"
            seconds = time.perf_counter() - t0
            st.metrics.request(template, scope["method"], status["code"], seconds)
            principal = scope["state"].get("principal")
            logs.log("request", method=scope["method"], route=template, status=status["code"],
                     ms=round(seconds * 1000, 2), key=getattr(principal, "name", None),
                     namespace=scope["state"].get("namespace"))


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _install_error_handlers(app: FastAPI, st: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(KVMemoryError)
    async def _kvm(_: Request, exc: KVMemoryError):
        return _error_response(from_kvmemory(exc))

    @app.exception_handler(QueueFull)
    async def _full(_: Request, exc: QueueFull):
        st.metrics.queue_rejected()
        return _error_response(ApiError(429, str(exc), "rate_limit_error", code="queue_full",
                                        headers={"Retry-After": "1"}))

    @app.exception_handler(QueueClosed)
    async def _closed(_: Request, exc: QueueClosed):
        return _error_response(ApiError(503, str(exc), "server_error", code="shutting_down"))

    @app.exception_handler(Forbidden)
    async def _forbidden(_: Request, exc: Forbidden):
        return _error_response(ApiError(403, str(exc), "permission_error", code="scope_forbidden"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):  # e.g. a body too deeply nested to parse
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)[:500]
        return _error_response(ApiError(exc.status_code, detail, "invalid_request_error" if exc.status_code < 500
                                        else "server_error", headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        param = ".".join(str(x) for x in exc.errors()[0].get("loc", ()) if x != "body") if exc.errors() else None
        return _error_response(ApiError(400, "invalid request: " + "; ".join(parts), param=param))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        logs.log("error", logging.ERROR, error=type(exc).__name__, message=str(exc)[:500])
        logging.getLogger(logs.LOGGER).exception("unhandled error")
        return _error_response(ApiError(500, f"internal error ({type(exc).__name__}); see the server log",
                                        "server_error", code="internal_error"))


def create_app(memory: KVMemory, config: ServerConfig | None = None) -> FastAPI:
    """The application over one loaded memory (the model, its kernels and the store, opened once)."""
    from kvmemory.server import memory_routes, openai_routes

    config = config or ServerConfig()
    st = ServerState.build(memory, config)
    mcp_endpoint = mcp_run = None
    if config.mcp:
        from kvmemory.server.mcp_tools import http_route

        mcp_endpoint, mcp_run = http_route(st, config.host)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with contextlib.AsyncExitStack() as stack:
            if mcp_run is not None:
                await stack.enter_async_context(mcp_run())
            logs.log("ready", model=config.model, profile_id=memory.engine.profile_id,
                     keys="open" if st.keys.open else len(st.keys.by_hash), queue_depth=config.limits.queue_depth)
            try:
                yield
            finally:
                ended = await asyncio.to_thread(st.queue.close, 120.0)
                await asyncio.to_thread(st.close_scheduler, 30.0)
                try:
                    memory.store.close()
                except Exception:  # closing twice, or a store without a close: nothing left to lose
                    pass
                logs.log("stopped", worker_finished=ended)

    app = FastAPI(title="kvmemory", version=kvmemory_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.kv = st
    _install_error_handlers(app, st)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "model": config.served_model_name, "profile_id": memory.engine.profile_id,
                "queue": {"waiting": st.queue.waiting, "running": st.queue.running,
                          "depth": config.limits.queue_depth},
                "batch": {"slots": config.limits.batch_slots,
                          "sequences": st.scheduler.sequences if st.scheduler is not None else 0}}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        # Store-wide counts (entries, blocks, bytes) change with every tenant's writes: a tenant key
        # would learn of the others' activity, so only an admin key (or a server without keys) reads them.
        if not request.state.principal.admin:
            raise Forbidden("/metrics shows the whole store's counts: read it with an admin key (--api-key)")
        await st.refresh_gauges()
        return PlainTextResponse(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_routes.router)
    app.include_router(memory_routes.router)
    if mcp_endpoint is not None:
        from starlette.routing import Route

        app.router.routes.append(Route(MCP_PATH, endpoint=mcp_endpoint))
    app.add_middleware(Gate, state=st)
    return app

