"""Model-free parts of KVGraftLLM: the streaming bridge's text bookkeeping (deltas add up to the final
answer text) and the mapping of LlamaIndex roles onto the chat template's."""

from __future__ import annotations

import pytest
from llama_index.llms.kvgraft._stream import Visible


def _feed(vis: Visible, pieces: list[str]) -> list[str]:
    raw, out = "", []
    for p in pieces:
        raw += p
        out.append(vis.update(raw))
    return out


def test_leading_and_trailing_whitespace_are_held_back():
    vis = Visible()
    assert _feed(vis, ["\n", " Hello", " ", "world", "  "]) == ["", "Hello", "", " world", ""]
    assert vis.finish("Hello world") == ""


def test_a_partial_stop_string_is_not_shown_and_a_whole_one_cuts():
    vis = Visible(["Observation:"])
    deltas = _feed(vis, ["Action: add", "\nObs", "ervation", ": 19"])
    assert "".join(deltas) == "Action: add"
    assert all("Obs" not in d for d in deltas)
    assert vis.finish("Action: add") == ""


def test_a_false_alarm_is_released_once_it_cannot_be_a_stop_string():
    vis = Visible(["STOP"])
    assert _feed(vis, ["go ST", "ill"]) == ["go", " STill"]


@pytest.mark.parametrize("final", ["abc", "abc def"])
def test_finish_returns_what_was_not_shown(final):
    vis = Visible()
    vis.update("abc")
    assert vis.shown + vis.finish(final) == final


def test_roles_map_onto_the_chat_template():
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.llms.kvgraft import to_kv_messages

    roles = [MessageRole.SYSTEM, MessageRole.DEVELOPER, MessageRole.USER, MessageRole.ASSISTANT,
             MessageRole.CHATBOT, MessageRole.MODEL, MessageRole.TOOL, MessageRole.FUNCTION]
    msgs = [ChatMessage(role=r, content=f"m{i}") for i, r in enumerate(roles)]
    assert to_kv_messages(msgs) == [
        {"role": role, "content": f"m{i}"} for i, role in enumerate(
            ["system", "system", "user", "assistant", "assistant", "assistant", "tool", "tool"])]
    assert [m["role"] for m in to_kv_messages(msgs, tool_role="user")][-2:] == ["user", "user"]
    assert to_kv_messages([ChatMessage(role=MessageRole.USER, content=None)]) == [{"role": "user", "content": ""}]
