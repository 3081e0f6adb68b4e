"""LangChain agents on ChatKVGraft finish (issue 41, "agents loop"): the real `create_agent` (LangChain
1.x) and LangGraph's `create_react_agent`, the embedded SmolLM2, no stored demonstration (a fresh
store: nothing is routed).

Before the after-result policy (`kvmemory.adapters.after_tool`) the model called `get_weather` again
after every result (GraphRecursionError at any limit), and `create_react_agent` ran `multiply` (84)
and answered "12 * 7". Here the recursion limit allows three model calls: a call, an answer, and one
spare; the model must call the right tool once and answer with what it returned.
"""

from __future__ import annotations

import warnings

import pytest
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool

from langchain_kvmemory import ChatKVGraft
from lc_testutil import fresh_store

MAX_CALLS = 3


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny, 21 C in {city}"


class CountCalls(BaseCallbackHandler):
    """Counts model calls (every chat model start)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_chat_model_start(self, *args, **kwargs) -> None:
        self.calls += 1


@pytest.fixture(scope="module")
def llm() -> ChatKVGraft:
    # max_tokens=32: the setting (the default 256 behaves the same, only slower to fail).
    return ChatKVGraft(store=fresh_store(), max_tokens=32)


def _run(agent, question: str) -> tuple[list, int]:
    count = CountCalls()
    # A model call and a tool step are one graph step each: 2 * MAX_CALLS steps allow MAX_CALLS calls.
    out = agent.invoke({"messages": [("user", question)]}, {"recursion_limit": 2 * MAX_CALLS, "callbacks": [count]})
    return out["messages"], count.calls


def _calls(messages) -> list[tuple[str, dict]]:
    return [(c["name"], c["args"]) for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]


def test_create_agent_calls_the_weather_once_and_answers_with_it(llm):
    messages, calls = _run(create_agent(llm, [multiply, get_weather]), "What is the weather in Paris?")
    assert calls <= MAX_CALLS
    assert _calls(messages) == [("get_weather", {"city": "Paris"})]
    [result] = [m.content for m in messages if isinstance(m, ToolMessage)]
    final = messages[-1]
    assert isinstance(final, AIMessage) and final.tool_calls == []
    assert "21" in final.content, final.content  # the tool's result, stated
    assert final.response_metadata["kvmemory"]["after_tool"]["step"] == "answer"
    assert result == "Sunny, 21 C in Paris"


def test_create_agent_answer_states_the_product(llm):
    messages, calls = _run(create_agent(llm, [multiply, get_weather]), "What is 12 times 7?")
    assert calls <= MAX_CALLS and _calls(messages) == [("multiply", {"a": 12, "b": 7})]
    assert isinstance(messages[-1], AIMessage) and messages[-1].tool_calls == []
    assert "84" in messages[-1].content, messages[-1].content


def test_langgraph_create_react_agent_answers_with_the_result(llm):
    with warnings.catch_warnings():  # deprecated in favour of create_agent, still what many scripts use
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

        agent = create_react_agent(llm, [multiply])
    messages, calls = _run(agent, "What is 12 times 7?")
    assert calls <= MAX_CALLS and _calls(messages) == [("multiply", {"a": 12, "b": 7})]
    assert "84" in messages[-1].content, messages[-1].content
