"""What `KVMemory.answer` returns, and how it chooses among given answers (`choices=`).

`Answer` is an answer with its provenance (entries, scores, attestations, the graft's report). With
`choices`, the answer is not decoded: each choice is scored by the model's log-likelihood after the
prompt (one batched forward, the routed entries grafted), contrasted with its likelihood after the
question alone (`DEFAULT_CONTRAST`), and a routed verified entry's own answer starts `DEFAULT_PRIOR`
nats ahead (memory/choices.py says which choices those are). `KVMemory.answer`'s docstring says why.

Every answer says where it came from (`Answer.source`): "memory" (a routed solution was in context),
"intermediate" (the question asks another quantity than the routed solution answered, memory/asks.py:
the answer was chosen among the other numbers of its working, `outcome` OTHER_ASK), "note" (only notes
were), "model" (nothing routed: the model alone) or "none" (nothing was answered).
`choices="numbers"` with nothing to choose among (no entry routed, or none writes a number) is not a
silent free decode: it returns at once with `outcome` NOTHING_ROUTED or NO_CHOICES and a `reason`
(`nothing_to_choose="return"`, the default), or the model's own answer capped to a sentence
(`SENTENCE_TOKENS`, stopped at a line end) and flagged `outcome` MODEL_ALONE (`nothing_to_choose="decode"`).

A question routed to notes only (statements, memory/notes.py) is answered from them (`from_note`,
`note_answer="statement"`, the default): the answer is the routed notes' sentence that best matches the
question by the router's embedder (a note `add` wrote is one sentence: the note itself), `outcome`
NOTE_STATEMENT, no model time. The 135M embedded model reading a grafted note back answers with an empty
string or a refusal as often as with the fact, so this deterministic answer, reported as the note's, is
the default; `note_answer="decode"` lets the model decode from the grafted note as before.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmemory.engine.graft import GraftReport
from kvmemory.memory import choices
from kvmemory.memory.layout import Layout
from kvmemory.memory.notes import sentences
from kvmemory.memory.verifiers import kind_of

# How much of the no-memory likelihood of a choice `answer(choices=...)` subtracts (see there).
DEFAULT_CONTRAST = 0.5
# Nats added to a routed verified entry's own answer among `choices="numbers"`: the smallest (in steps of
# 0.5) with which every routed rewording and original of the calibration set is answered right
# (bench/rewordings.py; BENCHMARKS.md "Routing rewordings").
DEFAULT_PRIOR = 2.5

# `Answer.outcome` when `choices` had nothing to choose among (None: the answer was chosen or decoded)
NOTHING_ROUTED = "nothing_routed"  # no entry routed: no numbers to offer
NO_CHOICES = "no_choices"  # entries routed, but their solutions write no number
MODEL_ALONE = "model_alone"  # nothing_to_choose="decode": the model's own answer, capped to a sentence
NOTHING_TO_CHOOSE = ("return", "decode")  # what `answer(nothing_to_choose=...)` takes
# Tokens the model may decode for its own answer when there was nothing to choose among: a sentence.
SENTENCE_TOKENS = 32
# `Answer.outcome` of a question answered with a routed note's statement (`from_note`)
NOTE_STATEMENT = "note_statement"
STATEMENT = "statement"  # answer(note_answer=STATEMENT): a routed note's sentence is the answer (default)
NOTE_DECODE = "decode"  # answer(note_answer=NOTE_DECODE): the model decodes from the grafted note
NOTE_ANSWERS = (STATEMENT, NOTE_DECODE)  # what `answer(note_answer=...)` takes
# `Answer.outcome` of a question that asks another quantity than a routed verified entry answered
# (memory/asks.py): chosen among its working's other numbers, or, with none, nothing answered
OTHER_ASK = "other_ask"
OTHER_ASK_NO_CHOICES = "other_ask_no_choices"
# `Answer.source`
SOURCES = ("memory", "intermediate", "note", "model", "none")


@dataclass(slots=True)
class Answer:
    """An answer with its provenance."""

    text: str
    token_ids: list[int]
    report: GraftReport
    entries: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    attestations: list[str] = field(default_factory=list)
    verified: list[bool] = field(default_factory=list)
    seconds: float = 0.0
    stopped_by: str = "length"
    choices: list[str] = field(default_factory=list)  # what the answer was chosen among ([] = free decode)
    choice_scores: list[float] = field(default_factory=list)  # the model's log-likelihood of each
    # Entries routed to but not used, each {"entry", "reason"}: they did not check against themselves
    # or the route to them could not be trusted (memory/entry_check.py); the answer did without them.
    refused: list[dict] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # each used entry's kind: "solution" or "note" (memory/notes.py)
    outcome: str | None = None  # NOTHING_ROUTED, NO_CHOICES, MODEL_ALONE, OTHER_ASK... (the module docstring); None otherwise
    reason: str | None = None  # with an outcome: what happened and what to do

    @property
    def source(self) -> str:
        """Where the answer came from: "memory", "intermediate", "note", "model" or "none" (the module docstring)."""
        if self.outcome in (NOTHING_ROUTED, NO_CHOICES, OTHER_ASK_NO_CHOICES):
            return "none"
        if self.outcome == OTHER_ASK:
            return "intermediate"
        if any(k != "note" for k in self.kinds):
            return "memory"
        return "note" if self.kinds else "model"

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "source": self.source,
            "outcome": self.outcome,
            "reason": self.reason,
            "refused": self.refused,
            "kinds": self.kinds,
            "choices": self.choices,
            "choice_scores": [round(s, 4) for s in self.choice_scores],
            "entries": self.entries,
            "scores": [round(s, 4) for s in self.scores],
            "attestations": self.attestations,
            "verified": self.verified,
            "seconds": round(self.seconds, 4),
            "stopped_by": self.stopped_by,
            **self.report.to_json(),
        }


def best_sentence(mem, query: str, hits: Sequence) -> tuple[int, str]:
    """(index of the hit, sentence): the routed notes' sentence nearest the question in the router's
    embedder (cosine of normalised embeddings; the first on a tie, the best-routed note first)."""
    candidates: list[tuple[int, str]] = []
    for i, h in enumerate(hits):
        parts = sentences(h.entry.problem) or [h.entry.problem.strip()]
        candidates.extend((i, s) for s in parts)
    if len(candidates) == 1:
        return candidates[0]
    emb = mem.router.embedder
    vecs = emb.embed([query, *[s for _, s in candidates]])
    q = vecs[0]
    scores = [float(x) for x in np.asarray(vecs[1:], dtype=np.float64) @ np.asarray(q, dtype=np.float64)]
    best = max(range(len(candidates)), key=lambda j: (scores[j], -j))
    return candidates[best]


def from_note(mem, query: str, hits: Sequence) -> Answer:
    """`KVMemory.answer` for a question routed to notes only: the best-matching sentence of the routed
    notes (`best_sentence`), as the note's answer (`source` "note", `outcome` NOTE_STATEMENT)."""
    t0 = time.perf_counter()
    i, text = best_sentence(mem, query, hits)
    e = hits[i].entry
    return Answer(text=text, token_ids=list(mem.engine.encode(text)), report=GraftReport(), entries=[e.id],
                  scores=[hits[i].score], attestations=[e.attestation.get("attestation_id", "")],
                  verified=[e.verified], seconds=time.perf_counter() - t0, stopped_by="note",
                  kinds=[kind_of(e)], outcome=NOTE_STATEMENT,
                  reason="answered with the routed note's statement (its sentence nearest the question), not "
                         "decoded: pass note_answer=\"decode\" for the model's answer from the grafted note")


def nothing_to_choose(hits: Sequence) -> Answer:
    """The answer of `choices="numbers"` when there is nothing to choose among: returned at once, no model
    time, with a typed `outcome` and a `reason` that says what to do."""
    entries = [h.entry for h in hits]
    if not entries:
        outcome, reason = NOTHING_ROUTED, (
            "no entry routed to the question, so there are no numbers to choose among and nothing was answered; "
            "remember a solution to such a question, lower the threshold, or ask without choices= (or with "
            "nothing_to_choose=\"decode\") for the model's own answer")
    else:
        outcome, reason = NO_CHOICES, (
            "the routed entries' solutions write no number to choose among, so nothing was answered; ask "
            "without choices= (or with nothing_to_choose=\"decode\") for an answer decoded from them")
    return Answer(text="", token_ids=[], report=GraftReport(), entries=[e.id for e in entries],
                  scores=[h.score for h in hits], attestations=[e.attestation.get("attestation_id", "") for e in entries],
                  verified=[e.verified for e in entries], stopped_by="nothing_to_choose",
                  kinds=[kind_of(e) for e in entries], outcome=outcome, reason=reason)


# Engines whose store got the template preamble's block from this process (keep_preamble)
_PREAMBLE_KEPT: weakref.WeakSet = weakref.WeakSet()


def keep_preamble(engine, layout: Layout) -> None:
    """Store the block of the chat template's preamble (an entry-less layout's only cut: layout.py's
    `question_layout`) once per engine, so that every question computed alone (an answer's contrast)
    grafts it instead of computing it again (24 tokens of SmolLM2's 79-token contrasts). A read-only
    store is left as it is."""
    if engine in _PREAMBLE_KEPT or not layout.cuts or getattr(engine.store, "readonly", False):
        return
    cut = layout.cuts[0]
    engine.store_prefix(layout.ids[:cut], pinned=False, cuts=(cut,))
    _PREAMBLE_KEPT.add(engine)


def choose(mem, prompt: Layout, offered: list[str], end: str, answer_prefix: str | None,
           hits: Sequence, query: str, contrast: float, prior: float, other: dict[str, str] | None = None,
           store: bool = False) -> Answer:
    """`KVMemory.answer` with choices: each offered answer (followed by `end`) scored by the model after
    `prompt` (the routed entries grafted), contrasted with its score after the question alone, a routed
    verified entry's own answer raised by `prior`, unless the question asks another quantity than that
    entry answered (`other`: {entry id: why}, memory/asks.py); the best one is the answer. `store`: the
    grid-aligned blocks both prompts compute are stored (an identical question then grafts them)."""
    other = other or {}
    eng = mem.engine
    t0 = time.perf_counter()
    sep = " " if answer_prefix else ""
    tokenized = [eng.encode(f"{sep}{c}{end}") for c in offered]
    entries = [h.entry for h in hits]
    asks = [dict(token_ids=prompt.ids, choices=tokenized, entries_used=[e.id for e in entries], cuts=prompt.cuts,
                 store_new_blocks=store)]
    if entries and contrast:  # the same choices after the question alone, in the same steps where batched
        alone = mem.question_layout(query, (), answer_prefix)  # cut after the template's preamble
        if mem.block_policy != "none":  # "none": nothing the answer computes is stored
            keep_preamble(mem.engine, alone)
        asks.append(dict(token_ids=alone.ids, choices=tokenized, cuts=alone.cuts, store_new_blocks=store))
    chosen = eng.choose_many(asks)
    best, scores, report = chosen[0]
    adjusted = False
    if len(chosen) > 1:
        _, base, rep = chosen[1]
        scores = [s - contrast * b for s, b in zip(scores, base)]
        report.tokens_scored += rep.tokens_computed + rep.tokens_scored
        report.blocks_stored += rep.blocks_stored  # the contrast's question, where stored
        adjusted = True
    if prior and (known := choices.verified_answers([e for e in entries if e.id not in other])):
        scores = [s + prior * choices.is_known(c, known) for s, c in zip(scores, offered)]
        adjusted = True
    if adjusted:  # the best of the adjusted scores (the first on a tie, as eng.choose)
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        report.tokens_decoded = len(tokenized[best])
    text = f"{(answer_prefix or '').strip()}{sep}{offered[best]}{end}".strip()
    return Answer(text=text, token_ids=tokenized[best], report=report, entries=[e.id for e in entries],
                  scores=[h.score for h in hits], attestations=[e.attestation.get("attestation_id", "") for e in entries],
                  verified=[e.verified for e in entries], seconds=time.perf_counter() - t0, stopped_by="choice",
                  choices=offered, choice_scores=scores, kinds=[kind_of(e) for e in entries],
                  outcome=OTHER_ASK if other else None, reason=_other_reason(other) if other else None)


def _other_reason(other: dict[str, str]) -> str:
    said = "; ".join(f"entry {i}: {why}" for i, why in other.items())
    return (f"the question asks another quantity than the routed solution answered ({said}): its stored answer "
            "was not used; the answer was chosen among the other numbers its working writes (pass "
            "ask_check=False to use the stored answer)")


def other_ask_unanswered(hits: Sequence, other: dict[str, str]) -> Answer:
    """`choices="numbers"` for a question that asks another quantity than the routed solution answered,
    whose working writes no other number: nothing is answered, at once, with the reason."""
    ans = nothing_to_choose(hits)
    ans.outcome = OTHER_ASK_NO_CHOICES
    ans.reason = (_other_reason(other).split(": its stored")[0] + "; its working writes no other number, so "
                  "nothing was answered: ask without choices= for the model's own answer")
    return ans
