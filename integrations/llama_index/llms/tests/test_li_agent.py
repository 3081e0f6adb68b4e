"""A real `ReActAgent` (llama_index.core.agent.workflow) with real FunctionTools, driven by KVGraftLLM
on the embedded SmolLM2, offline.

The 135M model does not know the ReAct format by itself; kvmemory supplies it the way it supplies any
worked solution: a verified ReAct trace for a similar question is routed to, grafted before the
conversation, and the model continues from there. Nothing the model says is scripted: the test
checks that the framework parsed the model's own output into tool calls that really ran, and that
the run ended on an answer the framework parsed. (A parse failure would have been retried by the
framework, and `early_stopping_method="generate"` asks for a final answer when iterations run out;
the test requires neither to have been needed.)
"""

from __future__ import annotations

import asyncio

from kvmemory.memory import KVMemory
from llama_index.core.agent.react.formatter import ReActChatFormatter
from llama_index.core.agent.workflow import AgentOutput, ReActAgent, ToolCallResult
from llama_index.core.llms import MessageRole
from llama_index.core.tools import FunctionTool
from llama_index.llms.kvgraft import KVGraftLLM

DEMO_PROBLEM = "What is 12 times 9?"
DEMO_SOLUTION = (
    "Thought: I need to use a tool to help me answer the question.\n"
    "Action: multiply\n"
    'Action Input: {"a": 12, "b": 9}\n'
    "Observation: 108\n"
    "Thought: I can answer without using any more tools.\n"
    "Answer: 12 * 9 = 108. The answer is 108."
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


def test_react_agent_calls_real_tools_and_answers(li_memory, capsys):
    ns = "li-agent"
    # Same model and router, but every newly computed block is kept: each ReAct step re-reads the same
    # long tool header, so from the second step on it is grafted instead of recomputed.
    mem = KVMemory(engine=li_memory.engine, router=li_memory.router, namespace=ns, block_policy="always")
    demo = mem.remember(DEMO_PROBLEM, DEMO_SOLUTION, "108", verifier="arithmetic")
    assert demo.verified

    def recall_solution(question: str) -> str:
        """Look up a verified worked solution to a similar problem."""
        hits = mem.recall(question, k=1)
        return hits[0].entry.solution if hits else "no verified solution found"

    tools = {"recall_solution": recall_solution, "multiply": multiply}
    llm = KVGraftLLM(memory=mem, max_new_tokens=48, stop=["Observation:"])
    # Observations as tool turns: the LLM keeps routing on the question (not on "Observation: 84").
    formatter = ReActChatFormatter.from_defaults(observation_role=MessageRole.TOOL)
    agent = ReActAgent(tools=[FunctionTool.from_defaults(fn) for fn in tools.values()], llm=llm,
                       formatter=formatter)
    max_iterations = 4

    async def run():
        handler = agent.run(user_msg="What is 12 times 7?", max_iterations=max_iterations,
                            early_stopping_method="generate")
        events = [ev async for ev in handler.stream_events()]
        return await handler, events

    result, events = asyncio.run(run())
    steps = [ev for ev in events if isinstance(ev, AgentOutput)]
    calls = [ev for ev in events if isinstance(ev, ToolCallResult)]
    with capsys.disabled():
        print("\nReActAgent steps:", [s.response.content for s in steps], "final:", result.response.content)

    assert isinstance(result, AgentOutput)
    assert (result.response.content or "").strip()
    # Every step's raw is this LLM's report: the model answered each step, none was faked.
    assert len(steps) >= 2 and all(isinstance(s.raw, dict) and s.raw["tokens_decoded"] > 0 for s in steps)
    # Every step was routed to the verified demonstration, and after the first the long tool header
    # and the demonstration were grafted from the blocks the first step stored.
    assert all(s.raw["entries"] == [demo.id] for s in steps)
    assert all(s.raw["tokens_grafted"] >= 512 for s in steps[1:])

    # Tool-call path: the model's own text was parsed into calls that ran the real functions.
    assert calls, [s.response.content for s in steps]
    for c in calls:
        assert c.tool_name in tools and not c.tool_output.is_error
        assert c.tool_output.raw_output == tools[c.tool_name](**c.tool_kwargs)
    assert "multiply" in [c.tool_name for c in calls]
    # Answer path: the run ended on an answer the framework parsed (no tool call, no retry), before
    # the iterations ran out and early stopping had to ask for one.
    # Every step but the last called one tool; the last was neither retried nor a tool call.
    assert len(steps) < max_iterations
    assert not steps[-1].retry_messages and len(calls) == len(steps) - 1
    assert [c.tool_id for c in result.tool_calls] == [c.tool_id for c in calls]
