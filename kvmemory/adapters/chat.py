"""One chat call of a framework's chat model: routing, prefix caching, tools and structured output.

The conversation (turns from `messages.to_turns`) gets its instructions in the system turn (the
tools, a JSON schema), its last user turn is routed to stored verified solutions, and the prompt is
laid out by `KVMemory.chat_prompt` (entries before the conversation, as `KVMemory.chat` places them).
Then, under the memory's lock:

- a response schema: the JSON value is written under the schema's guidance (`guided.JsonGuide`);
- a required tool call (`tool_choice` "any" or a tool's name, or `tool_policy="user_turn"` on a
  user turn): the model picks the tool and decodes its arguments under its schema (`guided.call_tool`);
- `tool_policy="scored"` (the default) on a user turn with tool_choice "auto": only the tools that fit
  the question are offered (`tool_fits`: the router's embedder), then the model's own likelihoods
  decide between calling one and answering (`wants_tool`), then as above; an answer (no tool fits, or
  the model prefers answering) is decoded over the conversation without the tool list;
- after a tool result with tool_choice "auto" (every policy): an answer that states the result,
  unless another call is clearly likelier and is not one already answered (`after_tool`);
- otherwise free text, read for a tool call the model began by itself when tools are bound.

With `cache_prefixes`, the first call over a system turn whose blocks are not stored yet stores the
blocks it computes anyway (no extra forward), so later calls graft them. The outcome says what was
routed and grafted and what every pass cost (`guided.DecodeStats`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmemory.adapters.after_tool import after_tool_result, next_step
from kvmemory.adapters.guided import Decoder, DecodeStats, JsonGuide, call_tool
from kvmemory.adapters.messages import (TOOL_CALL_OPEN, parse_tool_calls, schema_prompt, tool_names, tools_prompt,
                                        with_instructions)
from kvmemory.errors import InvalidInput
from kvmemory.adapters.shared import SharedMemory
from kvmemory.engine.runner import GREEDY, Sampling
from kvmemory.memory.facade import KVMemory, Recalled
from kvmemory.memory.prompts import render_ids
from kvmemory.memory.recurrence import answer as recurrence_answer
from kvmemory.memory.verifiers import kind_of
from kvmemory.routing.embedders import MINILM_SHA256

# What an unforced call (tool_choice "auto") with tools bound does on a user turn (see `ChatRequest.tool_policy`).
TOOL_POLICIES = ("scored", "model", "user_turn")

# `wants_tool`: the content-free user message the question is compared with ("Calibrate Before Use",
# Zhao et al. 2021: a model's bias towards an output is measured on an input that carries no content),
# and the margin. Measured on the embedded SmolLM2-135M-Instruct with a weather and a calculator tool:
# the log-likelihood of `<tool_call>{"name": "<tool>"` given a question that needs the tool minus the
# same given "N/A" was -4.4 to +0.6 over six such questions, -11.2 for "Write a haiku about spring."
CONTENT_FREE = "N/A"
TOOL_MARGIN = -7.0
_BASELINES: dict[tuple, list[float]] = {}  # (profile, content-free prompt ids, options) -> their scores
_MAX_BASELINES = 64

# `tool_fits`: which tools fit the question at all, before the model scores any (issue 48, item 6: a
# question no tool fits, "Capital of France?", got a call). The model's shift cannot tell: on
# bench/agent_questions.py's calibration sets, "Which animal says moo?" moved the model towards
# `define_word` (shift -0.73) more than "What is 347 multiplied by 29?" moved it towards `calculator`
# (-5.1). The question's cosine with each tool's "name: description" in the router's sentence embedder
# does: over CALIBRATION's 12 tool questions the tool they need scored 0.356 to 0.598, over
# NO_TOOL_CALIBRATION's 6 questions every given tool scored at most 0.294. The floor sits between
# (0.32); a tool under it is not offered, and with none left the model answers without a call.
# Per embedder (its weights' SHA-256): an embedder with no measured floor offers every tool, as before.
TOOL_FIT_FLOORS: dict[str, float] = {MINILM_SHA256: 0.32}
_TOOL_VECTORS: dict[tuple[str, str], object] = {}  # (embedder sha, tool text) -> its unit vector
_MAX_TOOL_VECTORS = 512

# How the runner's stop reasons read as a chat response's finish reason.
_FINISH = {"stop_token": "stop", "stop": "stop", "length": "length"}


@dataclass(slots=True)
class ChatRequest:
    """One call's settings (the adapter resolves them from its fields and the call's arguments)."""

    turns: list[dict[str, str]]
    tools: list[dict] = field(default_factory=list)  # OpenAI tool dicts
    tool_choice: str = "auto"  # "auto", "none", "any" or a tool's name (messages.normalize_tool_choice)
    # What an unforced call (tool_choice "auto") with tools does on a user turn: "scored" lets the
    # model's likelihoods decide between a tool call and an answer (`wants_tool`); "model" decodes
    # freely and reads a call the model wrote by itself (a small model seldom does); "user_turn" always
    # calls a tool. After a tool result every policy answers unless another call is clearly likelier
    # (`after_tool`: the policy that lets an agent loop end).
    tool_policy: str = "scored"
    response_schema: dict | None = None
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 256
    sampling: Sampling = GREEDY
    namespace: str | None = None
    route: bool = True
    k: int = 1
    threshold: float | None = None
    cache_prefixes: bool = True
    # Whether the blocks the first pass computes are stored: None follows the memory's block_policy
    # and `cache_prefixes`; True / False always / never (a server storing every conversation's blocks,
    # so that the next turn grafts them, or a request that asks for nothing to be kept).
    store_blocks: bool | None = None

    @property
    def tool_mode(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def held_back(self) -> list[str]:
        """Where streamed text stops being the answer: the stop strings, and the start of a tool call."""
        return list(self.stop) + ([TOOL_CALL_OPEN] if self.tool_mode and TOOL_CALL_OPEN not in self.stop else [])


@dataclass(slots=True)
class ChatOutcome:
    """What a call produced, what it used (`hits`) and what it cost (`stats`)."""

    text: str
    tool_calls: list[dict] = field(default_factory=list)
    invalid_tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    stats: DecodeStats | None = None
    hits: list[Recalled] = field(default_factory=list)
    profile_id: str = ""
    notes: dict = field(default_factory=dict)  # how the call was decided (e.g. "after_tool": its log-odds)

    def provenance(self) -> dict:
        """The token counts of every pass, the routed entries (id, score, verified, kind, attestation) and
        the execution profile."""
        return {
            **(self.stats.to_json() if self.stats else {}),
            "entries": [{"id": h.entry.id, "score": round(h.score, 4), "namespace": h.entry.namespace,
                         "verified": h.entry.verified, "kind": kind_of(h.entry), "answer": h.entry.answer,
                         "attestation_id": h.entry.attestation.get("attestation_id")} for h in self.hits],
            "profile_id": self.profile_id,
            **self.notes,
        }


def prefix_missing(memory: KVMemory, system_turn: dict[str, str], prompt_ids: Sequence[int],
                   cuts: Sequence[int] = ()) -> bool:
    """Whether the system turn's blocks are not stored yet (its whole blocks, and its tail block where
    its end is one of the prompt's `cuts`: memory/layout.py). The first pass over such a prompt then
    stores the blocks it computes anyway, so later calls graft them; the blocks after the system turn
    that are stored with them are as content-addressed as any."""
    eng = memory.engine
    ids = render_ids(eng.tokenizer, [system_turn])
    end = min(len(ids), len(prompt_ids) - 1)
    want = end if end in cuts else end // eng.chunk * eng.chunk
    if want == 0 or list(prompt_ids[: len(ids)]) != ids or getattr(memory.store, "readonly", False):
        return False
    return eng.stored_prefix_tokens(prompt_ids, cuts) < want


def run_chat(shared: SharedMemory, req: ChatRequest, on_text: Callable[[str], None] | None = None) -> ChatOutcome:
    """Run one call under the memory's lock; `on_text` gets the free text as it is decoded (and is
    checked by every guided pass: `streaming`)."""
    mem = shared.memory
    with shared.lock:
        dec, turns, hits = _open(mem, req, req.tools if req.tool_mode else [], on_text)
        out = None if req.tool_mode else _recurrence(mem, req, turns, hits, dec, on_text)
        out = out or _decode(req, dec, turns)
        if isinstance(out, _NoCall):
            # The scored policy decided on an answer, not a call: the answer is decoded over the
            # conversation without the tool list, which a model that reads it well (Qwen 1.5B) otherwise
            # answers with a call's JSON written as text ("{"name": "get_weather", ...}").
            notes = out.notes
            first = dec.stats
            dec, turns, hits = _open(mem, req, [], on_text, hits)  # the same last turn: routed once
            dec.add_stats(first)
            rec = _recurrence(mem, req, turns, hits, dec, on_text)
            if rec is not None:
                rec.notes = {**notes, **rec.notes}
                out = rec
        if isinstance(out, _NoCall):
            ans = dec.free("", max_new_tokens=req.max_tokens, stop=req.stop, shown=True)
            out = ChatOutcome(ans.text, finish_reason=_FINISH.get(ans.stopped_by, "stop"), notes=notes)
    out.stats, out.hits, out.profile_id = dec.stats, hits, mem.engine.profile_id
    return out


def _recurrence(mem: KVMemory, req: ChatRequest, turns: list[dict], hits: list[Recalled], dec: Decoder,
                on_text) -> ChatOutcome | None:
    """A plain reply (no schema) to a user turn that asks a routed verified problem again
    (memory/recurrence.py): the verified working's answer, as `answer(choices="numbers")` gives it."""
    if req.response_schema is not None or not hits or turns[-1]["role"] != "user" or not req.route:
        return None
    ans = recurrence_answer(mem, turns[-1]["content"], hits, store_blocks=req.store_blocks)
    if ans is None or not ans.text:
        return None
    dec.add_answer(ans.report, ans.seconds)
    if on_text is not None:
        on_text(ans.text)
    return ChatOutcome(ans.text, finish_reason="stop",
                       notes={"recurrence": {"entry": ans.entries[0] if ans.entries else None, "answer": ans.text,
                                             "choices": ans.choices, "source": ans.source}})


def _open(mem: KVMemory, req: ChatRequest, tools: list[dict], on_text,
          hits: list[Recalled] | None = None) -> tuple[Decoder, list[dict], list[Recalled]]:
    """Lay out the call's prompt with these tools listed (none: a plain conversation) and a decoder over it
    (`hits`: the entries the call's last user turn already routed to, not routed again)."""
    turns = with_instructions(req.turns, tools_prompt(tools) if tools else "",
                              schema_prompt(req.response_schema) if req.response_schema is not None else "")
    prompt = mem.chat_prompt(turns, route=req.route, k=req.k, namespace=req.namespace, threshold=req.threshold,
                             hits=hits)
    if req.store_blocks is not None:
        store_new = req.store_blocks and not getattr(mem.store, "readonly", False)
    else:
        store_new = prompt.store_new_blocks or (
            req.cache_prefixes and turns[0]["role"] == "system"
            and prefix_missing(mem, turns[0], prompt.ids, prompt.cuts))
    dec = Decoder(mem, prompt.ids, req.sampling, [h.entry for h in prompt.hits],
                  [h.score for h in prompt.hits], store_new, on_text, prompt.cuts)
    return dec, turns, prompt.hits


@dataclass(slots=True)
class _NoCall:
    """The scored policy's decision to answer without a call (`notes`: how it was decided)."""

    notes: dict


def _decode(req: ChatRequest, dec: Decoder, turns: list[dict]) -> ChatOutcome | _NoCall:
    """The call's outcome, or `_NoCall` where the scored policy chose to answer without a call."""
    names = tool_names(req.tools)
    if req.response_schema is not None:
        guide = JsonGuide(dec, "", req.response_schema, req.max_tokens)
        value = guide.value(req.response_schema)
        return ChatOutcome(json.dumps(value, ensure_ascii=False), finish_reason="length" if guide.truncated else "stop")
    if req.tool_policy not in TOOL_POLICIES:
        raise InvalidInput(f"tool_policy must be one of {', '.join(TOOL_POLICIES)}, got {req.tool_policy!r}")
    user_turn = turns[-1]["role"] == "user"
    forced = req.tool_mode and (req.tool_choice != "auto" or (req.tool_policy == "user_turn" and user_turn))
    if forced:
        allowed = names if req.tool_choice in ("any", "auto") else [req.tool_choice]
        return _tool_outcome("", call_tool(dec, req.tools, "", allowed, req.max_tokens))
    if req.tool_mode and after_tool_result(turns):
        step = next_step(dec, req.tools, turns, req.max_tokens, req.stop)
        notes = {"after_tool": step.notes}
        if step.call is not None:
            out = _tool_outcome("", step.call)
            out.notes = notes
            return out
        return ChatOutcome(step.text, finish_reason=step.finish_reason, notes=notes)
    choice: dict = {}
    if req.tool_mode and req.tool_policy == "scored" and user_turn:
        fit = tool_fits(dec.memory, turns[-1]["content"], req.tools)
        offered = names if fit is None else [n for n in names if fit["scores"][n] >= fit["floor"]
                                             or n in fit["arithmetic"]]
        choice = {"tool_choice": {"fit": fit, "offered": offered}}
        pick = wants_tool(dec, turns, offered) if offered else None
        choice["tool_choice"]["called"] = pick
        if pick is None:
            return _NoCall(choice)  # answered without the tools: `run_chat`
        out = _tool_outcome("", call_tool(dec, req.tools, "", [pick], req.max_tokens))
        out.notes = choice
        return out
    ans = dec.free("", max_new_tokens=req.max_tokens, stop=req.held_back, shown=True)
    if req.tool_mode:
        raw = dec.memory.engine.decode(ans.token_ids)
        if TOOL_CALL_OPEN in raw:  # the model began a call by itself: write it out under the schema
            head = raw[: raw.index(TOOL_CALL_OPEN)]
            return _tool_outcome(ans.text, call_tool(dec, req.tools, head, names, req.max_tokens))
        rest, calls, invalid = parse_tool_calls(ans.text, names)
        if calls or invalid:
            return ChatOutcome(rest, calls, invalid, finish_reason="tool_calls")
    return ChatOutcome(ans.text, finish_reason=_FINISH.get(ans.stopped_by, "stop"), notes=choice)


def tool_fits(memory: KVMemory, question: str, tools: Sequence[dict]) -> dict | None:
    """How well each tool fits `question`: {"scores": {name: cosine}, "floor": the embedder's measured
    floor} (see TOOL_FIT_FLOORS), or None when the router's embedder has no measured floor (then every
    tool is offered). The tools' vectors are kept per embedder, so an agent loop embeds its question only."""
    import numpy as np

    from kvmemory.routing.embedders import weights_fingerprint

    if not question.strip() or not tools:
        return None
    emb = memory.router.embedder
    try:
        sha = weights_fingerprint(emb.path, emb.weight_files())
    except Exception:  # noqa: BLE001 - an embedder without weight files on disk (a test double, a remote one)
        return None
    floor = TOOL_FIT_FLOORS.get(sha)
    if floor is None:
        return None
    texts = {t["function"]["name"]: _tool_text(t["function"]) for t in tools}
    missing = [x for x in dict.fromkeys(texts.values()) if (sha, x) not in _TOOL_VECTORS]
    vecs = emb.embed([question, *missing])
    if len(_TOOL_VECTORS) + len(missing) > _MAX_TOOL_VECTORS:
        _TOOL_VECTORS.clear()
    for x, v in zip(missing, vecs[1:]):
        _TOOL_VECTORS[(sha, x)] = v
    q = vecs[0]
    # The embedder does not put arithmetic asked in words ("What is 12 times 7?") near an arithmetic
    # tool's description (0.24 against "multiply: Multiply two integers."): a question that writes a
    # number and an operation fits every tool whose name or description is about arithmetic.
    arithmetic = [n for n, x in texts.items() if _ARITH_TOOL.search(x)] if _asks_arithmetic(question) else []
    return {"scores": {n: round(float(np.dot(q, _TOOL_VECTORS[(sha, x)])), 4) for n, x in texts.items()},
            "floor": floor, "arithmetic": arithmetic}


_ARITH_TOOL = re.compile(r"(?i)\b(multipl|add\b|adds\b|sum|subtract|divi|calculat|arithmetic|math|product|"
                         r"evaluat|plus|minus|percent)")
_ARITH_ASK = re.compile(r"(?i)(\d\s*[-+*/x×÷^%]\s*\d|\d\s*%|\b(times|multipl\w*|divided|plus|minus|sum|"
                        r"product|percent|squared|cubed|add|subtract)\b)")


def _asks_arithmetic(question: str) -> bool:
    """A number and an operation on it ("23 times 19", "15% of 240", "12*7")."""
    return bool(re.search(r"\d", question)) and bool(_ARITH_ASK.search(question))


def _tool_text(fn: dict) -> str:
    """What a tool is compared with: its name in words and its description ("get weather: Get the ...")."""
    name = str(fn.get("name", "")).replace("_", " ").strip()
    desc = " ".join(str(fn.get("description") or "").split())
    return f"{name}: {desc}" if desc else name


def _call_heads(names: list[str]) -> list[str]:
    return [TOOL_CALL_OPEN + '{"name": "' + n + '"' for n in names]


def wants_tool(dec: Decoder, turns: list[dict], names: list[str]) -> str | None:
    """The tool the model would call for the last user turn, or None when it should answer.

    Each tool's score is the model's log-likelihood of opening the assistant turn with a call to it,
    minus the same after a content-free user turn in its place (same system turn and history): how much
    the question itself moves the model towards the call. A small model gives every call a low
    likelihood, so the raw value says little; the shift it gets from the question is what separates a
    weather question from a haiku request (see TOOL_MARGIN). The content-free scores are kept per
    prompt, so an agent loop over one set of tools computes them once."""
    heads = _call_heads(names)
    asked = dec.loglik("", heads)
    mem = dec.memory
    free_turns = [dict(t) for t in turns[:-1]] + [{"role": "user", "content": CONTENT_FREE}]
    free_ids = mem.chat_ids(free_turns, [])
    key = (mem.engine.profile_id, tuple(free_ids), tuple(heads))
    base = _BASELINES.get(key)
    if base is None:
        calib = Decoder(mem, free_ids, dec.sampling)
        base = calib.loglik("", heads)
        dec.add_stats(calib.stats)
        if len(_BASELINES) >= _MAX_BASELINES:
            _BASELINES.pop(next(iter(_BASELINES)))
        _BASELINES[key] = base
    shift = [a - b for a, b in zip(asked, base)]
    best = max(range(len(names)), key=lambda i: (shift[i], -i))
    return names[best] if shift[best] > TOOL_MARGIN else None


def _tool_outcome(text: str, call: dict) -> ChatOutcome:
    valid = call["type"] == "tool_call"
    return ChatOutcome(text, [call] if valid else [], [] if valid else [call], finish_reason="tool_calls")
