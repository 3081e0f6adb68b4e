"""The raw-text completion `/v1/completions` runs: the prompt's tokens as they are (no chat template,
no routed entries: a raw prompt is not a question to route), the longest stored chain of its blocks
grafted (a prefix cache: a previous call's prompt, a stored system prompt, an entry's own text), then
the canonical decode.

It calls `Engine.forward` directly, so the response can carry the SHA-256 of every logit the served
run computed (prefill rows from the graft point, then the decode steps, in the runner's byte layout:
runner.ForwardResult.logits_sha256). Anyone with the same profile can recompute the same tokens from
scratch and compare those bytes: the exactness of a served answer is checkable from outside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmemory.engine.graft import GraftReport
from kvmemory.engine.runner import Sampling
from kvmemory.memory.facade import KVMemory
from kvmemory.memory.token_text import TokenText

_FINISH = {"stop_token": "stop", "stop": "stop", "length": "length"}


@dataclass(slots=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    report: GraftReport
    logits_sha256: str
    graft_point: int
    profile_id: str

    def kvmemory(self) -> dict:
        r = self.report
        return {"tokens_grafted": r.tokens_grafted, "tokens_computed": r.tokens_computed,
                "tokens_decoded": r.tokens_decoded, "blocks_stored": r.blocks_stored, "graft_point": self.graft_point,
                "logits_sha256": self.logits_sha256, "quarantined": list(r.quarantined), "entries": [],
                "attestation_ids": [], "profile_id": self.profile_id}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.report.tokens_grafted}}


class RawText:
    """What a streamed completion has shown: raw deltas as they come (a completion keeps its leading
    space), holding back a tail that could still grow into a stop string; the same interface as
    `adapters.streaming.VisibleText`, which strips (a chat answer is stripped)."""

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self.raw = ""
        self.shown = ""

    def add(self, raw_delta: str) -> str:
        self.raw += raw_delta
        text = self.raw
        cut = min([i for s in self.stop if (i := text.find(s)) != -1], default=-1)
        if cut != -1:
            text = text[:cut]
        else:
            hold = max([n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
            text = text[: len(text) - hold]
        if not text.startswith(self.shown):
            return ""
        delta, self.shown = text[len(self.shown):], text
        return delta

    def finish(self, final: str) -> str:
        delta = final[len(self.shown):] if final.startswith(self.shown) else ""
        self.shown = final
        return delta


def prompt_ids(memory: KVMemory, prompt: str) -> list[int]:
    return memory.engine.encode(prompt)


def complete(memory: KVMemory, prompt: str, *, max_tokens: int, sampling: Sampling, stop: Sequence[str] = (),
             store_blocks: bool = True, on_text: Callable[[str], None] | None = None) -> Completion:
    """Continue `prompt` (see the module docstring); `on_text` gets raw text deltas (streaming)."""
    eng = memory.engine
    ids = prompt_ids(memory, prompt)
    eos = set(eng.eos_token_ids)
    decoded = TokenText(eng.decode, skip=eos)

    def on_token(tok: int) -> bool:
        delta = decoded.add(tok)
        if on_text is not None:
            on_text(delta)  # "" too: a stream's callback checks at every token whether its client left
        return any(s in decoded.text for s in stop)

    result, report = eng.forward(ids, max_new_tokens=max_tokens, sampling=sampling,
                                 store_new_blocks=store_blocks and not getattr(memory.store, "readonly", False),
                                 on_token=on_token)
    if on_text is not None and (held := decoded.rest()):
        on_text(held)
    text = eng.decode([t for t in result.generated if t not in eos])
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return Completion(text=text, prompt_tokens=len(ids), completion_tokens=len(result.generated),
                      finish_reason=_FINISH.get(result.stopped_by, "stop"), report=report,
                      logits_sha256=result.logits_sha256, graft_point=result.start, profile_id=eng.profile_id)
