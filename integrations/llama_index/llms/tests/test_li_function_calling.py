"""KVGraftLLM as a LlamaIndex `FunctionCallingLLM` on the embedded SmolLM2, offline, with the real
LlamaIndex classes: `FunctionAgent` and `AgentWorkflow` call a real tool and answer;
`chat_with_tools` (sync, async, streamed) with a required, a named and no tool choice;
`structured_predict` / `as_structured_llm` through the schema-guided decoder.

Tool calls are kvmemory's (`kvmemory.run_chat`, the call LangChain's ChatKVGraft makes) under the
default tool policy. Nothing the model says is scripted: a verified demonstration of the tool-call
protocol ("What is 12 times 9?", called multiply, answered 108) is remembered, routed to and put before
the conversation, the way kvmemory gives any agent a worked solution; the test checks that the
framework ran the tool the model called, sent the result back as a tool message, and got the model's
answer.
"""

from __future__ import annotations

import asyncio

import pytest
from kvmemory import InvalidInput, KVMemory, ToolChoiceError
from llama_index.core.agent.workflow import (AgentInput, AgentOutput, AgentWorkflow, FunctionAgent,
                                             ToolCallResult)
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.kvgraft import KVGraftLLM, to_kv_messages
from pydantic import BaseModel

NS = "li-function-calling"
DEMO_PROBLEM = "What is 12 times 9?"
DEMO_SOLUTION = ('<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 9}}</tool_call>\n'
                 "The multiply tool returned 108, so 12 * 9 = 108. The answer is 108.")
QUESTION = "What is 12 times 7?"


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


@pytest.fixture(scope="module")
def fc(li_memory):
    """An LLM over the shared engine and router, in its own namespace, with the demonstration stored."""
    mem = KVMemory(engine=li_memory.engine, router=li_memory.router, namespace=NS)
    demo = mem.remember(DEMO_PROBLEM, DEMO_SOLUTION, "108", verifier="arithmetic")
    assert demo.verified
    return KVGraftLLM(memory=mem, max_new_tokens=24), demo


def _run(workflow, question: str):
    async def go():
        handler = workflow.run(user_msg=question, max_iterations=4)
        events = [ev async for ev in handler.stream_events()]
        return await handler, events

    return asyncio.run(go())


def _check_tool_then_answer(result, events, demo):
    inputs = [e for e in events if isinstance(e, AgentInput)]
    steps = [e for e in events if isinstance(e, AgentOutput)]
    calls = [e for e in events if isinstance(e, ToolCallResult)]
    # Step 1: the model called the tool (its choice, arguments decoded under the tool's schema) and
    # the real function ran on them.
    assert len(steps) == 2 and len(calls) == 1, [s.response.content for s in steps]
    assert (calls[0].tool_name, calls[0].tool_kwargs) == ("multiply", {"a": 12, "b": 7})
    assert calls[0].tool_output.raw_output == 84 and not calls[0].tool_output.is_error
    assert [t.tool_id for t in steps[0].tool_calls] == [calls[0].tool_id]
    assert steps[0].raw["finish_reason"] == "tool_calls"
    # The result went back as a tool message answering that call, after the assistant's call replayed.
    second = inputs[1].input
    assert [(m.content, m.additional_kwargs["tool_call_id"]) for m in second if m.role == MessageRole.TOOL] == [
        ("84", calls[0].tool_id)]
    assert to_kv_messages(second)[-2:] == [
        {"role": "assistant", "content": '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 7}}</tool_call>'},
        {"role": "tool", "content": "84"}]
    # Step 2: the model answered in text (no tool call), with the verified demonstration routed to.
    # (The final output lists the run's tool results as its tool_calls; the model's own are in raw.)
    assert steps[1].raw["tool_calls"] == [] and steps[1].raw["finish_reason"] == "stop"
    assert [c.tool_id for c in steps[1].tool_calls] == [calls[0].tool_id]
    assert [e["id"] for e in steps[1].raw["entries"]] == [demo.id]
    assert steps[1].raw["tokens_decoded"] > 0
    assert result.response.content == steps[1].response.content
    assert "84" in result.response.content
    return steps


def test_function_agent_calls_the_tool_and_answers(fc, capsys):
    llm, demo = fc
    assert isinstance(llm, FunctionCallingLLM) and llm.metadata.is_function_calling_model
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(multiply)], llm=llm)  # streams (the default)
    result, events = _run(agent, QUESTION)
    with capsys.disabled():
        print("\nFunctionAgent:", [(e.tool_name, e.tool_kwargs, e.tool_output.raw_output) for e in events
                                   if isinstance(e, ToolCallResult)], "final:", result.response.content)
    _check_tool_then_answer(result, events, demo)


def test_agent_workflow_runs_a_function_agent(fc):
    llm, demo = fc
    # LlamaIndex picks FunctionAgent (not ReActAgent) because the LLM says it calls functions.
    workflow = AgentWorkflow.from_tools_or_functions([multiply], llm=llm)
    assert all(isinstance(a, FunctionAgent) for a in workflow.agents.values())
    for agent in workflow.agents.values():
        agent.streaming = False  # the non-streamed path (achat_with_tools); the test above streams
    result, events = _run(workflow, QUESTION)
    _check_tool_then_answer(result, events, demo)


def test_chat_with_tools_required_named_none_async_and_streamed(fc):
    llm, _ = fc
    tools = [FunctionTool.from_defaults(multiply), FunctionTool.from_defaults(add)]
    q = "What is 6 times 7?"

    forced = llm.chat_with_tools(tools, user_msg=q, tool_required=True, route=False)
    [sel] = llm.get_tool_calls_from_response(forced)
    assert sel.tool_name in ("multiply", "add") and sorted(sel.tool_kwargs) == ["a", "b"]
    assert all(isinstance(v, int) for v in sel.tool_kwargs.values())
    kw = forced.additional_kwargs
    assert kw["finish_reason"] == "tool_calls" and kw["tokens_forced"] > 0 and kw["entries"] == []
    # The prompt the call read is exactly what the tokenizer hook counts for it (nothing routed).
    assert kw["prompt_tokens"] == llm.count_message_tokens([ChatMessage(role=MessageRole.USER, content=q)], tools)
    # The OpenAI spelling is there too (LlamaIndex's streamed structured output reads it).
    assert [c["function"]["name"] for c in forced.message.additional_kwargs["tool_calls"]] == [sel.tool_name]

    # Greedy decoding: async and streamed give the same call (its id is new each time).
    [a] = llm.get_tool_calls_from_response(asyncio.run(llm.achat_with_tools(tools, user_msg=q, tool_required=True,
                                                                            route=False)))
    chunks = list(llm.stream_chat_with_tools(tools, user_msg=q, tool_required=True, route=False))
    [s] = llm.get_tool_calls_from_response(chunks[-1])
    assert (a.tool_name, a.tool_kwargs) == (s.tool_name, s.tool_kwargs) == (sel.tool_name, sel.tool_kwargs)

    named = llm.chat_with_tools(tools, user_msg=q, tool_choice="add", route=False)
    assert [c.tool_name for c in llm.get_tool_calls_from_response(named)] == ["add"]

    none = llm.chat_with_tools(tools, user_msg=q, tool_choice="none", route=False, max_new_tokens=8)
    assert llm.get_tool_calls_from_response(none, error_on_no_tool_call=False) == []
    assert none.message.content and none.additional_kwargs["tokens_forced"] == 0
    with pytest.raises(ValueError, match="expected a tool call"):
        llm.get_tool_calls_from_response(none)

    # predict_and_call runs the tool the model called.
    out = llm.predict_and_call(tools, user_msg=q, tool_choice="multiply", route=False)
    assert out.response == str(multiply(**out.sources[0].raw_input["kwargs"]))

    with pytest.raises(ToolChoiceError):
        llm.chat_with_tools(tools, user_msg=q, tool_choice="divide")
    with pytest.raises(ToolChoiceError):
        llm.chat([ChatMessage(role=MessageRole.USER, content=q)], tool_choice="required")  # no tools bound


def test_structured_predict_decodes_under_the_schema(fc, capsys):
    llm, _ = fc
    prompt = PromptTemplate("Give facts about {city}.")
    out = llm.structured_predict(City, prompt, city="Paris", llm_kwargs={"route": False})
    with capsys.disabled():
        print("\nstructured_predict:", repr(out))
    assert isinstance(out, City) and out.name.strip() and out.country.strip()
    # The keys, quotes and braces were written for the model; the values it decoded.
    stats = llm.last_outcome.stats
    assert stats.tokens_forced > 0 and stats.tokens_decoded > 0
    assert "properties" not in out.name and "properties" not in out.country  # no echoed schema

    assert asyncio.run(llm.astructured_predict(City, prompt, city="Paris", llm_kwargs={"route": False})) == out
    parts = list(llm.stream_structured_predict(City, prompt, city="Paris", llm_kwargs={"route": False}))
    assert parts and parts[-1].model_dump() == out.model_dump()

    structured = llm.as_structured_llm(City)
    resp = structured.chat([ChatMessage(role=MessageRole.USER, content="Give facts about Paris.")], route=False)
    assert resp.raw == out and City.model_validate_json(resp.message.content) == out


def test_bad_inputs_are_refused_typed_before_the_model(fc):
    from llama_index.core.base.llms.types import ImageBlock
    from kvmemory import UnsupportedContent

    mem = fc[0].memory
    llm = KVGraftLLM(memory=mem, max_new_tokens=4)
    user = [ChatMessage(role=MessageRole.USER, content="hi")]
    for bad in (None, b"hi", 5, ["hi"]):
        with pytest.raises(InvalidInput):
            llm.complete(bad)
        with pytest.raises(InvalidInput):
            llm.stream_complete(bad)
    for kwargs in ({"max_tokens": 0}, {"max_tokens": -5}, {"max_new_tokens": 0}, {"max_tokens": "8"},
                   {"max_tokens": True}, {"temperature": -1}, {"temperature": "hot"}, {"top_p": 0},
                   {"top_k": -1}, {"seed": "x"}, {"stop": 5}, {"similarity_top_k": 0}, {"route": "yes"},
                   {"namespace": 3}, {"threshold": "high"}, {"tools": [object()]}):
        with pytest.raises(InvalidInput):
            llm.complete("hi", **kwargs)
        with pytest.raises(InvalidInput):
            llm.chat(user, **kwargs)
    for bad in ("hello", ["hello"], ChatMessage(role=MessageRole.USER, content="hi"), None):
        with pytest.raises(InvalidInput):
            llm.chat(bad)
        with pytest.raises(InvalidInput):
            llm.stream_chat(bad)  # at the call, not in the stream's worker thread
    with pytest.raises(UnsupportedContent):
        llm.chat([ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="http://example.invalid/a.png")])])
    # Nothing reached the model.
    assert llm.last_answer is None and llm.last_outcome is None
    # The same checks at construction, as kvmemory's typed error (not pydantic's).
    for kwargs in ({"max_new_tokens": 0}, {"max_new_tokens": -3}, {"max_new_tokens": "many"},
                   {"temperature": -1.0}, {"top_p": 1.5}, {"top_k": -2}, {"similarity_top_k": 0}):
        with pytest.raises(InvalidInput):
            KVGraftLLM(memory=mem, **kwargs)
