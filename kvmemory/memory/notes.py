"""Facts and notes: statements remembered as they are, and what a chat taught.

A note is an entry whose text is a statement ("Alice has a cat named Tom."), not a problem with a
solution: `KVMemory.note(text)`, or `KVMemory.remember(text)` with no solution. The rule is explicit:
`remember(problem, solution, ...)` verifies the solution and refuses it when the verifier does
(`VerificationFailed`, as always); only a call that gives *no solution at all* (solution=None) stores a
note. A failed verification is never turned into a note.

What a note is, stored: problem = the statement, solution = "" (the model reads the statement as a user
turn and an empty assistant turn), answer None, verifier {"name": "note", "ok": false} and so
`verified=False`. Its KV is computed, written and its graft proven exactly as a solution's (the same
`writes.compute_kv`), it is routed by its statement (and aliases) and grafted like any entry. `kind_of(entry)`
is "note" for it ("solution" otherwise); listings (`KVMemory.list`, `kvmemory list`, GET
/v1/memory/entries), recalled entries (`Recalled.to_json`, adapters' metadata) and answers
(`Answer.kinds`) say which kind each entry is.

Routing notes. A question about a fact ("What pet does Alice have?") scores lower against the statement
("Alice has a cat named Tom.") than a rewording scores against a problem: with all-MiniLM-L6-v2, 24
fact/question pairs (bench/notes_routing.py) scored 0.546-0.897 (22 of 24 below the 0.83 that routes
solutions), and the best other fact scored 0.109-0.649 against each question (23 of 24 below 0.54;
generic questions at most 0.35). So notes route with a lower threshold of their own (`NOTE_THRESHOLDS`,
by the embedder's weights; 0.54 for MiniLM), and solutions with the usual one, wherever a question is
routed: `recall` and everything built on it (`kvmemory recall`, HTTP /v1/memory/recall, the MCP recall
tool, the LangChain and LlamaIndex retrievers), `answer` and `chat`. An embedder without a measured note
threshold routes notes with the usual threshold, and a threshold the caller gives (to the call or to
`KVMemory(threshold=...)`) applies to both kinds.

`KVMemory.add(messages)`: what a chat taught, by a fixed rule (no model involved), returned as an
`AddResult`:
  * notes: from each user message that asks nothing (no sentence of it is a question or request: a
    message that asks is a question, and its statements are the question's premises), every sentence
    that states something. Sentences are split at ".", "!", "?" followed by a space, and at line
    breaks; a leading "remember that", "please note that", "fyi" ... is dropped first ("Please remember
    that Alice likes tea." keeps "Alice likes tea."); a sentence is kept when it does not end with "?",
    has at least 2 words, and does not start with a question word or auxiliary ("what", "is", "do",
    "can" ...), a request ("please", "tell", "write", "explain" ...) or small talk ("hi", "thanks",
    "ok" ...). Assistant messages are never taken as facts: only what the user said.
  * solutions: a user message that asks something, followed by an assistant reply, is remembered as
    (problem, solution, answer) only when the verifier accepts it (default "arithmetic"; an assistant
    message may carry its expected answer as "answer"); a refused pair is listed in `skipped` with the
    verifier's reason, never stored, and never made a note (nor are its statements).
A note already stored (same namespace and text) is returned as it is, not computed again, so `add` may be
called with the whole chat after every turn.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmemory.errors import InvalidInput, UnknownEntry, VerificationFailed
from kvmemory.memory import writes
from kvmemory.memory.ids import entry_id_for
from kvmemory.memory.inputs import check_namespace, check_text
from kvmemory.memory.listing import user_meta
from kvmemory.memory.verifiers import NoteVerifier, is_note, kind_of

NOTE = "note"
SOLUTION = "solution"
# How an adapter shows a recalled note as text (a solution's is facade.TEXT_TEMPLATE).
NOTE_TEMPLATE = "{problem}"
NOTE_SOLUTION = ""  # what the model reads as the assistant's turn after a note's statement
NOTE_FETCH = 16  # extra candidates the notes' routing pass asks for (routing.route_with_notes)

# all-MiniLM-L6-v2 (weights SHA-256, as embedders.CALIBRATED_THRESHOLDS): the threshold notes are routed
# with by `answer` and `chat`; measured with bench/notes_routing.py (module docstring).
NOTE_THRESHOLDS: dict[str, float] = {
    "7e54b3bcd8c7bda9db9a2e9fd628eb4b5898c0f92beb31ee98c10af5034306d8": 0.54,
}


# ---------------------------------------------------------------------------------------------- storing
def plan(mem, text: str, answer, verifier, namespace: str, meta: dict, aliases: list[str]) -> dict:
    """What `KVMemory._plan` returns, for a note: the checked text, the note's verdict, the id
    (`namespace`, `meta` and `aliases` come checked by the facade)."""
    text = check_text("problem", text)
    if answer is not None:
        raise InvalidInput("a note (remember without a solution) has no answer: give the solution that "
                           "concludes it, or leave answer out to store the statement as a note")
    if verifier is not None and not (isinstance(verifier, str) and verifier == NoteVerifier.name):
        raise InvalidInput("a verifier checks a solution, and none was given: give the solution, or leave "
                           "verifier out to store the statement as an unverified note")
    v = NoteVerifier()
    result = v(text, NOTE_SOLUTION, None)
    verdict = {"name": v.name, "version": v.version, "ok": bool(result.ok), "detail": result.detail}
    eid = entry_id_for(namespace, text, NOTE_SOLUTION, None, mem.engine.profile_id)
    return {"id": eid, "namespace": namespace, "problem": text, "solution": NOTE_SOLUTION, "answer": None,
            "verdict": verdict, "meta": meta, "aliases": aliases}


def commit(mem, p: dict):
    """Store a note planned by `KVMemory._plan` (KV computed and its graft proven as `remember` does)
    and route it; a note already stored with the same text, metadata and aliases is returned as it is."""
    try:
        cur = mem.store.get_entry(p["id"], p["namespace"])
    except UnknownEntry:
        cur = None
    if (cur is not None and is_note(cur) and (cur.problem, cur.solution, cur.answer) == (p["problem"], p["solution"], None)
            and user_meta(cur) == p["meta"] and list(cur.meta.get("aliases") or ()) == p["aliases"]):
        return cur
    entry = writes.compute_and_commit(mem, p)
    mem._after_remember(entry)
    return entry


# ---------------------------------------------------------------------------------------------- routing
def note_threshold(mem) -> float | None:
    """The threshold `answer` and `chat` route notes with: the embedder's measured one, unless a threshold
    was given to the memory (then that one), or none was measured (then the router's). None: no separate
    threshold (notes route as solutions do)."""
    if mem.threshold is not None:
        return None
    router = mem.router
    if getattr(router, "_explicit_threshold", False):
        return None
    emb = router.embedder
    try:
        from kvmemory.routing.embedders import weights_fingerprint

        sha = weights_fingerprint(emb.path, emb.weight_files())
    except Exception:  # an embedder without weight files on disk (a test double, a remote one)
        return None
    th = NOTE_THRESHOLDS.get(sha)
    return th if th is not None and th < router.threshold else None


# A question about a fact the user told ("What is my son called?") can score well below the note
# threshold against its statement ("My son Leo started school this year.": 0.32 with MiniLM) while it is
# still the best note. Below the threshold, the best note routes from this floor when the question and
# the statement share a content word (`shares_word`) and both speak in the first person ("my son" ...),
# or the shared word is a name the statement capitalises. Measured on bench/data/facts.json "tuning"
# (bench/facts.py): generic questions score at most 0.32 against any note there, and share no word.
NOTE_WORD_FLOOR = 0.30
_STOP = frozenset(
    "a an the of to in on at for from by with about into as and or but not no this that these those it its "
    "i me my mine we us our ours you your yours he him his she her they them their there here "
    "name named called call do does did is are was were be been am have has had get got go goes make "
    "what who whom whose where when why how which any some many much more most very every each one".split())
_FIRST_PERSON = frozenset("i me my mine we us our ours myself".split())


def _words(text: str) -> list[str]:
    return [w.lower().replace("’", "'") for w in _WORD.findall(text or "")]


def _stem(w: str) -> str:
    if w.endswith("'s"):
        w = w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
        w = w[:-1]
    return w


def shares_word(question: str, statement: str) -> bool:
    """Whether a question below the note threshold may route to its best note (`NOTE_WORD_FLOOR`): they
    share a content word (lower-cased, "'s" and a plural "s" dropped, stop words left out), and both are
    in the first person, or the shared word is capitalised in the statement (a name)."""
    q = {_stem(w) for w in _words(question)} - _STOP
    caps = {_stem(m.group(0).lower()) for m in _WORD.finditer(statement or "")
            if m.group(0)[:1].isupper() and m.start() > 0}
    st = {_stem(w) for w in _words(statement)} - _STOP
    shared = q & st
    if not shared:
        return False
    first = bool(set(_words(question)) & _FIRST_PERSON) and bool(set(_words(statement)) & _FIRST_PERSON)
    return first or bool(shared & caps)


# ---------------------------------------------------------------------------------------------- chats
_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[A-Za-z0-9'’]+")
_QUESTION_START = frozenset(
    "what who whom whose where when why how which is are was were am do does did can could would will shall "
    "should may might must have has had isn't aren't wasn't weren't don't doesn't didn't can't couldn't "
    "won't wouldn't shouldn't haven't hasn't".split())
_REQUEST_START = frozenset(
    "please tell give show write explain list help calculate compute solve find summarize summarise translate "
    "describe make create generate suggest recommend let let's lets draft add fix check convert".split())
_SMALL_TALK = frozenset("hi hello hey thanks thank ok okay yes no yeah yep nope sure great cool bye goodbye "
                        "good nice wow hmm oh sounds got perfect awesome alright right exactly indeed agreed "
                        "cheers welcome sorry".split())
_LEAD_INS = ("remember that ", "remember: ", "remember, ", "note that ", "note: ", "please note that ",
             "please remember that ", "fyi ", "fyi: ", "fyi, ", "for the record, ", "for the record ",
             "just so you know, ", "just so you know ")


def sentences(text: str) -> list[str]:
    """`text` split into sentences (at ". ", "! ", "? " and line breaks), stripped, empty ones dropped."""
    return [s.strip() for s in _SPLIT.split(text or "") if s and s.strip()]


def _first_word(s: str) -> str:
    m = _WORD.search(s)
    return m.group(0).lower().replace("’", "'") if m else ""


def asks(sentence: str) -> bool:
    """A question or a request: ends with "?", or starts with a question word, auxiliary or request verb."""
    s = sentence.strip()
    w = _first_word(s)
    return s.endswith("?") or w in _QUESTION_START or w in _REQUEST_START


def _without_lead_in(sentence: str) -> str:
    s = sentence.strip()
    low = s.lower()
    for lead in _LEAD_INS:
        if low.startswith(lead):
            s = s[len(lead):].strip()
            return s[:1].upper() + s[1:]
    return s


def message_asks(text: str) -> bool:
    """Whether a message asks something: one of its sentences (lead-ins dropped) is a question or request."""
    return any(asks(_without_lead_in(s)) for s in sentences(text))


def statement(sentence: str) -> str | None:
    """The fact a user's sentence states (lead-ins such as "remember that" dropped), or None when it
    is a question, a request, small talk or a single word (module docstring)."""
    s = _without_lead_in(sentence)
    if not s or asks(s) or _first_word(s) in _SMALL_TALK or len(_WORD.findall(s)) < 2:
        return None
    return s


def facts_in(text: str) -> list[str]:
    """The statements of one user message, in order, each once."""
    return list(dict.fromkeys(f for f in (statement(s) for s in sentences(text)) if f))


@dataclass(slots=True)
class AddResult:
    """What `KVMemory.add(messages)` kept: `notes` (the user's statements), `solutions` (verified Q/A
    pairs), and `skipped`: each {"problem", "solution", "answer", "reason"} for a pair the verifier
    refused (not stored)."""

    notes: list = field(default_factory=list)
    solutions: list = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)

    @property
    def entries(self) -> list:
        return [*self.notes, *self.solutions]

    def to_json(self) -> dict:
        def brief(e) -> dict:
            return {"id": e.id, "namespace": e.namespace, "kind": kind_of(e), "problem": e.problem,
                    "verified": e.verified, "n_tokens": len(e.token_ids), "n_blocks": len(e.chain)}

        return {"notes": [brief(e) for e in self.notes], "solutions": [brief(e) for e in self.solutions],
                "skipped": list(self.skipped)}


def _messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidInput("messages must be a list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
            raise InvalidInput(f"message {i} must be a dict with a string 'role' and a string 'content', got {m!r:.80}")
        answer = m.get("answer")
        if answer is not None and not isinstance(answer, (str, int, float)):
            raise InvalidInput(f"message {i}'s answer must be a string or a number, got {answer!r:.80}")
        out.append({"role": m["role"], "content": m.get("content") or "",
                    "answer": None if answer is None else str(answer)})
    return out


def add(mem, messages, *, namespace: str | None = None, meta: dict | None = None, verifier: str = "arithmetic",
        facts: bool = True, pairs: bool = True) -> AddResult:
    """`KVMemory.add`: keep what a chat taught (module docstring)."""
    msgs = _messages(messages)
    namespace = check_namespace(namespace or mem.namespace)  # checked before anything is stored
    if not isinstance(verifier, str) or verifier == NoteVerifier.name:
        raise InvalidInput(f"verifier must be the name of a solution verifier (arithmetic, exact-answer), got {verifier!r}")
    out = AddResult()
    seen: set[str] = set()
    for i, m in enumerate(msgs):
        if m["role"] != "user" or not m["content"].strip():
            continue
        if not message_asks(m["content"]):  # a message that states: its facts are notes
            for fact in facts_in(m["content"]) if facts else ():
                if fact not in seen:
                    seen.add(fact)
                    out.notes.append(commit(mem, mem._plan(fact, None, None, None, namespace, False, meta, ())))
            continue
        reply = msgs[i + 1] if i + 1 < len(msgs) else None
        if not pairs or reply is None or reply["role"] != "assistant" or not reply["content"].strip():
            continue
        problem, solution, answer = m["content"].strip(), reply["content"].strip(), reply["answer"]
        refused = {"problem": problem, "solution": solution, "answer": answer}
        try:  # texts over the limits are skipped with the reason, as a refused pair is
            check_text("problem", problem), check_text("solution", solution)
            check_text("answer", answer, required=False)
        except InvalidInput as exc:
            out.skipped.append({**refused, "reason": str(exc)})
            continue
        try:
            out.solutions.append(mem.remember(problem, solution, answer, verifier=verifier, namespace=namespace,
                                              meta=meta))
        except VerificationFailed as exc:
            out.skipped.append({**refused, "reason": str(exc)})
    return out


__all__ = ["NOTE", "NOTE_TEMPLATE", "NOTE_THRESHOLDS", "NOTE_WORD_FLOOR", "shares_word", "SOLUTION", "AddResult", "add", "asks", "facts_in", "is_note",
           "kind_of", "message_asks", "note_threshold", "plan", "commit", "sentences", "statement"]
