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
import importlib.util
from pathlib import Path

from kvmemory import KVMemory
from llama_index.core.agent.workflow import AgentOutput, ToolCallResult

# The agent is set up by the example itself (examples/llamaindex_agent.py), so what is tested is what
# a user runs.
_EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "llamaindex_agent.py"
_spec = importlib.util.spec_from_file_location("llamaindex_agent_example", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_react_agent_calls_real_tools_and_answers(li_memory, capsys):
    ns = "li-agent"
    # Same model and router, but every newly computed block is kept: each ReAct step re-reads the same
    # long tool header, so from the second step on it is grafted instead of recomputed.
    mem = KVMemory(engine=li_memory.engine, router=li_memory.router, namespace=ns, block_policy="always")
    agent, demo, tools = example.build_agent(mem, max_new_tokens=48)
    assert demo.verified
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
