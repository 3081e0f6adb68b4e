"""LlamaIndex's `FunctionAgent` on KVGraftLLM finishes (issue 41, "agents loop"): the embedded SmolLM2,
no stored demonstration (its own empty namespace: nothing is routed), the agent's default streaming.

Before the after-result policy (`kvmemory.adapters.after_tool`) `FunctionAgent([get_weather])` called
the tool after every result until "Max iterations of 20 reached". Here the agent may take three steps
(model calls): it must call the right tool once and answer with what the tool returned.
"""

from __future__ import annotations

import asyncio

import pytest
from kvmemory import KVMemory
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool
from llama_index.llms.kvgraft import KVGraftLLM

MAX_CALLS = 3


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny, 21 C in {city}"


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


@pytest.fixture(scope="module")
def llm(li_memory):
    mem = KVMemory(engine=li_memory.engine, router=li_memory.router, namespace="li-agents-finish")
    assert mem.store.list_entries("li-agents-finish") == []  # no demonstration to route to
    return KVGraftLLM(memory=mem, max_new_tokens=32)


def _run(llm, tools, question: str):
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(t) for t in tools], llm=llm)

    async def go():
        handler = agent.run(user_msg=question, max_iterations=MAX_CALLS)
        events = [ev async for ev in handler.stream_events()]
        return await handler, events

    result, events = asyncio.run(go())
    steps = [e for e in events if isinstance(e, AgentOutput)]
    calls = [(e.tool_name, e.tool_kwargs) for e in events if isinstance(e, ToolCallResult)]
    return result, steps, calls


def test_function_agent_with_one_tool_finishes(llm):
    result, steps, calls = _run(llm, [get_weather], "What is the weather in Paris?")
    assert len(steps) <= MAX_CALLS and calls == [("get_weather", {"city": "Paris"})]
    assert steps[-1].raw["tool_calls"] == []  # the model's own calls on its last step: none
    assert "21" in result.response.content, result.response.content
    assert steps[-1].raw["after_tool"]["step"] == "answer"


def test_function_agent_with_two_tools_answers_with_the_result(llm):
    result, steps, calls = _run(llm, [multiply, get_weather], "What is 12 times 7?")
    assert len(steps) <= MAX_CALLS and calls == [("multiply", {"a": 12, "b": 7})]
    assert "84" in result.response.content, result.response.content
