"""`python -m kvmemory.bench.agents`: do real agents on the embedded model finish?

Each question of `agent_questions` (the 12 held-out tool questions and the 6 held-out questions no tool
fits, by default; `--set calibration` for the sets margins and floors may be chosen on) is given to a
real agent with its two tools (`agent_tools`) and the chat model over
the embedded SmolLM2-135M-Instruct, with an empty store (no stored demonstration, nothing routed):

- LangChain 1.x: `langchain.agents.create_agent(ChatKVGraft(...), tools)`, `invoke` with a recursion
  limit that allows `max_calls` model calls; model calls counted by a callback on every chat model start;
- LlamaIndex: `FunctionAgent(tools=..., llm=KVGraftLLM(...))`, `run(max_iterations=max_calls)`;
  model calls counted as the agent's `AgentOutput` events (one per LLM call).

Per question: model calls, the tools called (and whether they are the expected ones), whether the
agent finished (a final text answer, no error, no iteration / recursion limit), whether it repeated
an identical call (a loop), and whether the final answer states every tool result (each number of a
result, thousands separators aside; the result's text when it has no number), and whether it states
what the reference calls return (`agent_questions.REFERENCE`: the question answered right; a call
with wrong arguments gets a wrong result the answer may state faithfully). That check is the
benchmark's own, written apart from the adapter's. A question no tool fits is answered right when the
agent calls no tool and its answer says one of the question's words (`agent_questions.NO_TOOL_ANSWERS`);
the summary gives, per framework, the tool calls made on those questions (the target is 0) and the
right answers of each kind. `answer` says whose words the answer is: the
model's, or the model's after an opening holding the results (`adapters/after_tool.py`).

The chat models run with their default settings (max_tokens 256, greedy, tool_policy "scored").
The integrations (langchain-kvmemory, llama-index-llms-kvgraft) must be importable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvmemory.bench.agent_questions import NO_TOOL_ANSWERS, REFERENCE, SETS, ToolQuestion
from kvmemory.bench.agent_tools import TOOLS

FRAMEWORKS = ("langchain", "llamaindex")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


@dataclass(slots=True)
class AgentRun:
    """One question through one agent."""

    framework: str
    question: str
    expected: list[str]
    calls: int = 0  # model calls
    tool_calls: list[list] = field(default_factory=list)  # [name, args] in order
    results: list[str] = field(default_factory=list)  # what the tools returned
    reference: list[str] = field(default_factory=list)  # what the reference calls return (agent_questions.REFERENCE)
    answer: str = ""
    answer_words: str = ""  # "model", "opened with results", or "" (not told / no answer)
    # Per model call after a tool result: the log-odds of another call the adapter measured
    # (`adapters/after_tool.py`), what a margin is calibrated on.
    call_log_odds: list[float] = field(default_factory=list)
    finished: bool = False
    error: str = ""
    seconds: float = 0.0

    @property
    def right_tool(self) -> bool:
        return {c[0] for c in self.tool_calls} == set(self.expected)

    @property
    def repeated_call(self) -> bool:
        keys = [json.dumps(c, sort_keys=True) for c in self.tool_calls]
        return len(keys) != len(set(keys))

    @property
    def states_result(self) -> bool:
        """The final answer states what the tools returned (right or wrong)."""
        return bool(self.results) and all(_stated(r, self.answer) for r in self.results)

    @property
    def needs_tool(self) -> bool:
        return bool(self.expected)

    @property
    def right_answer(self) -> bool:
        """The final answer states what the reference calls return: the question answered right. A
        question no tool fits: answered without a call, saying one of its right words."""
        if not self.needs_tool:
            words = NO_TOOL_ANSWERS.get(self.question, ())
            text = self.answer.lower()
            return self.finished and not self.tool_calls and any(_has_word(w.lower(), text) for w in words)
        return bool(self.reference) and all(_stated(r, self.answer) for r in self.reference)

    def to_json(self) -> dict:
        return {**asdict(self), "needs_tool": self.needs_tool, "right_tool": self.right_tool,
                "repeated_call": self.repeated_call,
                "states_result": self.states_result, "right_answer": self.right_answer}


def _stated(result: str, answer: str) -> bool:
    nums = {m.group(0).replace(",", "") for m in _NUMBER.finditer(result)}
    if nums:
        return nums <= {m.group(0).replace(",", "") for m in _NUMBER.finditer(answer)}
    return " ".join(result.lower().split()).strip(" .") in " ".join(answer.lower().split())


def _has_word(word: str, text: str) -> bool:
    return re.search(r"(?<![a-z0-9])" + re.escape(word) + r"(?![a-z0-9])", text) is not None


def _reference(q: ToolQuestion) -> list[str]:
    return [TOOLS[name](**args) for name, args in REFERENCE.get(q.question, ())]


# ---------------------------------------------------------------------- LangChain
def run_langchain(q: ToolQuestion, llm, max_calls: int) -> AgentRun:
    """`create_agent` with the question's two tools; stops at `max_calls` model calls (a loop)."""
    from langchain.agents import create_agent
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.errors import GraphRecursionError

    class Count(BaseCallbackHandler):
        calls = 0

        def on_chat_model_start(self, *args, **kwargs) -> None:
            self.calls += 1

    run = AgentRun("langchain", q.question, list(q.expected), reference=_reference(q))
    counter = Count()
    agent = create_agent(llm, [tool(TOOLS[n]) for n in q.tools])
    t0 = time.perf_counter()
    messages = []
    try:
        # Each model call and each tool step is a graph step. Streamed state by state, so that a run
        # stopped by the recursion limit still shows the calls it made.
        for state in agent.stream({"messages": [("user", q.question)]},
                                  {"recursion_limit": 2 * max_calls, "callbacks": [counter]}, stream_mode="values"):
            messages = state["messages"]
        last = messages[-1]
        run.finished = isinstance(last, AIMessage) and not last.tool_calls and bool(str(last.content).strip())
        run.answer = str(last.content) if isinstance(last, AIMessage) else ""
        run.answer_words = _words(last.response_metadata.get("kvmemory", {}) if isinstance(last, AIMessage) else {})
    except GraphRecursionError as exc:
        run.error = f"GraphRecursionError: {str(exc).splitlines()[0]}"
    run.seconds = round(time.perf_counter() - t0, 2)
    run.calls = counter.calls
    for m in messages:
        if isinstance(m, AIMessage):
            run.tool_calls += [[c["name"], c["args"]] for c in m.tool_calls]
            run.call_log_odds += _log_odds(m.response_metadata.get("kvmemory", {}))
        elif isinstance(m, ToolMessage):
            run.results.append(str(m.content))
    return run


def _log_odds(provenance: dict) -> list[float]:
    after = provenance.get("after_tool") or {}
    return [after["call_log_odds"]] if "call_log_odds" in after else []


def _words(provenance: dict) -> str:
    after = provenance.get("after_tool") or {}
    if not after:
        return ""
    return "opened with results" if after.get("opened_with_results") else "model"


# ---------------------------------------------------------------------- LlamaIndex
def run_llamaindex(q: ToolQuestion, llm, max_calls: int) -> AgentRun:
    """`FunctionAgent` with the question's two tools; stops at `max_calls` iterations (a loop)."""
    from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
    from llama_index.core.tools import FunctionTool

    run = AgentRun("llamaindex", q.question, list(q.expected), reference=_reference(q))
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(TOOLS[n]) for n in q.tools], llm=llm)

    async def go():
        handler = agent.run(user_msg=q.question, max_iterations=max_calls)
        outputs, results = [], []
        try:
            async for ev in handler.stream_events():
                if isinstance(ev, AgentOutput):
                    outputs.append(ev)
                elif isinstance(ev, ToolCallResult):
                    results.append(ev)
            final = await handler
        except Exception as exc:  # the workflow's own error (e.g. max iterations), reported as such
            return outputs, results, None, exc
        return outputs, results, final, None

    t0 = time.perf_counter()
    outputs, results, final, exc = asyncio.run(go())
    run.seconds = round(time.perf_counter() - t0, 2)
    run.calls = len(outputs)
    run.tool_calls = [[r.tool_name, r.tool_kwargs] for r in results]
    run.call_log_odds = [x for o in outputs for x in _log_odds(o.raw if isinstance(o.raw, dict) else {})]
    run.results = [str(r.tool_output.content) for r in results]
    if exc is not None:
        run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return run
    content = final.response.content or ""
    run.answer = content
    # The final AgentOutput lists the run's tool results as its tool_calls; the model's own calls of
    # its last step are in its raw response (KVGraftLLM's report).
    last_raw = outputs[-1].raw if outputs and isinstance(outputs[-1].raw, dict) else {}
    run.finished = bool(content.strip()) and not last_raw.get("tool_calls")
    run.answer_words = _words(final.raw if isinstance(final.raw, dict) else {})
    return run


# ---------------------------------------------------------------------- the bench
def run_bench(questions: Sequence[ToolQuestion], frameworks: Sequence[str] = FRAMEWORKS, *, max_calls: int = 6,
              store: str | None = None, progress: bool = True, model: str | None = None) -> list[AgentRun]:
    """Every question through every framework's agent, on one shared model (`model`: the default's, or
    any `--model` value, a GGUF file included) and an empty store."""
    from kvmemory.memory.facade import KVMemory

    store = store or tempfile.mkdtemp(prefix="kvmemory-bench-agents-")
    mem = KVMemory(store=store, **({"model": model} if model else {}))
    runs = []
    llms = {}
    if "langchain" in frameworks:
        from langchain_kvmemory import ChatKVGraft

        llms["langchain"] = ChatKVGraft(memory=mem)
    if "llamaindex" in frameworks:
        from llama_index.llms.kvgraft import KVGraftLLM

        llms["llamaindex"] = KVGraftLLM(mem)
    runner = {"langchain": run_langchain, "llamaindex": run_llamaindex}
    for fw in frameworks:
        for i, q in enumerate(questions, 1):
            r = runner[fw](q, llms[fw], max_calls)
            runs.append(r)
            if progress:
                print(f"[{fw} {i}/{len(questions)}] {r.calls} calls, finished={r.finished}, "
                      f"{r.seconds:.1f}s: {q.question}", file=sys.stderr, flush=True)
    return runs


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def format_table(runs: Sequence[AgentRun]) -> str:
    """Markdown: one row per question, the frameworks side by side, then the totals."""
    frameworks = list(dict.fromkeys(r.framework for r in runs))
    by = {(r.framework, r.question): r for r in runs}
    questions = list(dict.fromkeys(r.question for r in runs))
    head = "| question | " + " | ".join(f"{fw}: calls / right tool / finished / states result / right answer"
                                       for fw in frameworks) + " |"
    lines = [head, "|" + "---|" * (1 + len(frameworks))]
    for q in questions:
        cells = []
        for fw in frameworks:
            r = by[(fw, q)]
            loop = " (repeat)" if r.repeated_call else ""
            states = _mark(r.states_result) if r.needs_tool else ("-" if not r.tool_calls else _mark(False))
            cells.append(f"{r.calls}{loop} / {_mark(r.right_tool)} / {_mark(r.finished)} / {states}"
                         f" / {_mark(r.right_answer)}")
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    totals = []
    for fw in frameworks:
        rs = [r for r in runs if r.framework == fw]
        n = len(rs)
        totals.append(f"max {max(r.calls for r in rs)}, mean {sum(r.calls for r in rs) / n:.2f} / "
                      f"{sum(r.right_tool for r in rs)} of {n} / {sum(r.finished for r in rs)} of {n} / "
                      f"{sum(r.states_result for r in rs)} of {n} / {sum(r.right_answer for r in rs)} of {n}")
    lines.append("| **all** | " + " | ".join(totals) + " |")
    lines += ["", summary(runs)]
    return "\n".join(lines)


def summary(runs: Sequence[AgentRun]) -> str:
    """Per framework: tool calls on the questions no tool fits (the target is 0), and right answers on
    each kind of question."""
    out = ["| framework | tool calls on no-tool questions | no-tool questions answered right | "
           "tool questions answered right | finished |", "|---|---|---|---|---|"]
    for fw in dict.fromkeys(r.framework for r in runs):
        rs = [r for r in runs if r.framework == fw]
        free = [r for r in rs if not r.needs_tool]
        tooled = [r for r in rs if r.needs_tool]
        out.append(f"| {fw} | {sum(len(r.tool_calls) for r in free)} (on {sum(bool(r.tool_calls) for r in free)} "
                   f"of {len(free)} questions) | {sum(r.right_answer for r in free)} of {len(free)} | "
                   f"{sum(r.right_answer for r in tooled)} of {len(tooled)} | {sum(r.finished for r in rs)} of {len(rs)} |")
    return "\n".join(out)


def _summary_json(runs: Sequence[AgentRun]) -> dict:
    out = {}
    for fw in dict.fromkeys(r.framework for r in runs):
        rs = [r for r in runs if r.framework == fw]
        free = [r for r in rs if not r.needs_tool]
        tooled = [r for r in rs if r.needs_tool]
        out[fw] = {"no_tool_questions": len(free), "tool_calls_on_no_tool_questions": sum(len(r.tool_calls) for r in free),
                   "no_tool_right": sum(r.right_answer for r in free), "tool_questions": len(tooled),
                   "tool_right": sum(r.right_answer for r in tooled), "finished": sum(r.finished for r in rs)}
    return out


def _code_version() -> str:
    """The commit of the checkout the bench runs from ("" outside a git checkout), with "+dirty" when
    it has uncommitted changes, so a JSON says which code it measured."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmemory.bench.agents", description=__doc__.split("\n")[0])
    p.add_argument("--set", choices=sorted(SETS), default="held-out", help="which questions (default held-out)")
    p.add_argument("--framework", choices=[*FRAMEWORKS, "both"], default="both")
    p.add_argument("--max-calls", type=int, default=6,
                   help="model calls an agent may make before it counts as looping (default 6)")
    p.add_argument("--only", type=int, nargs="*", help="1-based indices of the questions to run")
    p.add_argument("--json", action="store_true", help="print every run as JSON instead of the table")
    p.add_argument("--model", default=None, help="the model (default: the embedded default); e.g. "
                   "embedded:qwen2.5-coder-1.5b-instruct or a GGUF file")
    args = p.parse_args(argv)
    qs = list(SETS[args.set])
    if args.only:
        qs = [qs[i - 1] for i in args.only]
    frameworks = FRAMEWORKS if args.framework == "both" else (args.framework,)
    runs = run_bench(qs, frameworks, max_calls=args.max_calls, model=args.model)
    if args.json:
        print(json.dumps({"set": args.set, "max_calls": args.max_calls, "code": _code_version(),
                          "model": args.model or "embedded", "summary": _summary_json(runs),
                          "runs": [r.to_json() for r in runs]}, indent=1, ensure_ascii=False))
    else:
        print(format_table(runs))
    ok = all(r.finished and r.calls <= 3 and not r.repeated_call and (r.needs_tool or not r.tool_calls) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
