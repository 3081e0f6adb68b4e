"""Run the server: the memory loaded once (model, kernels, store), then uvicorn over `app.create_app`,
or the MCP server over stdio (`--mcp-stdio`, for MCP clients that start their servers as processes).

One process, one worker for the model (worker.py); scale out by running several servers on the same
store (a folder on shared disk, or Redis), each with its own model. uvicorn handles SIGINT / SIGTERM:
it stops accepting, lets in-flight requests finish for up to `graceful_timeout` seconds, then the
application's lifespan drains the compute queue and closes the store (app.py).
"""

from __future__ import annotations

import logging
import os

from kvmemory.memory.facade import KVMemory
from kvmemory.server import logs
from kvmemory.server.config import DEFAULT_BATCH_SLOTS, Limits, ServerConfig, is_loopback

ENV_API_KEY = "KVMEMORY_API_KEY"


def config_from_args(args) -> ServerConfig:
    """The server's settings from `kvmemory serve`'s options (and $KVMEMORY_API_KEY)."""
    keys = list(args.api_key or [])
    if not keys and os.environ.get(ENV_API_KEY):
        keys = [os.environ[ENV_API_KEY]]
    limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                    max_prompt_tokens=args.max_prompt_tokens, queue_depth=args.queue_depth,
                    batch_slots=getattr(args, "batch_slots", DEFAULT_BATCH_SLOTS), batch_kv_tokens=getattr(args, "batch_kv_tokens", 65536),
                    max_import_bytes=getattr(args, "max_import_bytes", None) or Limits().max_import_bytes)
    return ServerConfig(served_model_name=args.served_model_name, model=args.model, api_keys=tuple(keys),
                        keys_file=args.keys_file, limits=limits, mcp=not args.no_mcp, host=args.host)


def serve(memory: KVMemory, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8765,
          graceful_timeout: float = 30.0, log_level: str = "info") -> int:
    """Serve `memory` over HTTP until SIGINT / SIGTERM; returns the exit status."""
    import uvicorn

    from kvmemory.server.app import create_app

    log_config = logs.configure(log_level)
    app = create_app(memory, config)
    if app.state.kv.keys.open and not is_loopback(host):
        logs.log("open_server", logging.WARNING, host=host,
                 message="no API key is set and the server listens beyond this machine: anyone who reaches it "
                         "can read and write every namespace (set --api-key / KVMEMORY_API_KEY or --keys-file)")
    profile = memory.engine.profile  # where the model runs (--device, --dtype): said once, at start
    logs.log("listening", host=host, port=port, mcp=config.mcp, device=str(memory.engine.device),
             device_name=profile.device_name, dtype=profile.dtype)
    uvicorn.run(app, host=host, port=port, log_config=log_config, access_log=False,
                timeout_graceful_shutdown=graceful_timeout, lifespan="on")
    return 0


def serve_mcp_stdio(memory: KVMemory, config: ServerConfig, log_level: str = "warning") -> int:
    """The MCP server over stdio (its tools run on the same compute worker as HTTP would)."""
    from kvmemory.server.mcp_tools import run_stdio
    from kvmemory.server.state import ServerState

    logs.configure(log_level)  # logs go to stderr: stdout is the MCP channel
    st = ServerState.build(memory, config)
    try:
        run_stdio(st)
    finally:
        st.queue.close(120.0)
        memory.store.close()
    return 0
