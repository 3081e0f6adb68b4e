"""Which request fields of OpenAI's API the OpenAI-compatible routes take, and what a field outside
them gets: a 400 naming it, as the memory API's strict bodies do.

The request models (openai_schema.py) declare the fields this server implements (or refuses with a
reason when set to what it cannot honour: `n` > 1, penalties, `logit_bias`, ...). Clients also send
fields of OpenAI's spec that change nothing here; they are accepted, so the official `openai` client,
LangChain's `ChatOpenAI` and LlamaIndex's `OpenAILike` work unchanged:

- harmless (never change a token of the answer): `user`, `metadata`, `store`, `service_tier`,
  `prompt_cache_key`, `safety_identifier`, `prediction` (a latency hint: the output is the same);
- neutral only at their no-op value, else refused with a 400 that names them, because honouring them
  would change the result and this server cannot: `reasoning_effort` (None or "none": the model does
  not reason), `verbosity`, `audio`, `web_search_options` (None), `modalities` (["text"]), `functions` /
  `function_call` (the deprecated forms of `tools` / `tool_choice`: use those).

Any other field is unknown (a typo such as `max_token`, or another server's option): 400 naming it,
never silently ignored. kvmemory's own options go in the `kvmemory` object.
"""

from __future__ import annotations

from typing import Any

from kvmemory.server.errors import ApiError

HARMLESS = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "prediction"}
# field -> the values that ask for nothing (accepted); any other value is refused, with why.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "reasoning_effort": ((None, "none"), "the served model does not reason: give none or leave it out"),
    "verbosity": ((None,), "this server decodes the model as it is; leave it out"),
    "audio": ((None,), "this server answers in text only"),
    "modalities": ((None, ["text"]), 'this server answers in text only: ["text"] or leave it out'),
    "web_search_options": ((None,), "this server does not search the web"),
    "functions": ((None, []), "the deprecated form of tools: give tools"),
    "function_call": ((None,), "the deprecated form of tool_choice: give tool_choice"),
}
CHAT_ONLY = {"reasoning_effort", "verbosity", "audio", "modalities", "web_search_options", "functions",
             "function_call", "prediction", "prompt_cache_key", "safety_identifier", "store", "metadata",
             "service_tier"}


def check_extra_fields(extra: dict[str, Any] | None, *, route: str) -> None:
    """Refuse (400, naming them) the fields of a request body that its model did not declare and
    that are neither harmless nor at a neutral value; `route` is "chat" or "completions"."""
    if not extra:
        return
    known = HARMLESS | set(NEUTRAL)
    if route != "chat":
        known -= CHAT_ONLY
    unknown = sorted(k for k in extra if k not in known)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(repr, unknown))} for /v1/{route}"
                       f"{'/completions' if route == 'chat' else ''}: not part of OpenAI's request, nor "
                       "kvmemory's (its own options go in the \"kvmemory\" object)", param=unknown[0],
                       code="unknown_field")
    for name, value in extra.items():
        if name in NEUTRAL:
            allowed, why = NEUTRAL[name]
            if value not in allowed:
                raise ApiError(400, f"{name}={value!r} is not supported: {why}", param=name,
                               code="unsupported_field")
