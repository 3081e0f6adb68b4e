"""The text protocol between LangChain messages and a plain chat-template model.

LangChain messages become {"role", "content"} turns for the model's chat template. Tools are described
in the system turn as one JSON object each, and a tool call is written in the assistant turn as

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 8"}}</tool_call>

which is how earlier calls (`AIMessage.tool_calls`) are replayed to the model; tool results come back
as turns of role "tool". `parse_tool_calls` reads that format (and a bare `{"tool": ..., "arguments":
...}` object) out of free model output, for models that call tools on their own.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from .errors import UnsupportedContent

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# Content blocks that carry no text for the model: tool calls are replayed from `AIMessage.tool_calls`,
# and reasoning / thinking blocks of other providers are not part of what this model said.
_SKIPPED_BLOCKS = {"tool_use", "tool_call", "tool_call_chunk", "function_call", "thinking", "reasoning",
                   "redacted_thinking", "server_tool_call", "server_tool_result"}
_NON_TEXT_BLOCKS = {"image", "image_url", "input_image", "audio", "input_audio", "file", "video", "document"}


def text_of(content: str | list[Any]) -> str:
    """The text of a message's content; raises UnsupportedContent for images, audio and files."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("text", "input_text", "output_text"):
            parts.append(str(block.get("text", "")))
        elif kind in _SKIPPED_BLOCKS:
            continue
        elif kind in _NON_TEXT_BLOCKS:
            raise UnsupportedContent(
                f"a {kind!r} content block was given, but this model reads text only; "
                "describe the content in text instead"
            )
        else:
            raise UnsupportedContent(f"unknown content block {block!r}: pass text blocks or plain strings")
    return "".join(parts)


def render_tool_call(name: str, args: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def to_chat(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as chat-template turns. System messages are merged into one leading turn."""
    system: list[str] = []
    turns: list[dict[str, str]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            text = text_of(m.content).strip()
            if text:
                system.append(text)
        elif isinstance(m, HumanMessage):
            turns.append({"role": "user", "content": text_of(m.content)})
        elif isinstance(m, AIMessage):
            text = text_of(m.content).strip()
            calls = [render_tool_call(tc["name"], tc.get("args") or {}) for tc in m.tool_calls]
            turns.append({"role": "assistant", "content": "\n".join([t for t in [text] if t] + calls)})
        elif isinstance(m, ToolMessage):
            text = text_of(m.content)
            if getattr(m, "status", "success") == "error" and not text.lower().startswith("error"):
                text = f"Error: {text}"
            turns.append({"role": "tool", "content": text})
        elif isinstance(m, FunctionMessage):
            turns.append({"role": "tool", "content": text_of(m.content)})
        elif isinstance(m, ChatMessage):
            turns.append({"role": str(m.role), "content": text_of(m.content)})
        else:
            raise UnsupportedContent(f"cannot render a {type(m).__name__} for the model")
    if system:
        turns.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return turns


def last_user_text(turns: Sequence[dict[str, str]]) -> str:
    return next((t["content"] for t in reversed(turns) if t["role"] == "user"), "")


def tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system-turn text that describes the tools (OpenAI tool dicts) and the call format."""
    lines = ["You can call these tools:"]
    for t in tools:
        fn = t["function"]
        lines.append(json.dumps({"name": fn["name"], "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters", {})}, ensure_ascii=False))
    lines.append(
        f'To call a tool, reply with only {TOOL_CALL_OPEN}{{"name": "<tool name>", "arguments": {{...}}}}'
        f"{TOOL_CALL_CLOSE}. When you have what you need, answer in plain text."
    )
    return "\n".join(lines)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_TAGGED = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S)


def _json_objects(text: str) -> list[tuple[int, int, Any]]:
    """Every top-level JSON object in `text`, with its span."""
    dec = json.JSONDecoder()
    out = []
    i = 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        out.append((i, end, obj))
        i = end
    return out


def parse_tool_calls(text: str, tool_names: Sequence[str]) -> tuple[str, list[dict], list[dict]]:
    """(remaining text, tool_calls, invalid_tool_calls) read from free model output.

    Tagged calls are taken whatever they name (a call to an unknown tool is reported invalid); bare
    JSON objects are taken only when they name a bound tool, so ordinary JSON in an answer stays text.
    """
    calls: list[dict] = []
    invalid: list[dict] = []
    spans: list[tuple[int, int]] = []
    for m in _TAGGED.finditer(text):
        spans.append(m.span())
        _read_call(m.group(1), tool_names, calls, invalid, tagged=True)
    if not spans:
        for start, end, obj in _json_objects(text):
            name = obj.get("name", obj.get("tool")) if isinstance(obj, dict) else None
            if name in tool_names:
                spans.append((start, end))
                _read_call(json.dumps(obj), tool_names, calls, invalid, tagged=False)
    rest = text
    for s, e in reversed(spans):
        rest = rest[:s] + rest[e:]
    return rest.strip(), calls, invalid


def _read_call(body: str, tool_names: Sequence[str], calls: list, invalid: list, *, tagged: bool) -> None:
    cid = new_call_id()
    try:
        obj = json.loads(body)
    except ValueError as exc:
        invalid.append({"name": None, "args": body, "id": cid, "error": f"not JSON: {exc}", "type": "invalid_tool_call"})
        return
    name = obj.get("name", obj.get("tool")) if isinstance(obj, dict) else None
    args = obj.get("arguments", obj.get("args", {})) if isinstance(obj, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if name not in tool_names or not isinstance(args, dict):
        why = f"no bound tool is named {name!r}" if name not in tool_names else "arguments are not an object"
        invalid.append({"name": name, "args": json.dumps(args, ensure_ascii=False), "id": cid, "error": why,
                        "type": "invalid_tool_call"})
        return
    calls.append({"name": name, "args": args, "id": cid, "type": "tool_call"})
