"""The server's settings and limits, in one frozen record (what `kvmemory serve`'s options become).

Limits are checked before a request reaches the queue or the model, and each one that is exceeded
gives a 4xx that names it: the request body's size (413), `max_tokens` / `max_completion_tokens` past
`max_tokens_limit` (400), a prompt longer than `max_prompt_tokens` (400), more waiting requests than
`queue_depth` (429).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

DEFAULT_PORT = 8765
SERVED_MODEL_NAME = "kvmemory"
DEFAULT_BATCH_SLOTS = 16  # `kvmemory serve --batch-slots`'s default (Limits.batch_slots says why)


@dataclass(slots=True, frozen=True)
class Limits:
    """What one request may ask for."""

    max_body_bytes: int = 1 << 20  # 1 MiB of JSON is ~250k tokens of text: far past the model's context
    max_tokens_limit: int = 2048  # the most tokens one call may decode
    max_prompt_tokens: int = 8192  # the most prompt tokens one call may send (the model's own limit may be lower)
    default_max_tokens: int = 256  # chat completions when max_tokens is not given (completions: 16, as OpenAI)
    queue_depth: int = 32  # requests waiting for the compute worker, beyond the ones it runs
    # requests whose forwards share steps (engine/scheduler.py); 1: one at a time. On by default: every
    # answer keeps its bits alone, and 16 slots served 2.7x the requests/s of one at a time at 16 clients
    # (BENCHMARKS.md, "Serving")
    batch_slots: int = DEFAULT_BATCH_SLOTS
    batch_kv_tokens: int = 65536  # K/V positions the batched requests may hold together (more wait)
    page_size_limit: int = 100  # entries per page of GET /v1/memory/entries
    max_import_bytes: int = 1 << 30  # a bundle uploaded to POST /v1/memory/import (blocks are ~1.5 MB each)


@dataclass(slots=True, frozen=True)
class ServerConfig:
    """Everything `create_app` needs besides the memory itself."""

    served_model_name: str = SERVED_MODEL_NAME
    model: str = ""  # the model spec the memory was opened with (a second accepted name in requests)
    api_keys: tuple[str, ...] = ()  # admin keys (--api-key / KVMEMORY_API_KEY): every namespace
    keys_file: str | None = None  # a JSON file of tenant keys (auth.load_keys_file)
    limits: Limits = field(default_factory=Limits)
    mcp: bool = True  # mount the MCP server's streamable HTTP endpoint at /mcp
    host: str = "127.0.0.1"  # where the server listens (the MCP endpoint checks Host headers on loopback)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
