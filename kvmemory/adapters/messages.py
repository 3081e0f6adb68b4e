"""Framework messages as chat-template turns, and the text protocol for tools.

Every framework has its own message classes; an adapter reduces each to a `Message` (role, text or
content blocks, the tool calls an assistant made, whether a tool result is an error) and `to_turns`
lays them out the same way for every framework: the frameworks' role spellings mapped onto the
template's ("system", "user", "assistant", "tool"), system messages merged into one leading turn
(where chat templates expect it, and where `KVMemory.chat_ids` puts routed entries after it), earlier
tool calls replayed in the assistant turn, failed tool results marked as errors.

Tools are described in the system turn as one JSON object each, and a tool call is written in the
assistant turn as

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 8"}}</tool_call>

which is how earlier calls are replayed to the model; `parse_tool_calls` reads that format (and a
bare `{"tool": ..., "arguments": ...}` object) out of free model output, for models that call tools
on their own. Tools are OpenAI tool dicts ({"type": "function", "function": {"name", "description",
"parameters"}}), which both frameworks produce.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvmemory.adapters.errors import ToolChoiceError, UnsupportedContent

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# The frameworks' role names onto the four a chat template knows. A role not listed is passed on as
# it is (the template may know it).
TEMPLATE_ROLES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant", "chatbot": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool",
}

# Content blocks that carry no text for the model: tool calls are replayed from `Message.tool_calls`,
# and reasoning / thinking blocks of other providers are not part of what this model said.
_SKIPPED_BLOCKS = {"tool_use", "tool_call", "tool_call_chunk", "function_call", "thinking", "reasoning",
                   "redacted_thinking", "server_tool_call", "server_tool_result"}
_NON_TEXT_BLOCKS = {"image", "image_url", "input_image", "audio", "input_audio", "file", "video", "document"}


@dataclass(slots=True, frozen=True)
class Message:
    """One framework message, reduced to what the model reads."""

    role: str
    content: str | Sequence[Any] = ""  # text, or content blocks (strings and {"type": ...} dicts)
    tool_calls: Sequence[tuple[str, dict]] = ()  # (name, arguments) of the calls an assistant made
    error: bool = False  # a tool result that reports a failure


def text_of(content: str | Sequence[Any] | None) -> str:
    """The text of a message's content; raises UnsupportedContent for images, audio and files."""
    if content is None:
        return ""
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


def template_role(role: str, tool_role: str = "tool") -> str:
    """The chat-template role of a framework's role name; tool output takes `tool_role` (a template
    that refuses a "tool" role can be given "user", at the cost of routing on tool output)."""
    role = TEMPLATE_ROLES.get(str(role).lower(), str(role))
    return tool_role if role == "tool" else role


def to_turns(messages: Iterable[Message], tool_role: str = "tool") -> list[dict[str, str]]:
    """Messages as {"role", "content"} turns; system messages are merged into one leading turn."""
    system: list[str] = []
    turns: list[dict[str, str]] = []
    for m in messages:
        role, text = template_role(m.role, tool_role), text_of(m.content)
        if role == "system":
            if text.strip():
                system.append(text.strip())
        elif role == "assistant":
            calls = [render_tool_call(name, args or {}) for name, args in m.tool_calls]
            turns.append({"role": role, "content": "\n".join([t for t in [text.strip()] if t] + calls)})
        else:
            if m.error and not text.lower().startswith("error"):
                text = f"Error: {text}"
            turns.append({"role": role, "content": text})
    if system:
        turns.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return turns


def last_user_text(turns: Sequence[dict[str, str]]) -> str:
    """What a chat call routes on: its last user turn."""
    return next((t["content"] for t in reversed(turns) if t["role"] == "user"), "")


def with_instructions(turns: Sequence[dict[str, str]], *instructions: str) -> list[dict[str, str]]:
    """`turns` with `instructions` at the end of the system turn (one is added when there is none)."""
    out = [dict(t) for t in turns]
    extra = [i for i in instructions if i]
    if not extra:
        return out
    if out and out[0]["role"] == "system":
        out[0]["content"] = "\n\n".join([out[0]["content"], *extra])
    else:
        out.insert(0, {"role": "system", "content": "\n\n".join(extra)})
    return out


# ---------------------------------------------------------------------- tools
def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


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


def tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system-turn text that describes the tools and the call format."""
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


def schema_prompt(schema: dict) -> str:
    """The system-turn text that asks for JSON output following `schema`."""
    if schema == {"type": "object"}:  # response_format json_object: any JSON object
        return "Reply with one JSON object."
    return "Reply with one JSON object that follows this JSON schema: " + json.dumps(schema, ensure_ascii=False)


def render_tool_call(name: str, args: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, args: dict, call_id: str | None = None) -> dict:
    """A tool call as both frameworks' messages carry it."""
    return {"name": name, "args": args, "id": call_id or new_call_id(), "type": "tool_call"}


def invalid_tool_call(name: str | None, args: str, error: str, call_id: str | None = None) -> dict:
    """A tool call the model wrote that cannot be run (unknown tool, arguments that are not an object)."""
    return {"name": name, "args": args, "id": call_id or new_call_id(), "error": error, "type": "invalid_tool_call"}


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


def parse_tool_calls(text: str, names: Sequence[str]) -> tuple[str, list[dict], list[dict]]:
    """(remaining text, tool_calls, invalid_tool_calls) read from free model output.

    Tagged calls are taken whatever they name (a call to an unknown tool is reported invalid); bare
    JSON objects are taken only when they name a bound tool, so ordinary JSON in an answer stays text.
    """
    calls: list[dict] = []
    invalid: list[dict] = []
    spans: list[tuple[int, int]] = []
    for m in _TAGGED.finditer(text):
        spans.append(m.span())
        _read_call(m.group(1), names, calls, invalid)
    if not spans:
        for start, end, obj in _json_objects(text):
            name = obj.get("name", obj.get("tool")) if isinstance(obj, dict) else None
            if name in names:
                spans.append((start, end))
                _read_call(json.dumps(obj), names, calls, invalid)
    rest = text
    for s, e in reversed(spans):
        rest = rest[:s] + rest[e:]
    return rest.strip(), calls, invalid


def _read_call(body: str, names: Sequence[str], calls: list, invalid: list) -> None:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        invalid.append(invalid_tool_call(None, body, f"not JSON: {exc}"))
        return
    name = obj.get("name", obj.get("tool")) if isinstance(obj, dict) else None
    args = obj.get("arguments", obj.get("args", {})) if isinstance(obj, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if name not in names or not isinstance(args, dict):
        why = f"no bound tool is named {name!r}" if name not in names else "arguments are not an object"
        invalid.append(invalid_tool_call(name, json.dumps(args, ensure_ascii=False), why))
        return
    calls.append(tool_call(name, args))
