"""What an unforced chat call does after a tool result: answer, unless another call is clearly likelier.

An agent (LangChain's `create_agent`, LlamaIndex's `FunctionAgent`, an OpenAI-client loop) calls the
model again after every tool result and stops when the model answers in text. A small model that
reads its own call and the result in the conversation tends to write the same call again (the
likeliest single first token is the call's "<"), so an agent on it never stops. The policy, the same
for every `tool_policy` whenever the conversation's last turn is a tool result:

1. **Call or answer, by the model's likelihoods.** One forward gives the model's probability p of
   opening its turn with a call (`<tool_call>`); everything else it could write is an answer (1 - p).
   Another call is made only when it is clearly likelier than answering: log(p / (1 - p)) above
   `CALL_MARGIN`, i.e. p at least twice 1 - p. Greedy decoding compares single tokens, so "<" can win
   with p near 0.1 while the answer's mass is spread over many first tokens; the turn as a whole is
   what is compared here.
2. **Never the same call twice.** A call the model then writes (tool by likelihood, arguments under
   the tool's schema, as on a user turn) that repeats one already answered since the last user
   message (same tool, same arguments) is not made: the model answers instead. Earlier user turns
   are not counted: asking again later ("and now?") may deserve a fresh result.
3. **The answer is the model's, and states the result.** The answer is decoded after the result with
   a call refused as its first token (stopping at a call opening, as streamed text does), and ends at
   its first paragraph break: the final answer of a tool question is one paragraph, not the model
   going on to invent the user's next question. When that paragraph does not state the short results
   since the last user message (each result of at most `SHORT_RESULT` characters: every number in it,
   or its text when it has none), the answer is decoded once more opening with those results as the
   tools gave them (counted as forced tokens), and the model finishes the paragraph. A user then gets
   the result, in the tool's words and the model's, instead of a paraphrase that lost it; a long
   result (a document) is left to the model's own answer. `ChatOutcome.notes["after_tool"]` says
   which happened, with the measured log-odds.

The passes of an answer are not streamed token by token: the first one may be replaced, so a stream
gets the answer in its last chunk (cancellation is still checked at every token).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvmemory.adapters.guided import Decoder, call_tool
from kvmemory.adapters.messages import TOOL_CALL_OPEN, parse_tool_calls, tool_names
from kvmemory.engine.runner import _choose as choose_token  # the runner's own pick, so a sampled first token follows its rules

# Another call only when the model puts at least twice the probability on opening a call as on
# answering (log-odds ln 2): "clearly likelier" by definition, not a tuned figure. A margin under 0
# would let a call through that is less likely than an answer, which is the loop this policy ends.
# Checked on the calibration questions of `bench/agent_questions.py` (never the held-out ones) with
# the embedded SmolLM2-135M-Instruct, `create_agent` and `FunctionAgent`: after the first result the
# log-odds were -1.8 to -5.4 (p 0.15 to 0.005) over 24 runs, the questions that needed a second tool
# (-3.1 to -4.8) among them, so no margin at or above 0 separates those: this model answers after
# one result.
CALL_MARGIN = math.log(2.0)
# Results this short are values (a temperature, a sum, a name) an answer must state; longer ones are
# documents the model summarises in its own words.
SHORT_RESULT = 200
PARAGRAPH = "\n\n"
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_BANNED: dict[str, list[int]] = {}  # profile id (it covers the tokenizer) -> token ids that would open a call


@dataclass(slots=True)
class AfterTool:
    """What the call after a tool result produced: a tool call, or an answer's text."""

    call: dict | None = None
    text: str = ""
    finish_reason: str = "stop"
    notes: dict = field(default_factory=dict)


def after_tool_result(turns: Sequence[dict[str, str]]) -> bool:
    """Whether the conversation's last turn is a tool's result (the agent asks: answer or call again?)."""
    return bool(turns) and turns[-1]["role"] == "tool"


def _since_user(turns: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    last = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
    return list(turns[last + 1:])


def call_key(name: str, args: object) -> str:
    """One spelling per call (tool and arguments), whatever the order of the arguments' keys."""
    return json.dumps([name, args], sort_keys=True, ensure_ascii=False)


def answered_calls(turns: Sequence[dict[str, str]], names: Sequence[str]) -> set[str]:
    """The calls made since the last user turn (replayed in the assistant turns), as `call_key`s."""
    out = set()
    for t in _since_user(turns):
        if t["role"] == "assistant":
            out.update(call_key(c["name"], c["args"]) for c in parse_tool_calls(t["content"], names)[1])
    return out


def tool_results(turns: Sequence[dict[str, str]]) -> list[str]:
    """The tool results since the last user turn, in order."""
    return [t["content"].strip() for t in _since_user(turns) if t["role"] == "tool" and t["content"].strip()]


def _numbers(text: str) -> set[str]:
    return {m.group(0).replace(",", "") for m in _NUMBER.finditer(text)}


def _plain(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .!?;:")


def states_results(text: str, results: Sequence[str]) -> bool:
    """Whether `text` states every result: each number of a result (thousands separators aside), or
    the result's text when it holds no number (case and spacing aside)."""
    said, plain = _numbers(text), _plain(text)
    for r in results:
        nums = _numbers(r)
        if nums and not nums <= said:
            return False
        if not nums and _plain(r) not in plain:
            return False
    return True


def call_log_odds(loglik: float) -> float:
    """log(p / (1 - p)) for p = exp(loglik), the odds of a call against everything else."""
    p = math.exp(min(loglik, 0.0))
    return loglik - math.log1p(-p) if p < 1.0 else math.inf


def _banned_first(engine) -> list[int]:
    """Token ids whose text would begin a call (a prefix of `<tool_call>`, after leading space)."""
    key = engine.profile_id
    if key not in _BANNED:
        texts = engine.tokenizer.batch_decode([[i] for i in range(len(engine.tokenizer))])
        _BANNED[key] = [i for i, t in enumerate(texts)
                        if (s := t.lstrip()) and (TOOL_CALL_OPEN.startswith(s) or s.startswith(TOOL_CALL_OPEN))]
    return _BANNED[key]


def _first_token(dec: Decoder, first_logits: torch.Tensor) -> int:
    """The answer's first token: the model's pick (greedy or sampled) among tokens that open no call."""
    logits = first_logits.clone()
    logits[_banned_first(dec.memory.engine)] = float("-inf")
    return choose_token(logits, dec.sampling, torch.Generator(device="cpu").manual_seed(dec.sampling.seed))


def _until(text: str, stop: Sequence[str]) -> str:
    """`text` up to its first stop string (as `KVMemory.generate` cuts an answer)."""
    for s in stop:
        if s and s in text:
            text = text[: text.index(s)]
    return text


def next_step(dec: Decoder, tools: Sequence[dict], turns: Sequence[dict[str, str]], max_tokens: int,
              stop: Sequence[str] = ()) -> AfterTool:
    """The model's next step after a tool result, by the policy of the module docstring."""
    names = tool_names(tools)
    loglik, first_logits = dec.opening(TOOL_CALL_OPEN)
    odds = call_log_odds(loglik)
    notes: dict = {"call_log_odds": round(odds, 3), "call_margin": round(CALL_MARGIN, 3)}
    if odds > CALL_MARGIN:
        call = call_tool(dec, tools, "", names, max_tokens)
        if call["type"] != "tool_call" or call_key(call["name"], call["args"]) not in answered_calls(turns, names):
            return AfterTool(call=call, finish_reason="tool_calls", notes={**notes, "step": "call"})
        notes["repeated_call_refused"] = call["name"]
    return _answer(dec, turns, first_logits, max_tokens, [TOOL_CALL_OPEN, PARAGRAPH, *stop], notes)


def _answer(dec: Decoder, turns: Sequence[dict[str, str]], first_logits: torch.Tensor, max_tokens: int,
            stop: list[str], notes: dict) -> AfterTool:
    eng = dec.memory.engine
    eos = set(eng.eos_token_ids)
    first = _first_token(dec, first_logits)
    dec.stats.tokens_decoded += 1
    generated: list[int] = [first]
    finish = "stop"
    if first not in eos and max_tokens > 1:
        ans = dec.free("", max_new_tokens=max_tokens - 1, stop=stop, after_ids=[first])
        generated += ans.token_ids
        finish = "length" if ans.stopped_by == "length" else "stop"
    elif first not in eos:
        finish = "length"
    text = _until(eng.decode([t for t in generated if t not in eos]), stop).strip()
    results = [r for r in tool_results(turns) if len(r) <= SHORT_RESULT]
    if states_results(text, results):
        return AfterTool(text=text, finish_reason=finish, notes={**notes, "step": "answer"})
    # The model's paragraph lost the result: it answers again, opening with the results as given.
    opening = dec.force("; ".join(results))
    left = max_tokens - len(generated)
    if left < 1:
        return AfterTool(text=opening, finish_reason="length",
                         notes={**notes, "step": "answer", "opened_with_results": True})
    ans = dec.free(opening, max_new_tokens=left, stop=stop)
    # Only the model's continuation is cut at a stop: the results are kept whole, whatever they hold.
    head_ids = dec.encode(opening)
    full, head = eng.decode(head_ids + [t for t in ans.token_ids if t not in eos]), eng.decode(head_ids)
    rest = full[len(head):] if full.startswith(head) else ans.text
    text = (opening + _until(rest, stop)).strip()
    return AfterTool(text=text, finish_reason="length" if ans.stopped_by == "length" else "stop",
                     notes={**notes, "step": "answer", "opened_with_results": True})
