"""`python -m kvmemory.bench.agents` (issue 41, "agents loop"): its tools, its questions, and one held-out
question through both real agents (LangChain's `create_agent`, LlamaIndex's `FunctionAgent`) on the
embedded model with an empty store. The full 12 are the benchmark's (BENCHMARKS.md, "Agents")."""

from __future__ import annotations

import pytest

from kvmemory.bench import agent_tools
from kvmemory.bench.agent_questions import CALIBRATION, HELD_OUT


def test_the_question_sets_are_apart_and_use_known_tools():
    assert len(HELD_OUT) == 12
    assert not {q.question for q in HELD_OUT} & {q.question for q in CALIBRATION}
    for q in HELD_OUT + CALIBRATION:
        assert len(q.tools) == 2 and set(q.expected) <= set(q.tools) <= set(agent_tools.TOOLS)


def test_the_tools_are_deterministic_and_answer_any_argument():
    assert agent_tools.calculator("23 times 19") == "437"
    assert agent_tools.calculator("15% of 240") == "36"
    assert agent_tools.calculator("import os").startswith("Error")
    assert agent_tools.convert_units(26, "miles", "km") == "41.84 km"
    assert agent_tools.get_weather("Atlantis") == agent_tools.get_weather("atlantis")  # derived, stable
    assert agent_tools.get_population("Canada") == "40,100,000"


@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
def test_a_held_out_question_finishes_in_at_most_three_calls(framework):
    pytest.importorskip("langchain_kvmemory" if framework == "langchain" else "llama_index.llms.kvgraft")
    from kvmemory.bench.agents import format_table, run_bench

    [run] = run_bench([HELD_OUT[0]], [framework], max_calls=3, progress=False)
    assert run.finished and run.calls <= 3 and not run.repeated_call, run.to_json()
    assert run.right_tool and run.states_result, run.to_json()
    assert HELD_OUT[0].question in format_table([run])
