"""Decoding passes over one prompt: free text, choices scored by the model, schema-guided JSON and
forced tool calls.

A tiny model does not reliably emit a tool call or a JSON object by itself, so the structure is
written for it and only the content is left to it, as constrained-decoding back ends do:

- `Decoder.free` decodes text (greedy or seeded sampling) with the longest stored chain grafted.
- `Decoder.choose` picks one of a few continuations (a tool name, an enum value, true/false) by the
  model's own log-likelihood of each (`Decoder.loglik`): the model chooses, among options the schema
  allows.
- `JsonGuide` writes a JSON value for a JSON schema: braces, keys, quotes and commas are written
  ("forced" tokens), every value is decoded by the model (a string up to its closing quote, a number
  as digits) or chosen by it (enums, booleans). A value the model does not write as its type raises
  `GuidedDecodingError`: nothing is made up.
- `call_tool` writes one tool call in the text protocol of `messages`: the model picks the tool by
  likelihood and decodes its arguments under the tool's parameter schema.

Every pass goes through `KVMemory.generate` / `Engine.forward`, the canonical runner, so whatever the
store holds for the prompt (a routed entry, a stored system prompt) is grafted on each pass; the
counts of grafted, computed, decoded and forced tokens are added up in `DecodeStats`. A `Decoder`
given a stream's `on_text` (see `streaming`) calls it with "" before every pass and at every token
that adds text, so a consumer that went away stops guided passes as promptly as free text.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmemory.adapters.errors import GuidedDecodingError
from kvmemory.adapters.messages import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, invalid_tool_call, new_call_id, tool_call
from kvmemory.engine.runner import Sampling
from kvmemory.memory.facade import Answer, KVMemory
from kvmemory.store.local import EntryRecord

# Per-value token caps: digits never need many tokens; strings share the call's budget.
_NUMBER_TOKENS = 12
_MIN_STRING_TOKENS = 4
_INT = re.compile(r'\s*"?\s*(-?\d+)')
_NUM = re.compile(r'\s*"?\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)')


@dataclass(slots=True)
class DecodeStats:
    """What one chat call cost, over all its passes through the model."""

    prompt_tokens: int
    prompt_grafted: int | None = None  # tokens of the prompt grafted on the first pass
    passes: int = 0
    tokens_grafted: int = 0
    tokens_computed: int = 0
    tokens_decoded: int = 0
    tokens_forced: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    stopped_by: str = "stop"
    blocks_stored: int = 0
    tokens_scored: int = 0  # tokens computed only to score choices (a recurrence's answer: memory/recurrence.py)

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_grafted": self.prompt_grafted or 0,
            "passes": self.passes,
            "tokens_grafted": self.tokens_grafted,
            "tokens_computed": self.tokens_computed,
            "tokens_decoded": self.tokens_decoded,
            "tokens_forced": self.tokens_forced,
            "tokens_scored": self.tokens_scored,
            "bytes_read": self.bytes_read,
            "blocks_stored": self.blocks_stored,
            "seconds": round(self.seconds, 4),
            "stopped_by": self.stopped_by,
        }


@dataclass(slots=True)
class Decoder:
    """Decoding passes over one prompt (`prompt_ids`, the rendered conversation up to the assistant turn)."""

    memory: KVMemory
    prompt_ids: list[int]
    sampling: Sampling
    entries: Sequence[EntryRecord] = ()
    scores: Sequence[float] = ()
    store_new_blocks: bool = False
    on_text: Callable[[str], None] | None = None  # a stream's callback: raises once its consumer went away
    # where the prompt's segments end (memory/layout.py: routed entries, earlier turns, the prompt itself):
    # every pass cuts its chunks there, so it grafts up to them and stores them for the next turn
    cuts: tuple[int, ...] = ()
    stats: DecodeStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = DecodeStats(prompt_tokens=len(self.prompt_ids))

    def encode(self, text: str) -> list[int]:
        return self.memory.engine.encode(text) if text.strip() else (
            list(self.memory.engine.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else [])

    def _cuts_before(self, n: int) -> tuple[int, ...]:
        """The cuts before position n: a pass that needs the logits at n - 1 must not graft past it (a
        cut at n would let it end its graft there, on a tail block the first pass stored)."""
        return tuple(c for c in self.cuts if c < n)

    def _account(self, report, decoded: int) -> None:
        s = self.stats
        if s.prompt_grafted is None:
            s.prompt_grafted = min(report.tokens_grafted, s.prompt_tokens)
        s.passes += 1
        s.tokens_grafted += report.tokens_grafted
        s.tokens_computed += report.tokens_computed
        s.tokens_decoded += decoded
        s.bytes_read += report.bytes_read
        s.blocks_stored += report.blocks_stored

    def _watch(self) -> Callable[[str], None] | None:
        """What a pass whose text is not shown reports its tokens to: the stream's check only."""
        on_text = self.on_text
        if on_text is None:
            return None
        on_text("")
        return lambda _delta: on_text("")

    def free(self, assistant_text: str, *, max_new_tokens: int, stop: Sequence[str] = (),
             shown: bool = False, after_ids: Sequence[int] = ()) -> Answer:
        """Decode after the prompt and `assistant_text` (what the assistant turn already holds), then
        `after_ids` (tokens already chosen, e.g. by `opening`); `shown`: the decoded text is the
        stream's visible text (else it only checks the stream)."""
        t0 = time.perf_counter()
        on_text = self.on_text if shown else self._watch()
        ids = self.prompt_ids + self.encode(assistant_text) + [int(t) for t in after_ids]
        first = self.stats.passes == 0
        ans = self.memory.generate(ids, max_new_tokens=max(1, max_new_tokens), sampling=self.sampling,
                                   stop=stop, store_new_blocks=self.store_new_blocks and first,
                                   entries=self.entries, scores=self.scores, on_text=on_text, cuts=self.cuts)
        self._account(ans.report, len(ans.token_ids))
        self.stats.seconds += time.perf_counter() - t0
        self.stats.stopped_by = ans.stopped_by
        return ans

    def choose(self, assistant_text: str, options: Sequence[str]) -> int:
        """The index of the option the model finds most likely after the prompt and `assistant_text`."""
        if len(options) == 1:
            return 0
        scores = self.loglik(assistant_text, options)
        return max(range(len(options)), key=lambda i: (scores[i], -i))  # the first of equal scores

    def loglik(self, assistant_text: str, options: Sequence[str]) -> list[float]:
        """The model's log-likelihood of each option (the sum over its tokens) after the prompt and
        `assistant_text`: one forward per option, the prompt's stored chain grafted."""
        t0 = time.perf_counter()
        eng = self.memory.engine
        base = self.prompt_ids + self.encode(assistant_text)
        out = []
        for opt in options:
            self._watch()
            tail = self.encode(opt)
            ids = base + tail
            first = self.stats.passes == 0
            cuts = self._cuts_before(len(base))
            res, report = eng.forward(ids, keep_logits=True, store_new_blocks=self.store_new_blocks and first,
                                      cuts=cuts)
            if res.start > len(base) - 1:  # the store held the option itself: score it from scratch
                res, report = eng.forward(ids, keep_logits=True, graft=False, cuts=cuts)
            self._account(report, 0)
            rows = res.prefill_logits[len(base) - 1 - res.start: len(ids) - 1 - res.start].float()
            logp = torch.log_softmax(rows, -1)
            out.append(float(sum(logp[j, t] for j, t in enumerate(tail))))
        self.stats.seconds += time.perf_counter() - t0
        return out

    def next_logits(self, assistant_text: str) -> torch.Tensor:
        """The model's logits (float32, [vocab]) for the token after the prompt and `assistant_text`:
        one forward, the prompt's stored chain grafted (open_json.py chooses a value's kind with it)."""
        t0 = time.perf_counter()
        self._watch()
        ids = self.prompt_ids + self.encode(assistant_text)
        first = self.stats.passes == 0
        cuts = self._cuts_before(len(ids))
        res, report = self.memory.engine.forward(ids, keep_logits=True, store_new_blocks=self.store_new_blocks and first,
                                                 cuts=cuts)
        if res.start > len(ids) - 1:  # the store held all of it: compute it from scratch
            res, report = self.memory.engine.forward(ids, keep_logits=True, graft=False, cuts=cuts)
        self._account(report, 0)
        row = res.prefill_logits[len(ids) - 1 - res.start].float().clone()
        self.stats.seconds += time.perf_counter() - t0
        return row

    def opening(self, option: str) -> tuple[float, torch.Tensor]:
        """The model's log-likelihood of opening the assistant turn with `option`, and its logits for
        the turn's first token (float32, [vocab]): one forward, the prompt's stored chain grafted."""
        t0 = time.perf_counter()
        self._watch()
        tail = self.encode(option)
        ids = self.prompt_ids + tail
        first = self.stats.passes == 0
        cuts = self._cuts_before(len(self.prompt_ids))
        res, report = self.memory.engine.forward(ids, keep_logits=True,
                                                 store_new_blocks=self.store_new_blocks and first, cuts=cuts)
        if res.start > len(self.prompt_ids) - 1:  # the store held the option itself: score it from scratch
            res, report = self.memory.engine.forward(ids, keep_logits=True, graft=False, cuts=cuts)
        self._account(report, 0)
        at = len(self.prompt_ids) - 1 - res.start
        rows = res.prefill_logits[at: at + len(tail)].float()
        logp = torch.log_softmax(rows, -1)
        self.stats.seconds += time.perf_counter() - t0
        return float(sum(logp[j, t] for j, t in enumerate(tail))), rows[0].clone()

    def add_answer(self, report, seconds: float) -> None:
        """Count an `answer(choices=...)` that replies in this decoder's place (a recurrence:
        memory/recurrence.py): its prompt, the entry then the question, is what the model read."""
        s = self.stats
        s.prompt_tokens = report.tokens_grafted + report.tokens_computed
        s.prompt_grafted = report.tokens_grafted
        self._account(report, report.tokens_decoded)
        s.tokens_scored += report.tokens_scored
        s.stopped_by = "choice"
        s.seconds += seconds

    def add_stats(self, other: DecodeStats) -> None:
        """Count another decoder's passes (over another prompt, e.g. a calibration) in this call's cost."""
        s = self.stats
        s.passes += other.passes
        s.tokens_grafted += other.tokens_grafted
        s.tokens_computed += other.tokens_computed
        s.tokens_decoded += other.tokens_decoded
        s.tokens_forced += other.tokens_forced
        s.bytes_read += other.bytes_read
        s.blocks_stored += other.blocks_stored
        s.tokens_scored += other.tokens_scored
        s.seconds += other.seconds

    def force(self, text: str) -> str:
        """Count `text` as written for the model (not decoded); returns it for chaining."""
        self.stats.tokens_forced += len(self.encode(text)) if text else 0
        return text


def resolve(schema: dict, root: dict) -> dict:
    """Follow `$ref`s into `$defs` / `definitions` and pick the non-null branch of unions."""
    for _ in range(32):
        if not isinstance(schema, dict):
            return {}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            node: Any = root
            for part in ref[2:].split("/"):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            schema = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
            continue
        for key in ("anyOf", "oneOf"):
            if key in schema:
                branches = [b for b in schema[key] if resolve(b, root).get("type") != "null"]
                rest = {k: v for k, v in schema.items() if k != key}
                schema = {**rest, **(branches[0] if branches else {"type": "null"})}
                break
        else:
            if "allOf" in schema and len(schema["allOf"]) == 1:
                rest = {k: v for k, v in schema.items() if k != "allOf"}
                schema = {**rest, **schema["allOf"][0]}
                continue
            t = schema.get("type")
            if isinstance(t, list):
                non_null = [x for x in t if x != "null"]
                schema = {**schema, "type": non_null[0] if non_null else "null"}
            return schema
    return schema


def fields_of(schema: dict) -> list[str]:
    """The properties a guided object holds: the required ones (all of them when none is required)."""
    props = schema.get("properties") or {}
    required = [k for k in schema.get("required", []) if k in props]
    return required or list(props)


class JsonGuide:
    """Writes one JSON value for a schema, the model deciding every value (see the module docstring)."""

    def __init__(self, decoder: Decoder, text: str, root: dict, budget: int):
        self.d = decoder
        self.text = text  # the assistant turn so far (grows as values are written)
        self.root = root
        self.remaining = max(1, budget)
        self.strings_left = max(1, self._count_strings(root, depth=0))
        self.truncated = False

    def _count_strings(self, schema: dict, depth: int) -> int:
        s = resolve(schema, self.root)
        if depth > 8:
            return 0
        if s.get("type") == "object" or "properties" in s:
            return sum(self._count_strings(s["properties"][k], depth + 1) for k in fields_of(s))
        return 1 if s.get("type", "string") == "string" and "enum" not in s and "const" not in s else 0

    def _write(self, piece: str) -> None:
        self.text += self.d.force(piece)

    def value(self, schema: dict, depth: int = 0) -> Any:
        s = resolve(schema, self.root)
        if depth > 8:
            raise GuidedDecodingError("the schema nests deeper than 8 levels")
        if "const" in s:
            self._write(json.dumps(s["const"], ensure_ascii=False))
            return s["const"]
        if "enum" in s:
            options = [json.dumps(v, ensure_ascii=False) for v in s["enum"]]
            i = self.d.choose(self.text, options)
            self._write(options[i])
            return s["enum"][i]
        t = s.get("type") or ("object" if "properties" in s else "string")
        if t == "object":
            if "properties" not in s and s.get("additionalProperties", True) is not False:
                from kvmemory.adapters.open_json import open_object  # any object: the model writes the keys

                return open_object(self, depth)
            return self._object(s, depth)
        if t == "array":
            return self._array(s)
        if t == "boolean":
            i = self.d.choose(self.text, ["true", "false"])
            self._write(["true", "false"][i])
            return i == 0
        if t == "null":
            self._write("null")
            return None
        if t in ("integer", "number"):
            return self._number(t)
        return self._string()

    def _object(self, s: dict, depth: int) -> dict:
        out: dict[str, Any] = {}
        self._write("{")
        for i, key in enumerate(fields_of(s)):
            self._write(("" if i == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
            out[key] = self.value(s["properties"][key], depth + 1)
        self._write("}")
        return out

    def _decode(self, stop: Sequence[str], budget: int) -> str:
        budget = max(1, min(budget, self.remaining)) if self.remaining > 0 else 1
        ans = self.d.free(self.text, max_new_tokens=budget, stop=stop)
        self.remaining -= len(ans.token_ids)
        if ans.stopped_by == "length":
            self.truncated = True
        return ans.text

    def _string(self) -> str:
        self._write('"')
        share = max(_MIN_STRING_TOKENS, self.remaining // self.strings_left)
        self.strings_left = max(1, self.strings_left - 1)
        raw = self._decode(['"'], share)
        value = raw.replace("\\n", "\n").strip()
        # The decoded text is the value; it is written back JSON-escaped, so the next pass reads valid JSON.
        self.text += json.dumps(value, ensure_ascii=False)[1:]
        return value

    def _number(self, t: str) -> int | float:
        raw = self._decode([",", "}", "]", "\n"], _NUMBER_TOKENS)
        m = (_INT if t == "integer" else _NUM).match(raw)
        if not m:
            raise GuidedDecodingError(f"the model wrote {raw!r} where the schema asks for an {t}")
        value: int | float = int(m.group(1)) if t == "integer" else float(m.group(1))
        if t == "number" and float(value).is_integer() and "." not in m.group(1):
            value = int(value)
        self.text += json.dumps(value)
        return value

    def _array(self, s: dict) -> list:
        self._write("[")
        raw = self._decode(["]", "\n"], max(_MIN_STRING_TOKENS, self.remaining // self.strings_left))
        try:
            value = json.loads("[" + raw + "]")
        except ValueError:
            raise GuidedDecodingError(f"the model wrote {raw!r} where the schema asks for a JSON array") from None
        self.text += json.dumps(value, ensure_ascii=False)[1:]
        return value


def call_tool(dec: Decoder, tools: Sequence[dict], head: str, allowed: Sequence[str], budget: int) -> dict:
    """One tool call after `head` (assistant text already there): the model picks the tool among
    `allowed` by likelihood and decodes its arguments under the tool's parameter schema (`tools`:
    OpenAI tool dicts). Returns the call, of type "invalid_tool_call" when an argument could not be
    read as its type."""
    text = head + dec.force(TOOL_CALL_OPEN + '{"name": "')
    name = allowed[dec.choose(text, [n + '"' for n in allowed])]
    text += dec.force(name + '", "arguments": ')
    params = next(t["function"] for t in tools if t["function"]["name"] == name).get("parameters") or {}
    params = params if params.get("properties") else {"type": "object", "properties": {}}
    guide = JsonGuide(dec, text, params, budget)
    cid = new_call_id()
    try:
        args = guide.value(params)
    except GuidedDecodingError as exc:
        return invalid_tool_call(name, guide.text[len(text):], str(exc), cid)
    dec.force("}" + TOOL_CALL_CLOSE)
    return tool_call(name, args, cid)
