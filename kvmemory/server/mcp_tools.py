"""The MCP server (the official `mcp` SDK, 2.x): remember, recall, answer, get, update, history, list
and forget as tools (the memory API's routes, with the same fields and results), over streamable HTTP (the `/mcp` endpoint of `kvmemory serve`) or stdio (`kvmemory serve --mcp-stdio`).

The tools are the memory API's operations (memory_ops.py) on the same compute worker as the HTTP
routes, with the same scoping: each takes `user_id` / `agent_id` / `run_id` (or `namespace`), mapped
onto one namespace and checked against the caller's key (auth.py). Over HTTP the key is the one the
request carried (the gate authenticated it before the MCP transport saw the request; the principal
rides on the request's state); over stdio it is `$KVMEMORY_MCP_KEY` when the server has keys (a
stdio server started without one refuses to start), else the server is open. A refused scope, an
unknown entry or a refused solution is a tool error with the message, never data of another scope.

The server names itself `kvmemory` with kvmemory's version (serverInfo). A request the gate refuses
(no key, an unknown one: app.py) is answered with a JSON-RPC error whose message says why, which the
SDK's client raises as is (not "Server returned an error response").

Over HTTP the endpoint is stateless (a fresh MCP transport per request, JSON responses), so every
request is authenticated on its own and nothing outlives it.
"""

from __future__ import annotations

import os
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings

from kvmemory.errors import KVMemoryError
from kvmemory.server import memory_ops as ops
from kvmemory.server.auth import OPEN, AuthError, Forbidden, KeyRing, Principal
from kvmemory.server.config import is_loopback
from kvmemory.server.state import ServerState, kvmemory_version
from kvmemory.server.worker import QueueClosed, QueueFull

ENV_MCP_KEY = "KVMEMORY_MCP_KEY"
INSTRUCTIONS = (
    "kvmemory: verified solutions with their exact KV cache. `remember` stores a problem with a solution that a "
    "verifier checks (exact-answer when an answer is given); `recall` lists stored entries close to a question; "
    "`answer` answers a question with the routed entries' KV grafted; `get`, `list` and `history` read entries; "
    "`update` changes one (keeping its earlier versions); `forget` removes entries. Every tool takes "
    "user_id / agent_id / run_id (or namespace) to choose whose memory it uses."
)


def _principal(ctx: Context, fixed: Principal | None) -> Principal:
    if fixed is not None:
        return fixed
    request = getattr(ctx.request_context, "request", None)
    principal = getattr(getattr(request, "state", None), "principal", None)
    if principal is None:  # the gate sets it on every HTTP request; without it nothing is allowed
        raise ToolError("no authenticated caller for this request")
    return principal


def build_server(st: ServerState, principal: Principal | None = None) -> MCPServer:
    """The MCP server over `st` (`principal`: the stdio session's; None over HTTP: per request)."""
    mcp = MCPServer(name="kvmemory", version=kvmemory_version(), instructions=INSTRUCTIONS, log_level="WARNING")
    max_tokens_limit = st.config.limits.max_tokens_limit
    page_limit = st.config.limits.page_size_limit

    async def call(ctx: Context, scope: dict[str, Any], fn):
        """`fn(namespace, private)` on the worker; `private`: a tenant, told nothing of other namespaces."""
        try:
            caller = _principal(ctx, principal)
            ns = caller.resolve(scope).to_namespace()
            return await st.compute(lambda: fn(ns, not caller.admin))
        except (Forbidden, AuthError, QueueFull, QueueClosed, KVMemoryError) as exc:
            raise ToolError(f"{type(exc).__name__}: {exc}") from exc

    def scope_of(user_id, agent_id, run_id, namespace) -> dict:
        return {k: v for k, v in {"user_id": user_id, "agent_id": agent_id, "run_id": run_id,
                                  "namespace": namespace}.items() if v is not None}

    @mcp.tool(description="Store a verified solution (with its exact KV cache) in the caller's scope. The verifier "
                          "runs first (exact-answer when `answer` is given, else none unless `verifier` is set); a "
                          "refused solution is an error and nothing is stored. Without a solution, `problem` is a "
                          "statement (a fact or preference: 'Alice likes tea.') stored as an unverified note. "
                          "Several at once: `items`, a list of {problem, solution?, answer?, verifier?, "
                          "allow_unverified?, metadata?, aliases?} (instead of `problem`), remembered as one batch; "
                          "each item's fate is returned in order (a refused item is refused alone).")
    async def remember(ctx: Context, problem: str | None = None, solution: str | None = None,
                       answer: str | int | float | None = None,
                       verifier: str | None = None, metadata: dict[str, Any] | None = None,
                       items: list[dict[str, Any]] | None = None,
                       user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                       namespace: str | None = None) -> dict:
        scope = scope_of(user_id, agent_id, run_id, namespace)
        if items is not None:
            if problem is not None or solution is not None or answer is not None or verifier is not None \
                    or metadata is not None:
                raise ToolError("give `items` or one item's fields (problem, solution, ...), not both")
            if not items or len(items) > ops.MAX_BATCH:
                raise ToolError(f"items must hold 1 to {ops.MAX_BATCH} items")
            return await call(ctx, scope, lambda ns, _: ops.remember_many(st.memory, ns, items))
        if problem is None:
            raise ToolError("give `problem` (one item) or `items` (several)")
        return await call(ctx, scope, lambda ns, _: ops.remember(
            st.memory, ns, problem=problem, solution=solution, answer=None if answer is None else str(answer),
            verifier=verifier, metadata=metadata))

    @mcp.tool(description="Stored entries whose problem (or note's statement) is close to `query` in the caller's "
                          "scope, best first, with cosine scores ([] when nothing is close).")
    async def recall(query: str, ctx: Context, k: int = 5, where: dict[str, Any] | None = None,
                     user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                     namespace: str | None = None) -> dict:
        return await call(ctx, scope_of(user_id, agent_id, run_id, namespace),
                          lambda ns, _: ops.recall(st.memory, ns, query=query, k=max(1, min(k, 50)), where=where))

    @mcp.tool(description="Answer `query` with the best routed entries of the caller's scope grafted (their KV read "
                          "from the store, not recomputed). choices='numbers' picks the answer among the numbers of "
                          "the routed verified solution (the reliable mode on a small model); `prior` (nats, "
                          "default 2.5) favours the answer that solution verified, 0 leaves the choice to the model.")
    async def answer(query: str, ctx: Context, k: int = 1, max_tokens: int = 64, answer_prefix: str | None = None,
                     choices: str | list[str] | None = None, prior: float | None = None,
                     where: dict[str, Any] | None = None,
                     user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                     namespace: str | None = None) -> dict:
        if not 1 <= max_tokens <= max_tokens_limit:
            raise ToolError(f"max_tokens must be between 1 and {max_tokens_limit}")
        return await call(ctx, scope_of(user_id, agent_id, run_id, namespace), lambda ns, _: ops.answer(
            st.memory, ns, query=query, k=max(1, min(k, 8)), max_tokens=max_tokens, answer_prefix=answer_prefix,
            choices=choices, where=where, prior=prior)[0])

    @mcp.tool(description="One entry of the caller's scope by id: its texts, metadata, version and attestation.")
    async def get(entry_id: str, ctx: Context, user_id: str | None = None, agent_id: str | None = None,
                  run_id: str | None = None, namespace: str | None = None) -> dict:
        return await call(ctx, scope_of(user_id, agent_id, run_id, namespace),
                          lambda ns, private: ops.get(st.memory, ns, entry_id, private=private))

    @mcp.tool(name="list", description="A page of the caller's entries, oldest first (limit, offset; `where`: a "
                                       "metadata filter such as {\"topic\": \"eggs\"} or {\"n\": {\"$gte\": 3}}).")
    async def list_(ctx: Context, limit: int = 20, offset: int = 0, verified: bool | None = None,
                    where: dict[str, Any] | None = None, user_id: str | None = None, agent_id: str | None = None,
                    run_id: str | None = None, namespace: str | None = None) -> dict:
        if not 1 <= limit <= page_limit or offset < 0:
            raise ToolError(f"limit must be between 1 and {page_limit}, offset at least 0")
        return await call(ctx, scope_of(user_id, agent_id, run_id, namespace), lambda ns, _: ops.list_entries(
            st.memory, ns, limit=limit, offset=offset, verified=verified, metadata=where))

    @mcp.tool(description="Change an entry of the caller's scope, keeping what it was (see `history`). Only the "
                          "fields given change: new problem / solution / answer are verified and their KV computed "
                          "and proven again (a refused solution is an error, nothing changes); `metadata` is merged "
                          "(a key set to null is removed); `aliases` replace the routed alternative wordings; "
                          "`remove_answer` removes the answer.")
    async def update(entry_id: str, ctx: Context, problem: str | None = None, solution: str | None = None,
                     answer: str | int | float | None = None, remove_answer: bool = False,
                     metadata: dict[str, Any] | None = None, aliases: list[str] | None = None,
                     verifier: str | None = None, allow_unverified: bool | None = None,
                     user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                     namespace: str | None = None) -> dict:
        if remove_answer and answer is not None:
            raise ToolError("give answer or remove_answer, not both")
        given = {"problem": problem, "solution": solution, "answer": answer, "metadata": metadata,
                 "aliases": aliases, "verifier": verifier, "allow_unverified": allow_unverified}
        changes = {k: v for k, v in given.items() if v is not None}
        if remove_answer:
            changes["answer"] = None
        return await call(ctx, scope_of(user_id, agent_id, run_id, namespace),
                          lambda ns, private: ops.update(st.memory, ns, entry_id, private=private, **changes))

    @mcp.tool(description="Every version of an entry of the caller's scope, oldest first, the current one last.")
    async def history(entry_id: str, ctx: Context, user_id: str | None = None, agent_id: str | None = None,
                      run_id: str | None = None, namespace: str | None = None) -> dict:
        return await call(ctx, scope_of(user_id, agent_id, run_id, namespace),
                          lambda ns, private: ops.history(st.memory, ns, entry_id, private=private))

    @mcp.tool(description="Remove entries of the caller's scope by id (or every entry of it with all=true).")
    async def forget(ctx: Context, entry_ids: list[str] | None = None, all: bool = False,
                     user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                     namespace: str | None = None) -> dict:
        return await call(ctx, scope_of(user_id, agent_id, run_id, namespace),
                          lambda ns, private: ops.forget(st.memory, ns, entry_ids=entry_ids or [], all_entries=all,
                                                         private=private))

    return mcp


def http_route(st: ServerState, host: str):
    """(the ASGI endpoint for `/mcp`, the context manager that runs its session manager)."""
    mcp = build_server(st)
    # Host-header checks (DNS rebinding) when listening on loopback, as the SDK does; beyond it the
    # API keys are the guard and clients reach the server under names the SDK cannot know.
    security = None if is_loopback(host) else TransportSecuritySettings(enable_dns_rebinding_protection=False)
    sub = mcp.streamable_http_app(streamable_http_path="/mcp", stateless_http=True, json_response=True,
                                  max_request_body_size=st.config.limits.max_body_bytes, transport_security=security,
                                  host=host)
    endpoint = next(r for r in sub.routes if getattr(r, "path", None) == "/mcp").app
    return endpoint, mcp.session_manager.run


def stdio_principal(keys: KeyRing) -> Principal:
    """Who the stdio session acts as: `$KVMEMORY_MCP_KEY`'s principal when the server has keys, else
    the open server's. Raises KVMemoryError (checked before the model loads)."""
    if keys.open:
        return OPEN
    key = os.environ.get(ENV_MCP_KEY)
    try:
        if not key:
            raise AuthError(f"this server has API keys: give the stdio session's key in ${ENV_MCP_KEY}")
        return keys.authenticate(key)
    except AuthError as exc:
        raise KVMemoryError(f"MCP over stdio: {exc}") from exc


def run_stdio(st: ServerState) -> None:
    build_server(st, stdio_principal(st.keys)).run("stdio")
