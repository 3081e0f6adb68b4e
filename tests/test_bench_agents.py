"""`python -m kvmemory.bench.agents` (issue 41, "agents loop"): its tools, its questions, and one held-out
question through both real agents (LangChain's `create_agent`, LlamaIndex's `FunctionAgent`) on the
embedded model with an empty store. The full 12 are the benchmark's (BENCHMARKS.md, "Agents")."""

from __future__ import annotations

import pytest

from kvmemory.bench import agent_tools
from kvmemory.bench.agent_questions import CALIBRATION, HELD_OUT, NO_TOOL, NO_TOOL_ANSWERS, NO_TOOL_CALIBRATION, SETS


def test_the_question_sets_are_apart_and_use_known_tools():
    assert len(HELD_OUT) == 12 and len(NO_TOOL) == 6
    assert not {q.question for q in HELD_OUT + NO_TOOL} & {q.question for q in CALIBRATION + NO_TOOL_CALIBRATION}
    for q in HELD_OUT + CALIBRATION + NO_TOOL + NO_TOOL_CALIBRATION:
        assert len(q.tools) == 2 and set(q.expected) <= set(q.tools) <= set(agent_tools.TOOLS)
    for q in NO_TOOL + NO_TOOL_CALIBRATION:  # no tool fits: nothing expected, a right answer's words known
        assert q.expected == () and NO_TOOL_ANSWERS[q.question]
    assert SETS["held-out"] == HELD_OUT + NO_TOOL and SETS["calibration"] == CALIBRATION + NO_TOOL_CALIBRATION


def test_a_no_tool_run_is_right_only_without_a_call():
    from kvmemory.bench.agents import AgentRun, summary

    q = NO_TOOL[0]
    right = AgentRun("langchain", q.question, [], answer="The capital of France is Paris.", finished=True)
    called = AgentRun("langchain", q.question, [], answer="Paris.", finished=True,
                      tool_calls=[["calculator", {"expression": "10 + 20"}]])
    wrong = AgentRun("llamaindex", q.question, [], answer="It is Lyon, not Parisian.", finished=True)
    assert right.right_answer and right.right_tool and not right.needs_tool
    assert not called.right_answer and not called.right_tool
    assert not wrong.right_answer  # a word, not a part of one
    table = summary([right, called, wrong])
    assert "| langchain | 1 (on 1 of 2 questions) | 1 of 2 |" in table and "| llamaindex | 0 (on 0 of 1 questions)" in table


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
