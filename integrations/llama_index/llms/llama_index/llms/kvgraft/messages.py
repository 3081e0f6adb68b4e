"""LlamaIndex chat messages as kvmemory's chat-template turns, and tool calls both ways.

LlamaIndex 0.14 carries an assistant's tool calls as `ToolCallBlock`s among the message's blocks (older
integrations put OpenAI-style dicts in `additional_kwargs["tool_calls"]`: both are read), and a tool's
result as a TOOL message. Everything is reduced to `kvmemory.Message` and laid out by
`kvmemory.to_turns`, the layout the LangChain integration uses too: one leading system turn, earlier
tool calls replayed in the assistant turn in the tool-call text protocol.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvmemory import InvalidInput, Message, text_of, to_turns
from llama_index.core.base.llms.types import (CachePoint, ChatMessage, ChatResponse, MessageRole, TextBlock,
                                              ThinkingBlock, ToolCallBlock)
from llama_index.core.llms.llm import ToolSelection


def _args(value: Any) -> Any:
    """A tool call's arguments as an object where they are one (a JSON string is read)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def to_message(m: ChatMessage) -> Message:
    """One LlamaIndex message as a `kvmemory.Message`: its text blocks joined by newlines (as
    `ChatMessage.content` joins them), its tool calls; images, audio, video and documents are refused
    (`UnsupportedContent`: the model reads text only) instead of silently dropped."""
    if not isinstance(m, ChatMessage):
        raise InvalidInput(f"messages must be llama_index ChatMessage objects, got {type(m).__name__}")
    role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
    texts: list[str] = []
    calls: list[tuple[str, Any]] = []
    for block in m.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            calls.append((block.tool_name, _args(block.tool_kwargs)))
        elif isinstance(block, (ThinkingBlock, CachePoint)):
            continue  # not something the model said / a provider's caching hint
        else:
            text_of([{"type": block.block_type}])  # raises the shared UnsupportedContent
    if not calls:  # the OpenAI-style spelling of older integrations
        for tc in m.additional_kwargs.get("tool_calls") or ():
            fn = tc.get("function", {}) if isinstance(tc, dict) else {}
            if fn.get("name"):
                calls.append((fn["name"], _args(fn.get("arguments") or {})))
    return Message(role, "\n".join(texts), calls)


def to_kv_messages(messages: Sequence[ChatMessage], tool_role: str = "tool") -> list[dict[str, str]]:
    """LlamaIndex chat messages as chat-template turns (`kvmemory.to_turns`: system messages merged into
    one leading turn, earlier tool calls replayed). Tool output keeps its own role (`tool_role`):
    kvmemory routes on the last *user* message, so an observation sent as a user turn would replace the
    question as what is routed."""
    if isinstance(messages, (str, bytes, ChatMessage)) or not isinstance(messages, Sequence):
        raise InvalidInput(f"messages must be a list of llama_index ChatMessage objects, got {type(messages).__name__}")
    return to_turns([to_message(m) for m in messages], tool_role)


def tool_call_blocks(tool_calls: Sequence[dict]) -> list[ToolCallBlock]:
    """kvmemory's tool calls ({"name", "args", "id"}) as LlamaIndex blocks."""
    return [ToolCallBlock(tool_call_id=tc["id"], tool_name=tc["name"], tool_kwargs=tc["args"]) for tc in tool_calls]


def openai_tool_calls(tool_calls: Sequence[dict]) -> list[dict]:
    """kvmemory's tool calls in OpenAI's spelling (arguments as a JSON string)."""
    return [{"id": tc["id"], "type": "function",
             "function": {"name": tc["name"], "arguments": json.dumps(tc["args"], ensure_ascii=False)}}
            for tc in tool_calls]


def tool_selections(response: ChatResponse) -> list[ToolSelection]:
    """The tool calls a response's message carries, as LlamaIndex's agents run them."""
    out = []
    for block in response.message.blocks:
        if isinstance(block, ToolCallBlock):
            args = _args(block.tool_kwargs)
            out.append(ToolSelection(tool_id=block.tool_call_id or "", tool_name=block.tool_name,
                                     tool_kwargs=args if isinstance(args, dict) else {}))
    return out
