"""An entry is checked against itself before an answer uses it, and a route against the entry it names.

    checks = EntryChecks(engine)
    why = checks.entry(entry)                  # None, or why the entry does not check against itself
    why = checks.route(hit, entry, query_vec, embedder)   # None, or why this route to it cannot be trusted

An entry checks against itself when
- its texts, rendered as `remember` renders them (memory/prompts.py), re-tokenize to its stored token
  ids: a problem, solution or answer edited in the catalogue after its KV was computed is caught;
- its token ids hash to its chain (store/blocks.py `is_entry_chain`): ids or chain edited are caught;
- its id is the hash of its namespace, first version's texts and profile (memory/ids.py), so an
  entry moved to another namespace, or whose texts and ids were replaced together, is caught.
The blocks themselves are verified when they are read (payload SHA-256, header chain hash). An entry
made under another profile is not judged here: the engine refuses it (`ProfileMismatch`).

A route checks when the text the router matched is one of the entry's own texts (its problem or an
alias) and the entry's own text, embedded here, scores the question as the router's vector did
(within `SCORE_TOLERANCE`): a router row whose entry id was changed, or a vector that no longer is its
text's, would otherwise send the question to another entry's KV.

Cost: the verdict is cached in memory per (entry id, updated time, SHA-256 of everything checked), so
an entry is tokenized once per process and version; the texts' embeddings are cached by their SHA-256.
`stats` counts checks, cache hits and the seconds spent (BENCHMARKS.md, "Reliability", measures them
per answer). Nothing is written: a refused entry is named in the answer (`Answer.refused`) and logged;
`kvmemory fsck` finds it and `fsck --repair` puts it right.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from kvmemory.memory.ids import expected_id, first_version
from kvmemory.memory.prompts import entry_messages, render_ids
from kvmemory.store.blocks import ids_bytes, is_entry_chain
from kvmemory.store.local import EntryRecord

_log = logging.getLogger("kvmemory.memory")
MAX_CACHED = 65536
# Cosine scores of one text embedded alone or in a batch agree to ~1e-6; a vector that belongs to
# another text is off by far more (another problem scores < 0.9 against the question).
SCORE_TOLERANCE = 0.01
FIX = "run `kvmemory fsck --repair`"


def _digest(entry: EntryRecord) -> str:
    """SHA-256 over everything `EntryChecks.entry` reads, so a cached verdict is reused only for the same bytes."""
    h = hashlib.sha256()
    for part in (entry.id, entry.namespace, entry.profile_id, entry.problem, entry.solution, entry.answer,
                 ",".join(entry.chain), *first_version(entry)):
        data = ("\x00" if part is None else "\x01" + str(part)).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little") + data)
    h.update(ids_bytes(entry.token_ids))
    return h.hexdigest()


class EntryChecks:
    """The checks of the module docstring, for one engine (its tokenizer, profile and chunk grid)."""

    def __init__(self, engine, max_cached: int = MAX_CACHED):
        self.engine = engine
        self.max_cached = max_cached
        self._verdicts: OrderedDict[tuple, str | None] = OrderedDict()
        self._vectors: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"entries_checked": 0, "entries_cached": 0, "routes_checked": 0, "texts_embedded": 0,
                      "seconds": 0.0}

    # ------------------------------------------------------------------ the entry against itself
    def entry(self, entry: EntryRecord) -> str | None:
        """Why `entry` does not check against itself (see the module docstring), or None."""
        t0 = time.perf_counter()
        key = (entry.id, entry.updated, _digest(entry))
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                self.stats["entries_cached"] += 1
                self.stats["seconds"] += time.perf_counter() - t0
                return self._verdicts[key]
        why = self._check(entry)
        with self._lock:
            self._verdicts[key] = why
            while len(self._verdicts) > self.max_cached:
                self._verdicts.popitem(last=False)
            self.stats["entries_checked"] += 1
            self.stats["seconds"] += time.perf_counter() - t0
        if why is not None:
            _log.warning("entry %s does not check against itself and is refused: %s", entry.id, why)
        return why

    def _check(self, entry: EntryRecord) -> str | None:
        eng = self.engine
        if entry.profile_id != eng.profile_id:
            return None  # another profile: the engine refuses it by name (ProfileMismatch)
        try:
            ids = render_ids(eng.tokenizer, entry_messages(entry.problem, entry.solution, entry.answer))
        except Exception as exc:  # noqa: BLE001 - texts the tokenizer cannot render are damage too
            return f"its texts cannot be rendered ({type(exc).__name__}: {exc}); {FIX}"
        if list(ids) != list(entry.token_ids):
            n = next((i for i, (a, b) in enumerate(zip(ids, entry.token_ids)) if a != b), min(len(ids), len(entry.token_ids)))
            return (f"its texts do not re-tokenize to its stored token ids (they differ from token {n} of "
                    f"{len(entry.token_ids)}): its problem, solution or answer was changed after its KV was computed; {FIX}")
        if not is_entry_chain(entry.chain, entry.profile_id, entry.token_ids, eng.chunk):
            return f"its token ids do not hash to its chain of blocks (its chain was changed); {FIX}"
        if expected_id(entry) != entry.id:
            return (f"its id is not the hash of its namespace ({entry.namespace!r}), first version's texts and "
                    f"profile: the entry was moved to another namespace or its texts replaced; {FIX}")
        return None

    # ------------------------------------------------------------------ a route against its entry
    def route(self, hit, entry: EntryRecord, query_vec: np.ndarray | None, embedder) -> str | None:
        """Why the router's `hit` (a RouteHit) to `entry` cannot be trusted, or None. `query_vec`: the
        question's embedding the router searched with (None: only the text is checked)."""
        t0 = time.perf_counter()
        try:
            aliases = entry.meta.get("aliases", []) if isinstance(entry.meta, dict) else []
            own = [entry.problem, *(a for a in aliases if isinstance(a, str))]
            if hit.matched_text not in own:
                why = (f"the router matched it by a text that is not its own ({hit.matched_text[:60]!r}): the router "
                       f"is damaged and would answer from the wrong entry; {FIX}")
                _log.warning("route to entry %s refused: %s", entry.id, why)
                return why
            if query_vec is None or embedder is None:
                return None
            vec = self._vector(embedder, hit.matched_text)
            score = float(np.dot(np.asarray(query_vec, dtype=np.float32).ravel(), vec))
            if abs(score - float(hit.score)) > SCORE_TOLERANCE:
                why = (f"its own text scores the question {score:.3f}, the router's vector {float(hit.score):.3f}: "
                       f"the router index is damaged; {FIX}")
                _log.warning("route to entry %s refused: %s", entry.id, why)
                return why
            return None
        finally:
            with self._lock:
                self.stats["routes_checked"] += 1
                self.stats["seconds"] += time.perf_counter() - t0

    def _vector(self, embedder, text: str) -> np.ndarray:
        # by embedder object (a reindex with another embedder makes another object) and text
        key = (id(embedder), hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
        with self._lock:
            v = self._vectors.get(key)
            if v is not None:
                self._vectors.move_to_end(key)
                return v
        v = np.asarray(embedder.embed([text])[0], dtype=np.float32)
        with self._lock:
            self._vectors[key] = v
            self.stats["texts_embedded"] += 1
            while len(self._vectors) > self.max_cached:
                self._vectors.popitem(last=False)
        return v


def refusal(entry_id: str, reason: str) -> dict:
    """How an answer names an entry it refused (`Answer.refused`)."""
    return {"entry": entry_id, "reason": reason}


__all__ = ["EntryChecks", "refusal", "SCORE_TOLERANCE"]
