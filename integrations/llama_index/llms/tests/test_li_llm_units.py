"""Model-free parts of KVGraftLLM: LlamaIndex's roles mapped onto the chat template's. (The streamed
text's bookkeeping is kvmemory's adapter layer: tests/test_adapters.py.)"""

from __future__ import annotations


def test_roles_map_onto_the_chat_template():
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.llms.kvgraft import to_kv_messages

    roles = [MessageRole.SYSTEM, MessageRole.DEVELOPER, MessageRole.USER, MessageRole.ASSISTANT,
             MessageRole.CHATBOT, MessageRole.MODEL, MessageRole.TOOL, MessageRole.FUNCTION]
    msgs = [ChatMessage(role=r, content=f"m{i}") for i, r in enumerate(roles)]
    # System and developer messages become one leading system turn, as chat templates expect.
    assert to_kv_messages(msgs) == [{"role": "system", "content": "m0\n\nm1"}] + [
        {"role": role, "content": f"m{i}"} for i, role in enumerate(
            ["user", "assistant", "assistant", "assistant", "tool", "tool"], start=2)]
    assert [m["role"] for m in to_kv_messages(msgs, tool_role="user")][-2:] == ["user", "user"]
    assert to_kv_messages([ChatMessage(role=MessageRole.USER, content=None)]) == [{"role": "user", "content": ""}]


def test_tool_calls_are_replayed_and_read_back():
    import pytest
    from kvmemory import InvalidInput, UnsupportedContent
    from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ImageBlock, MessageRole, TextBlock,
                                                  ThinkingBlock, ToolCallBlock)
    from llama_index.llms.kvgraft import to_kv_messages, tool_selections

    call = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 7}}</tool_call>'
    blocks = ChatMessage(role=MessageRole.ASSISTANT, blocks=[
        TextBlock(text=""), ThinkingBlock(content="hidden"),
        ToolCallBlock(tool_call_id="c1", tool_name="multiply", tool_kwargs={"a": 12, "b": 7})])
    # An older integration's OpenAI-style calls (arguments as a JSON string) read the same way.
    legacy = ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 12, "b": 7}'}}]})
    result = ChatMessage(role=MessageRole.TOOL, content="84", additional_kwargs={"tool_call_id": "c1"})
    for assistant in (blocks, legacy):
        assert to_kv_messages([ChatMessage(role=MessageRole.USER, content="12 times 7?"), assistant, result]) == [
            {"role": "user", "content": "12 times 7?"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "84"}]
    [sel] = tool_selections(ChatResponse(message=blocks))
    assert (sel.tool_id, sel.tool_name, sel.tool_kwargs) == ("c1", "multiply", {"a": 12, "b": 7})
    assert tool_selections(ChatResponse(message=result)) == []

    with pytest.raises(UnsupportedContent):
        to_kv_messages([ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="http://example.invalid/a.png")])])
    for bad in ("hi", None, [("user", "hi")], ChatMessage(role=MessageRole.USER, content="hi")):
        with pytest.raises(InvalidInput):
            to_kv_messages(bad)
