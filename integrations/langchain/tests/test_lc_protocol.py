"""ChatKVGraft without a model: LangChain messages as chat-template turns, tool binding. (The shared
text protocol, tool_choice spellings, streamed-text hold-back and schema resolution are kvmemory's
adapter layer: tests/test_adapters.py.)"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from kvmemory import render_tool_call
from langchain_kvmemory.chat_models import to_chat
from langchain_kvmemory.errors import ToolChoiceError, UnsupportedContent


def test_to_chat_merges_system_and_replays_tool_calls():
    turns = to_chat([
        SystemMessage("be brief"), SystemMessage("be kind"), HumanMessage("What is 1 + 2"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("3", tool_call_id="c1", name="add"),
        ToolMessage("boom", tool_call_id="c2", status="error"),
    ])
    assert turns[0] == {"role": "system", "content": "be brief\n\nbe kind"}
    assert turns[1] == {"role": "user", "content": "What is 1 + 2"}
    assert turns[2] == {"role": "assistant", "content": render_tool_call("add", {"a": 1, "b": 2})}
    assert turns[3] == {"role": "tool", "content": "3"}
    assert turns[4] == {"role": "tool", "content": "Error: boom"}


def test_to_chat_refuses_images_and_maps_chat_message_roles():
    from langchain_core.messages import AIMessageChunk, ChatMessage

    with pytest.raises(UnsupportedContent):
        to_chat([HumanMessage([{"type": "text", "text": "what is this"},
                               {"type": "image", "base64": "AAAA", "mime_type": "image/png"}])])
    turns = to_chat([ChatMessage("hi", role="human"), AIMessageChunk("  hello  "), ChatMessage("x", role="critic")])
    assert turns == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                     {"role": "critic", "content": "x"}]


def test_bind_tools_binds_openai_tools_and_a_normalized_choice():
    from langchain_core.tools import tool

    from langchain_kvmemory import ChatKVGraft

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatKVGraft(store="/nonexistent/never-opened")  # nothing is loaded until a call
    bound = llm.bind_tools([add], tool_choice={"type": "function", "function": {"name": "add"}}, strict=True,
                           parallel_tool_calls=False)
    assert bound.kwargs["tool_choice"] == "add"
    assert bound.kwargs["tools"][0]["function"]["name"] == "add"
    assert set(bound.kwargs["tools"][0]["function"]["parameters"]["required"]) == {"a", "b"}
    assert "strict" not in bound.kwargs and "parallel_tool_calls" not in bound.kwargs
    with pytest.raises(ToolChoiceError):
        llm.bind_tools([add], tool_choice="subtract")
