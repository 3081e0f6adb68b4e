"""A LlamaIndex ReActAgent with real tools on the embedded SmolLM2 through kvmemory, offline.

    python examples/llamaindex_agent.py
    python examples/llamaindex_agent.py --question "What is 15 times 4?"

SmolLM2-135M does not know the ReAct format on its own. kvmemory gives it what it gives any agent:
a verified worked solution for a similar question (here a ReAct trace that used the `multiply`
tool, checked by the arithmetic verifier), routed to and grafted before the conversation. The
model's own output is then parsed by LlamaIndex into tool calls that run real Python functions.
Each step prints where its tokens came from: from the second step on the long tool header that the
first step computed is grafted, not recomputed. A tiny model may pick the wrong tool or loop; the
framework retries unparsable output, and `early_stopping_method="generate"` asks for a final answer
when the iterations run out, so the run always ends with an answer. Every step is decoded freely
(greedily: the ReAct format is free text); the final answer is checked against the expected one
(12 * 7 for the default question, or `--expected`), printed with ✓/✗, and a wrong one exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

DEMO_PROBLEM = "What is 12 times 9?"
DEFAULT_QUESTION = "What is 12 times 7?"
DEFAULT_EXPECTED = 12 * 7
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


def recall_solution_tool(mem):
    """A tool over the same memory: the verified solution of the most similar stored problem."""

    def recall_solution(question: str) -> str:
        """Look up a verified worked solution to a similar problem."""
        hits = mem.recall(question, k=1)
        return hits[0].entry.solution if hits else "no verified solution found"

    return recall_solution


def build_agent(mem, max_new_tokens: int = 48):
    """Remember the verified ReAct demonstration in `mem` and build the agent over it; returns
    (agent, the demonstration's entry, the tools by name). The test of this example uses it too."""
    from llama_index.core.agent.react.formatter import ReActChatFormatter
    from llama_index.core.agent.workflow import ReActAgent
    from llama_index.core.llms import MessageRole
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.kvgraft import KVGraftLLM

    demo = mem.remember(DEMO_PROBLEM, DEMO_SOLUTION, "108", verifier="arithmetic")
    tools = {"recall_solution": recall_solution_tool(mem), "multiply": multiply}
    # "Observation:" is the framework's to write: stop there instead of letting the model invent one.
    llm = KVGraftLLM(memory=mem, max_new_tokens=max_new_tokens, stop=["Observation:"])
    # Observations as tool turns, not user turns: the LLM keeps routing on the question, so the
    # verified demonstration (and its grafted KV) stays in front of every step.
    formatter = ReActChatFormatter.from_defaults(observation_role=MessageRole.TOOL)
    agent = ReActAgent(tools=[FunctionTool.from_defaults(fn) for fn in tools.values()], llm=llm, formatter=formatter)
    return agent, demo, tools


async def run_agent(agent, question: str, max_iterations: int) -> object:
    from llama_index.core.agent.workflow import AgentOutput, ToolCallResult

    handler = agent.run(user_msg=question, max_iterations=max_iterations, early_stopping_method="generate")
    step = 0
    t0 = time.perf_counter()
    async for ev in handler.stream_events():
        if isinstance(ev, AgentOutput):
            step += 1
            raw = ev.raw if isinstance(ev.raw, dict) else {}
            print(f"\n[step {step}, {time.perf_counter() - t0:.1f} s] model said:")
            print("  " + (ev.response.content or "").replace("\n", "\n  "))
            print(f"  tokens grafted {raw.get('tokens_grafted')}, computed {raw.get('tokens_computed')}, "
                  f"decoded {raw.get('tokens_decoded')}; routed to {raw.get('entries') or 'nothing'}")
            if ev.retry_messages:
                print("  (LlamaIndex could not parse this; it asks the model again)")
        elif isinstance(ev, ToolCallResult):
            print(f"  -> tool {ev.tool_name}({ev.tool_kwargs}) returned {ev.tool_output.raw_output}")
    return await handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question", default=DEFAULT_QUESTION)
    ap.add_argument("--expected", type=int, default=None,
                    help="the right answer, to check the final one against (known for the default question)")
    ap.add_argument("--store", help="store folder (default: a temporary one, removed at exit)")
    ap.add_argument("--max-iterations", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    from kvmemory import KVMemory, extract_answer
    from llama_index.core import Settings

    tmp = None if args.store else tempfile.TemporaryDirectory(prefix="kvmemory-li-agent-")
    store = args.store or os.path.join(tmp.name, "store")
    # block_policy="always": every step's newly computed blocks are kept, so the ReAct header (the same
    # ~650 tokens at every step) is computed once and grafted afterwards.
    mem = KVMemory(store=store, namespace="llamaindex-agent", block_policy="always")
    agent, demo, _ = build_agent(mem, args.max_new_tokens)
    print(f"remembered a verified ReAct demonstration {demo.id} ({demo.verifier['detail']})")
    Settings.llm = agent.llm  # explicit: nothing can fall back to a hosted default

    print(f"\nquestion: {args.question}")
    result = asyncio.run(run_agent(agent, args.question, args.max_iterations))
    final = (result.response.content or "").strip()
    print(f"\nfinal answer: {final!r}")
    print(f"tools called: {[(c.tool_name, c.tool_kwargs, c.tool_output.raw_output) for c in result.tool_calls]}")
    expected = args.expected if args.expected is not None else (
        DEFAULT_EXPECTED if args.question == DEFAULT_QUESTION else None)
    ok = True
    if expected is None:
        print("(no --expected answer given: the final answer is not checked)")
    else:
        ok = extract_answer(final) == expected
        print(f"expected {expected}: {'✓' if ok else '✗'}")

    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
