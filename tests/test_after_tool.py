"""kvmemory.adapters.after_tool: what a chat call does after a tool result (issue 41, "agents loop").

- the policy's pieces without a model: which calls were answered since the last user turn, whether
  an answer states the results, the odds of a call;
- with the embedded SmolLM2 through `run_chat` (what ChatKVGraft, KVGraftLLM and the server call):
  after a tool result the model answers, the answer states the result, the measured odds are
  reported; streamed, the chunks add up to that answer; a call that repeats an answered one is never
  made, even when the call is allowed whatever its odds.

The agents themselves (LangChain's `create_agent`, LlamaIndex's `FunctionAgent`) are run in
tests/test_agents_finish.py and the integrations' tests.
"""

from __future__ import annotations

import math

import pytest

from kvmemory import KVMemory, borrow_memory, render_tool_call, run_chat, stream_text
from kvmemory.adapters import after_tool
from kvmemory.adapters.chat import ChatRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 12 * (3 + 4).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
RESULT = "Sunny, 21 C"


def _after_weather(question: str = "What is the weather in Paris?") -> list[dict]:
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": render_tool_call("get_weather", {"city": "Paris"})},
            {"role": "tool", "content": RESULT}]


# ---------------------------------------------------------------------- without a model
def test_answered_calls_count_only_the_calls_since_the_last_user_turn():
    turns = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": render_tool_call("get_weather", {"city": "Oslo"})},
             {"role": "tool", "content": "3 C"},
             {"role": "assistant", "content": "3 C in Oslo."},
             *_after_weather("And in Paris?")]
    keys = after_tool.answered_calls(turns, ["get_weather"])
    assert keys == {after_tool.call_key("get_weather", {"city": "Paris"})}
    # The same arguments in another key order are the same call.
    assert after_tool.call_key("f", {"a": 1, "b": 2}) == after_tool.call_key("f", {"b": 2, "a": 1})
    assert after_tool.tool_results(turns) == [RESULT]
    assert after_tool.after_tool_result(turns) and not after_tool.after_tool_result(turns[:-1])


def test_states_results_reads_numbers_and_text():
    assert after_tool.states_results("It is sunny and 21 C in Paris.", ["Sunny, 21 C"])
    assert not after_tool.states_results("It is sunny in Paris.", ["Sunny, 21 C"])
    assert after_tool.states_results("About 40100000 people.", ["40,100,000"])
    assert after_tool.states_results("It was written by bram  stoker.", ["Bram Stoker"])
    assert not after_tool.states_results("Dracula is a novel.", ["Bram Stoker"])
    assert not after_tool.states_results("84", ["84", "Sunny, 21 C"])  # every result
    assert after_tool.states_results("anything", [])


def test_call_log_odds():
    assert after_tool.call_log_odds(math.log(0.5)) == pytest.approx(0.0)
    assert after_tool.call_log_odds(math.log(0.1)) == pytest.approx(math.log(0.1 / 0.9))
    assert after_tool.call_log_odds(0.0) == math.inf
    assert after_tool.CALL_MARGIN > 0  # "clearly likelier" than an answer, never less likely


# ---------------------------------------------------------------------- the embedded model
@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return borrow_memory(KVMemory(store=tmp_path_factory.mktemp("after-tool-store")))


@pytest.mark.parametrize("policy", ["scored", "model", "user_turn"])
def test_after_a_tool_result_every_policy_answers_with_the_result(shared, policy):
    req = ChatRequest(turns=_after_weather(), tools=[WEATHER, CALC], tool_policy=policy, max_tokens=32, route=False)
    out = run_chat(shared, req)
    assert out.tool_calls == [] and out.invalid_tool_calls == [] and out.finish_reason == "stop"
    assert "21" in out.text and "<tool_call>" not in out.text, out.text
    note = out.provenance()["after_tool"]
    assert note["step"] == "answer" and note["call_log_odds"] <= note["call_margin"]


def test_streamed_answer_after_a_tool_result_adds_up_to_the_answer(shared):
    req = ChatRequest(turns=_after_weather(), tools=[WEATHER, CALC], max_tokens=32, route=False)
    final = run_chat(shared, req).text
    chunks = list(stream_text(lambda on_text: run_chat(shared, req, on_text), req.held_back))
    assert "".join(c.delta for c in chunks) == chunks[-1].result.text == final


def test_a_repeated_call_is_never_made_even_when_calls_are_allowed(shared, monkeypatch):
    """With the margin at -inf every turn after a result would be a call; the model's call repeats
    the answered one (same tool, same arguments), so it answers instead."""
    monkeypatch.setattr(after_tool, "CALL_MARGIN", -math.inf)
    req = ChatRequest(turns=_after_weather(), tools=[WEATHER, CALC], max_tokens=32, route=False)
    out = run_chat(shared, req)
    note = out.provenance()["after_tool"]
    assert note["repeated_call_refused"] == "get_weather"
    assert out.tool_calls == [] and "21" in out.text
