"""ChatKVGraft on the embedded model, beyond the standard suite: routed grafts and their provenance,
stop strings, streaming equal to invoke, max_tokens, tool calls decoded under their schema, and the
default tool policy deciding between a call and an answer."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_kvmemory import ChatKVGraft
from kvmemory import shared_memory
from kvmemory.memory.layout import preamble
from langchain_kvmemory.errors import UnsupportedContent
from lc_testutil import PROBLEMS, seeded_store


@pytest.fixture(scope="module")
def llm() -> ChatKVGraft:
    return ChatKVGraft(store=seeded_store(), max_tokens=12)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def lookup_city(city: str) -> str:
    """Look up facts about a city."""
    return city


def test_routed_question_grafts_the_verified_entry(llm):
    mem = shared_memory(None, seeded_store())
    target = PROBLEMS[2]
    entry = next(e for e in mem.store.list_entries("default") if e.problem == target.text)
    msg = llm.invoke(target.rewordings[1])
    kv = msg.response_metadata["kvmemory"]
    assert [e["id"] for e in kv["entries"]] == [entry.id]
    assert kv["entries"][0]["verified"] is True
    assert kv["entries"][0]["attestation_id"] == entry.attestation["attestation_id"]
    # Without a system turn the entry's own stored ids start the prompt: all of them are grafted (its
    # last block a tail block ending at the entry's end, a cut: memory/layout.py).
    assert msg.usage_metadata["input_token_details"]["cache_read"] == len(entry.token_ids) > 0
    assert kv["tokens_grafted"] + kv["tokens_computed"] == msg.usage_metadata["input_tokens"]
    assert kv["tokens_decoded"] == msg.usage_metadata["output_tokens"] <= 12


def test_unrelated_question_routes_to_nothing(llm):
    msg = llm.invoke("Who painted the Mona Lisa?")
    assert msg.response_metadata["kvmemory"]["entries"] == []
    # nothing of its own read from the store: at most the chat template's preamble (its default system
    # turn, a cut of every entry-less prompt: kvmemory/memory/layout.py), which an earlier call stored
    assert msg.usage_metadata["input_token_details"]["cache_read"] in (0, len(preamble(llm._tokenizer())))
    assert ChatKVGraft(store=seeded_store(), route=False, max_tokens=4).invoke(
        PROBLEMS[0].text).response_metadata["kvmemory"]["entries"] == []


def test_stop_cuts_where_the_full_answer_has_it(llm):
    full = llm.invoke("Hello").content
    assert "assist" in full, full  # greedy SmolLM2: "Hello! How can I assist you today?"
    cut = llm.invoke("Hello", stop=["assist"])
    assert cut.content == full[: full.index("assist")].strip()
    assert cut.response_metadata["finish_reason"] == "stop"
    streamed = "".join(c.content for c in llm.stream("Hello", stop=["assist"]))
    assert streamed == cut.content


def test_stream_equals_invoke_and_reports_usage_once(llm):
    chunks = list(llm.stream("Hello"))
    assert len(chunks) > 2  # really streamed, token by token
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == llm.invoke("Hello").content
    assert sum(1 for c in chunks if c.usage_metadata) == 1 and chunks[-1].chunk_position == "last"


def test_max_tokens_is_a_hard_limit(llm):
    msg = llm.invoke("Write a long story about a dragon.", max_tokens=5)
    assert msg.usage_metadata["output_tokens"] == 5
    assert msg.response_metadata["finish_reason"] == "length"


def test_async_invoke_is_the_same_greedy_answer(llm):
    assert asyncio.run(llm.ainvoke("Hello")).content == llm.invoke("Hello").content


def test_named_tool_choice_decodes_typed_arguments(llm):
    msg = llm.bind_tools([multiply, lookup_city], tool_choice="multiply").invoke("What is 6 times 7?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "multiply"
    assert msg.tool_calls[0]["args"] == {"a": 6, "b": 7}
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert msg.response_metadata["kvmemory"]["tokens_forced"] > 0


def test_any_tool_choice_lets_the_model_pick_the_tool(llm):
    msg = llm.bind_tools([multiply, lookup_city], tool_choice="any").invoke("Tell me about the city of Paris.")
    assert msg.tool_calls[0]["name"] == "lookup_city"
    assert "Paris" in msg.tool_calls[0]["args"]["city"]


def test_model_policy_answers_in_text_and_reads_tool_results(llm):
    bound = llm.bind_tools([multiply], tool_policy="model")
    assert bound.invoke("Hello").tool_calls == []
    call = AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7}, "id": "c1", "type": "tool_call"}])
    answer = bound.invoke([HumanMessage("What is 6 times 7?"), call, ToolMessage("42", tool_call_id="c1")])
    assert answer.tool_calls == [] and answer.content


def test_structured_output_json_schema(llm):
    class City(BaseModel):
        """A city and its country."""

        name: str = Field(description="the city")
        country: str = Field(description="the country it is in")

    got = llm.with_structured_output(City, method="json_schema").invoke("Paris is the capital of France.")
    assert isinstance(got, City) and got.name


def test_images_are_refused_with_a_typed_error(llm):
    with pytest.raises(UnsupportedContent):
        llm.invoke([HumanMessage([{"type": "text", "text": "what is this"},
                                  {"type": "image", "base64": "AAAA", "mime_type": "image/png"}])])


def test_unknown_call_argument_is_refused(llm):
    with pytest.raises(TypeError):
        llm.invoke("Hello", max_token=3)


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny in {city}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. 12 * (3 + 4)."""
    return expression


def test_default_policy_calls_the_tool_an_agent_question_needs(llm):
    """tool_choice "auto" with the default tool_policy ("scored"): the model's likelihoods pick the
    call, and its arguments are decoded under the tool's schema."""
    bound = llm.bind_tools([get_weather, calculator])
    weather = bound.invoke("What's the weather in Berlin today?")
    assert [(c["name"], c["args"]) for c in weather.tool_calls] == [("get_weather", {"city": "Berlin"})]
    assert weather.response_metadata["finish_reason"] == "tool_calls" and weather.invalid_tool_calls == []
    sums = bound.invoke("What is 347 multiplied by 29?")
    assert [c["name"] for c in sums.tool_calls] == ["calculator"]
    assert sums.tool_calls[0]["args"]["expression"].replace(" ", "") in ("347*29", "347x29")


def test_default_policy_answers_what_needs_no_tool(llm):
    msg = llm.bind_tools([get_weather, calculator]).invoke("Write a short poem about the sea.")
    assert msg.tool_calls == [] and msg.invalid_tool_calls == [] and msg.content.strip()
    assert msg.response_metadata["finish_reason"] in ("stop", "length")


def test_default_policy_answers_after_the_tool_result(llm):
    call = AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Berlin"}, "id": "c1",
                                      "type": "tool_call"}])
    history = [HumanMessage("What's the weather in Berlin today?"), call,
               ToolMessage("Sunny, 21 C", tool_call_id="c1")]
    answer = llm.bind_tools([get_weather, calculator]).invoke(history)
    assert answer.tool_calls == [] and answer.content.strip()
