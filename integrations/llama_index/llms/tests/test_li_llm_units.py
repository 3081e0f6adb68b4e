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
