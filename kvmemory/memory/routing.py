"""Routing a question to stored entries: `recall`, and the number check that `answer` routes with.

An entry is routed when its problem (or an alias) is near the question in the sentence embedder:

- **the threshold** (the embedder's calibrated one, 0.83 for all-MiniLM-L6-v2): the score alone
  routes; with the number check, an entry whose problem writes *other* numbers than the question is
  left out (a sibling: "1234 * 57" scores 0.94 against "1234 * 56" and its stored answer is wrong);
- **the number threshold** (with the number check only; 0.61 for all-MiniLM-L6-v2): an entry whose
  problem writes *the same* numbers as the question routes from this lower score. A rewording that
  writes its numbers in words ("seven boxes of six"), adds notation ("7 cm x 5 cm, in cm^2") or
  turns the clauses around scores lower in the embedder (0.61-0.85 for rewordings in notation), and
  its numbers are the evidence that it is the same problem. Numbers are compared as values
  (memory/quantities.py: words, units, separators, fractions, cents, clock times), so a sibling
  with other numbers is refused however it is written.

A question that writes no number, or an entry whose problem writes none, needs the threshold.
A threshold given explicitly (to `KVMemory(threshold=...)`, a `Router`, or the call) is the gate for
both, unless a number threshold is given as well (`number_threshold=`, or `KVMemory.number_threshold`):
a caller who sets the score routes by that score. Embedders without a calibrated number threshold
route by the threshold alone.

`recall` without the number check lists near entries whatever their numbers (for retrievers to rank).
With `number_check=LIFT` (what `chat` routes with) the same numbers still route from the number
threshold, but other numbers refuse nothing: an entry above the threshold routes whatever numbers it
writes. A chat puts routed entries in the conversation as worked examples (a tool demonstration with
other numbers is meant to route there), while `answer(choices="numbers")` picks among an entry's numbers,
so only `answer` refuses a sibling.
Notes (statements: memory/notes.py) route from a lower threshold of their own (`route_with_notes`), and
when nothing else routes, the best note from a lower floor still, if it shares a content word with the
question (notes.NOTE_WORD_FLOOR, notes.shares_word).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvmemory.errors import IntegrityError, InvalidInput, UnknownEntry
from kvmemory.memory.entry_check import refusal
from kvmemory.memory.filters import check_where, matches
from kvmemory.memory.inputs import MAX_K, check_count, check_namespace, check_text, check_threshold
from kvmemory.memory.listing import user_meta
from kvmemory.memory.notes import NOTE_FETCH, NOTE_TEMPLATE, NOTE_WORD_FLOOR, note_threshold, shares_word
from kvmemory.memory.prompts import solution_text
from kvmemory.memory.quantities import question_numbers
from kvmemory.memory.verifiers import is_note, kind_of

# `number_check` mode: the same numbers lift a route below the threshold, other numbers refuse nothing.
LIFT = "lift"
from kvmemory.store.local import EntryRecord

__all__ = ["TEXT_TEMPLATE", "Recalled", "MAX_BELOW_THRESHOLD", "gates", "numbers_differ", "recall"]

_log = logging.getLogger("kvmemory.memory")

# How the framework adapters (LangChain and LlamaIndex retrievers, LlamaIndex's memory block) show a
# recalled entry as text; `{answer}` is also available to custom templates.
TEXT_TEMPLATE = "Problem: {problem}\nSolution: {solution}"

# Candidates below the threshold looked at for a number match, at most, per question: a store of many
# similar problems has many entries between the two thresholds, and the right one is near the top.
MAX_BELOW_THRESHOLD = 64


@dataclass(slots=True, frozen=True)
class Recalled:
    """A routed entry and its cosine score."""

    entry: EntryRecord
    score: float
    matched_text: str

    def text(self, template: str = TEXT_TEMPLATE, note_template: str = NOTE_TEMPLATE) -> str:
        """The entry as a document's text; the solution as the model read it when it was stored
        (ending with its answer). A note is shown by `note_template` (its statement, by default)."""
        e = self.entry
        if is_note(e):
            template = note_template
        return template.format(problem=e.problem, solution=solution_text(e.solution, e.answer), answer=e.answer or "")

    def metadata(self) -> dict:
        """The provenance every adapter attaches to a recalled document (the same keys everywhere)."""
        e = self.entry
        return {"entry_id": e.id, "score": float(self.score), "answer": e.answer, "verified": bool(e.verified),
                "kind": kind_of(e), "attestation_id": e.attestation.get("attestation_id"), "namespace": e.namespace,
                "problem": e.problem, "matched_text": self.matched_text}

    def to_json(self) -> dict:
        e = self.entry
        return {"id": e.id, "score": round(self.score, 4), "namespace": e.namespace, "problem": e.problem,
                "solution": e.solution, "answer": e.answer, "verified": e.verified, "kind": kind_of(e),
                "attestation_id": e.attestation.get("attestation_id"), "matched_text": self.matched_text}


def numbers_differ(question_values: frozenset, problem: str) -> bool:
    """True when the problem writes numbers and they are not the question's (which writes some)."""
    found = question_numbers(problem)
    return bool(question_values) and bool(found) and found != question_values


def gates(mem, threshold: float | None, number_threshold: float | None, number_check: bool | str) -> tuple[float, float]:
    """(threshold, number threshold) for a recall: see the module docstring. The second is the first when
    the number check is off or no number threshold applies."""
    router = mem.router
    th = threshold if threshold is not None else mem.threshold
    strict = router.threshold if th is None else float(th)
    if not number_check:
        return strict, strict
    nt = number_threshold if number_threshold is not None else getattr(mem, "number_threshold", None)
    if nt is None and th is None:
        nt = getattr(router, "number_threshold", None)
    return strict, strict if nt is None else min(strict, float(nt))


def recall(mem, query: str, k: int = 5, *, namespace: str | None = None, threshold: float | None = None,
           number_check: bool | str = False, number_threshold: float | None = None, where: dict | None = None,
           refused: list | None = None) -> list[Recalled]:
    """One search at one threshold (`KVMemory.recall`'s docstring; the gates are this module's docstring):
    `route_with_notes` below adds the notes' own threshold."""
    query, where, ns, qvec = _prepared(mem, query, k, namespace, threshold, number_threshold, where, number_check)
    return _search(mem, query, qvec, ns, k, threshold=threshold, number_check=number_check,
                   number_threshold=number_threshold, where=where, refused=refused)


def _prepared(mem, query: str, k: int, namespace: str | None, threshold: float | None,
              number_threshold: float | None, where: dict | None, number_check: object = False):
    """A recall's checked inputs, its namespace made current in the router, and the question embedded
    once (None when the namespace has no index): (query, where, namespace, vector)."""
    if not (isinstance(number_check, bool) or number_check == LIFT):
        raise InvalidInput(f"number_check must be True, False or {LIFT!r}, got {number_check!r}")
    query = check_text("query", query)
    check_count("k", k, maximum=MAX_K)
    check_threshold(threshold)
    check_threshold(number_threshold)
    where = check_where(where)
    ns = check_namespace(namespace or mem.namespace)
    mem.sync_router(ns)
    mem.route_pending(ns)
    router = mem.router
    # The question is embedded once: the router searches with it, and each route is re-scored with it
    # against the entry's own text (a damaged router row or vector is refused, not followed).
    qvec = router.embedder.embed([query])[0] if ns in router.namespaces() else None
    return query, where, ns, qvec


def _search(mem, query: str, qvec, ns: str, k: int, *, threshold: float | None, number_check: bool | str,
            number_threshold: float | None, where: dict | None, refused: list | None) -> list[Recalled]:
    """`recall` for a prepared question (`_prepared`)."""
    router = mem.router
    strict, by_numbers = gates(mem, threshold, number_threshold, number_check)
    out: list[Recalled] = []
    seen: set[str] = set()
    wanted = question_numbers(query) if number_check else frozenset()
    lowered = bool(wanted) and by_numbers < strict
    search_at = by_numbers if lowered else strict
    # Over-fetch when hits may be dropped (other numbers, metadata), so k good ones can still be
    # returned: ask for 4k, then 4x more while the router keeps returning full lists.
    fetch = 4 * k if (wanted or where) else k
    dropped = False
    below = 0
    while True:
        hits = router.search_vector(qvec, fetch, ns, search_at) if qvec is not None else []
        if qvec is None and not seen and ns not in mem._warned_namespaces:
            warn_empty(mem, ns)
        for hit in hits:
            if hit.entry_id in seen:
                continue
            seen.add(hit.entry_id)
            if hit.score < strict:
                below += 1
                if below > MAX_BELOW_THRESHOLD:
                    return out
            job = mem._pending.get(hit.entry_id)
            if job is not None:
                job.run()  # computed on first use (or finished by whoever had started it)
            try:
                entry = mem.store.get_entry(hit.entry_id, ns)
            except UnknownEntry:
                # (only a route that would have been followed: a set-aside entry is named where it would
                # have answered, not for every question near it)
                aside = mem._set_aside(hit.entry_id) if refused is not None and hit.score >= strict else None
                if aside is not None:
                    dropped = True
                    refused.append(refusal(hit.entry_id, f"`kvmemory fsck --repair` set this entry aside ({aside}): "
                                           "it is kept, never served; remember its solution again to serve it"))
                elif mem._lost(hit.entry_id) and refused is not None:
                    dropped = True
                    refused.append(refusal(hit.entry_id, "it is routed and recorded beside its blocks, but the "
                                           "catalogue no longer holds it (a damaged catalogue); run `kvmemory "
                                           "fsck --repair`"))
                continue  # routed but forgotten meanwhile (or its deferred write failed: flush() says why)
            except IntegrityError as exc:  # a damaged or forged catalogue row: refused, not fatal
                dropped = True
                if refused is not None:
                    refused.append(refusal(hit.entry_id, str(exc)))
                continue
            # A route that would have been followed at the usual threshold is checked first, so a damaged
            # router row (one problem's text pointing at another entry) is refused and named, never
            # dropped silently as "other numbers". Below it, the number check comes first: only the same
            # numbers route there, and checking every lowered candidate would cost the entry checks of
            # dozens of entries the numbers already rule out.
            checked = hit.score >= strict
            if checked and not _checked_route(mem, hit, entry, qvec, refused):
                dropped = True
                continue
            if number_check:
                # the entry's own problem, never the router's copy of a text: a near-duplicate with other
                # numbers is another problem (refused unless LIFT); below the threshold only the same
                # numbers route
                found = question_numbers(entry.problem)
                same = bool(wanted) and found == wanted
                if wanted and found and not same and number_check != LIFT:
                    continue
                if hit.score < strict and not same:
                    continue
            if not checked and not _checked_route(mem, hit, entry, qvec, refused):
                dropped = True
                continue
            if where and not matches(user_meta(entry), where):
                continue
            out.append(Recalled(entry=entry, score=float(hit.score), matched_text=hit.matched_text))
            if len(out) == k:
                return out
        if len(hits) < fetch or not (wanted or where or dropped):
            return out
        fetch *= 4


def _checked_route(mem, hit, entry: EntryRecord, qvec, refused: list | None) -> bool:
    """Whether the route and its entry check (memory/entry_check.py); a failure is named in `refused`."""
    why = mem.checks.route(hit, entry, qvec, mem.router.embedder) or mem.checks.entry(entry)
    if why is not None and refused is not None:
        refused.append(refusal(entry.id, why))
    return why is None


def warn_empty(mem, ns: str) -> None:
    """Warn once when `ns` holds no entries while other namespaces do (a misspelt namespace)."""
    counts = mem.namespaces()  # a listing, so asked only when the router holds nothing for `ns`
    others = {n: c for n, c in counts.items() if n != ns}
    if ns in counts:  # it holds entries the router lacks (a read-only router): nothing to warn, ask once
        mem._warned_namespaces.add(ns)
    if ns not in counts and others:
        mem._warned_namespaces.add(ns)
        _log.warning("namespace %r holds no entries, so nothing is recalled; namespaces with entries: %s",
                     ns, ", ".join(f"{n!r} ({c})" for n, c in others.items()))


def route_with_notes(mem, query: str, k: int, *, namespace: str | None, threshold: float | None,
                     number_check: bool, where: dict | None, refused: list | None,
                     number_threshold: float | None = None):
    """What `KVMemory.recall` (and so `answer` and `chat`) routes to: `recall`'s entries at the usual
    threshold, and notes that score at least the note threshold (memory/notes.py `note_threshold`) too,
    best first, at most k. A threshold given here applies to both kinds (one search)."""
    query, where, ns, qvec = _prepared(mem, query, k, namespace, threshold, number_threshold, where, number_check)
    hits = _search(mem, query, qvec, ns, k, threshold=threshold, number_check=number_check,
                   number_threshold=number_threshold, where=where, refused=refused)
    nth = None if threshold is not None else note_threshold(mem)
    if nth is None:
        return hits
    # Entries refused at the lower threshold are notes or would not have been routed: their refusals are
    # logged by recall, not reported (the routed list below decides what the answer used).
    # Solutions scoring between the two thresholds come back too and are dropped below: ask for enough
    # that k notes still fit (NOTE_FETCH more than needed; a namespace with more solutions in that band
    # than that can crowd a note out, a bound that keeps one answer's routing to one search).
    # The same embedded question searched again at the notes' threshold (no second embedding).
    # Searched from the word floor (notes.NOTE_WORD_FLOOR): below the note threshold only the best note,
    # and only when nothing else routed and it shares a content word with the question.
    floor = min(nth, NOTE_WORD_FLOOR)
    low = _search(mem, query, qvec, ns, min(MAX_K, k + len(hits) + NOTE_FETCH), threshold=floor,
                  number_check=number_check, number_threshold=number_threshold, where=where, refused=None)
    have = {h.entry.id for h in hits}
    extra = [h for h in low if is_note(h.entry) and h.entry.id not in have and h.score >= nth]
    if not hits and not extra:
        best = next((h for h in low if is_note(h.entry)), None)
        if best is not None and shares_word(query, best.entry.problem):
            extra = [best]
    if not extra:
        return hits
    return sorted([*hits, *extra], key=lambda h: -h.score)[:k]
