"""ChatKVGraft counts tokens with the model's own tokenizer, offline, without loading the model:
`get_token_ids`, `get_num_tokens`, `get_num_tokens_from_messages` (with tools) and LangChain's
`trim_messages(token_counter=llm)`."""

from __future__ import annotations

import os
import socket
import time

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage, trim_messages
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

from kvmemory import render_ids, tokenizer_for
from langchain_kvmemory import ChatKVGraft
from lc_testutil import seeded_store

# Never opened: counting tokens needs no store and no engine.
_NO_STORE = "/nonexistent/kvmemory-token-count-store"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny in {city}"


def _history() -> list:
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "c1", "type": "tool_call"}
    return [SystemMessage("You are a terse assistant."), HumanMessage("What is 2 + 2?"), AIMessage("4"),
            HumanMessage("What's the weather in Paris?"), AIMessage("", tool_calls=[call]),
            ToolMessage("Sunny, 21 C", tool_call_id="c1"), AIMessage("It is sunny in Paris, 21 C."),
            HumanMessage("And what is 3 + 3?")]


def _template_ids(turns: list[dict], tools: list | None = None) -> list[int]:
    """What the model reads, rendered here with transformers' own chat template and tokenizer."""
    tok = tokenizer_for(None)
    if tools:
        from kvmemory.adapters.messages import tools_prompt, with_instructions

        turns = with_instructions(turns, tools_prompt(tools))
    return render_ids(tok, turns, add_generation_prompt=True)


def test_trim_messages_counts_offline_with_the_models_tokenizer(monkeypatch):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest.py; the old fallback retried the hub here
    attempts = []

    def no_network(self, address, *a, **k):
        attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    llm = ChatKVGraft(store=_NO_STORE)
    msgs = _history()
    t0 = time.perf_counter()
    total = llm.get_num_tokens_from_messages(msgs)
    kept = trim_messages(msgs, max_tokens=total - 1, token_counter=llm, strategy="last", include_system=True,
                         start_on="human")
    seconds = time.perf_counter() - t0
    print(f"count + trim_messages: {seconds:.3f} s (first use loads the tokenizer)")
    assert attempts == []
    assert llm.memory is None  # no engine was opened to count
    # The count is what the model reads: every turn through its chat template, the assistant turn opened.
    from langchain_kvmemory.chat_models import to_chat

    assert total == len(_template_ids(to_chat(msgs)))
    # Trimmed to the budget from the end: the system message, then the last turns that fit.
    assert isinstance(kept[0], SystemMessage) and kept[-1] == msgs[-1] and len(kept) < len(msgs)
    assert llm.get_num_tokens_from_messages(kept) <= total - 1
    # The same trim with a counter written here from the tokenizer keeps the same messages.
    own = trim_messages(msgs, max_tokens=total - 1, strategy="last", include_system=True, start_on="human",
                        token_counter=lambda ms: len(_template_ids(to_chat(ms))) if ms else 0)
    assert kept == own


def test_text_token_ids_are_the_tokenizers_own():
    llm = ChatKVGraft(store=_NO_STORE)
    tok = tokenizer_for(None)
    for text in ["Hello world", " leading space", "12 * 8 = 96", "émigré 東京 🙂", "<|im_start|> literal", ""]:
        ids = llm.get_token_ids(text)
        assert ids == list(tok(text, add_special_tokens=False)["input_ids"])
        assert llm.get_num_tokens(text) == len(ids)


def test_tools_are_counted_as_the_call_describes_them():
    llm = ChatKVGraft(store=_NO_STORE)
    msgs = [HumanMessage("What's the weather in Oslo?")]
    with_tools = llm.get_num_tokens_from_messages(msgs, tools=[get_weather])
    assert with_tools == len(_template_ids([{"role": "user", "content": msgs[0].content}],
                                           [convert_to_openai_tool(get_weather)]))
    assert with_tools > llm.get_num_tokens_from_messages(msgs)


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tools"])
def test_counts_equal_the_input_tokens_of_a_call_that_routes_nothing(tools):
    llm = ChatKVGraft(store=seeded_store(), route=False, max_tokens=1, tool_policy="model")
    msgs = [SystemMessage("Answer briefly."), HumanMessage("Name a colour."), AIMessage("Blue."),
            HumanMessage("Another one?")]
    runnable = llm.bind_tools([get_weather]) if tools else llm
    used = runnable.invoke(msgs).usage_metadata["input_tokens"]
    assert used == llm.get_num_tokens_from_messages(msgs, tools=[get_weather] if tools else None)


def test_a_model_holding_an_engine_counts_with_the_engines_tokenizer():
    from kvmemory import shared_memory

    mem = shared_memory(None, seeded_store())
    llm = ChatKVGraft(memory=mem)
    assert llm._tokenizer() is mem.engine.tokenizer
    text = "Tom has 3 boxes of 12 eggs."
    assert llm.get_token_ids(text) == mem.engine.encode(text)
    # The engine's tokenizer and the one read on its own agree on every id.
    assert ChatKVGraft(store=_NO_STORE).get_token_ids(text) == mem.engine.encode(text)
    msgs = _history()
    assert llm.get_num_tokens_from_messages(msgs) == ChatKVGraft(store=_NO_STORE).get_num_tokens_from_messages(msgs)
