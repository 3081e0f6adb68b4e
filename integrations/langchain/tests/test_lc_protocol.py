"""The text protocol and option handling of ChatKVGraft (no model): message rendering, tool-call
parsing, tool_choice spellings, stop-string hold-back while streaming, schema resolution."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from langchain_kvmemory._guided import fields_of, resolve
from langchain_kvmemory._protocol import parse_tool_calls, render_tool_call, text_of, to_chat
from langchain_kvmemory.chat_models import _safe_text, normalize_tool_choice
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


def test_text_of_reads_text_blocks_and_refuses_images():
    assert text_of([{"type": "text", "text": "a"}, {"type": "tool_use", "id": "x", "name": "t", "input": {}},
                    {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(UnsupportedContent):
        text_of([{"type": "image", "base64": "AAAA", "mime_type": "image/png"}])


def test_parse_tool_calls_tagged_bare_and_invalid():
    rest, calls, bad = parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', ["add"])
    assert rest == "ok" and calls[0]["name"] == "add" and calls[0]["args"] == {"a": 1} and not bad
    assert calls[0]["id"].startswith("call_")
    rest, calls, bad = parse_tool_calls('{"tool": "add", "arguments": {"a": 2}}', ["add"])
    assert calls[0]["args"] == {"a": 2} and rest == ""
    rest, calls, bad = parse_tool_calls('the JSON {"name": "other", "x": 1} stays text', ["add"])
    assert not calls and not bad and rest.startswith("the JSON")
    _, calls, bad = parse_tool_calls("<tool_call>{not json}</tool_call>", ["add"])
    assert not calls and bad[0]["error"].startswith("not JSON")
    _, calls, bad = parse_tool_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', ["add"])
    assert not calls and "nope" in bad[0]["error"]


def test_tool_choice_spellings():
    names = ["add", "mul"]
    assert normalize_tool_choice(None, names) == "auto"
    assert normalize_tool_choice("none", names) == "none"
    for any_ in ("any", "required", True, {"type": "any"}):
        assert normalize_tool_choice(any_, names) == "any"
    assert normalize_tool_choice("mul", names) == "mul"
    assert normalize_tool_choice({"type": "function", "function": {"name": "add"}}, names) == "add"
    assert normalize_tool_choice({"type": "tool", "name": "add"}, names) == "add"
    with pytest.raises(ToolChoiceError):
        normalize_tool_choice("div", names)
    with pytest.raises(ToolChoiceError):
        normalize_tool_choice("any", [])


def test_streamed_text_holds_back_partial_stop_strings():
    assert _safe_text("  Hello yo", ["you"]) == "Hello"          # "yo" may still become "you"
    assert _safe_text("Hello you there", ["you"]) == "Hello"
    assert _safe_text("Hello there ", ["you"]) == "Hello there"   # trailing space is not final yet
    assert _safe_text("a <tool", ["<tool_call>"]) == "a"


def test_schema_resolution_follows_refs_and_unions():
    root = {"$defs": {"P": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                             "o": {"anyOf": [{"type": "null"}, {"type": "string"}]}},
            "required": ["p"]}
    assert resolve(root["properties"]["p"], root)["properties"]["n"]["type"] == "integer"
    assert resolve(root["properties"]["o"], root)["type"] == "string"
    assert fields_of(root) == ["p"]
    assert fields_of({"type": "object", "properties": {"a": {}, "b": {}}}) == ["a", "b"]


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
