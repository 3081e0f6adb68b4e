"""Entry ids: a content hash of what an entry is, so the same solution under the same profile has the
same id on every machine (remembering it twice, or importing it twice, adds nothing)."""

from __future__ import annotations

import hashlib

from kvmemory.engine.profile import canonical_json


def entry_id_for(namespace: str, problem: str, solution: str, answer: str | None, profile_id: str) -> str:
    """"e" + the first 15 hex digits of SHA-256 over the canonical JSON of (namespace, problem,
    solution, answer, profile_id)."""
    body = canonical_json([namespace, problem, solution, answer, profile_id])
    return "e" + hashlib.sha256(body.encode()).hexdigest()[:15]


def first_version(entry) -> tuple[str, str, str | None]:
    """The texts an entry was first remembered with (its id hashes these): the oldest version that
    `update` kept in `meta["history"]`, else its current texts."""
    history = entry.meta.get("history") if isinstance(entry.meta, dict) else None
    if history and isinstance(history, list) and isinstance(history[0], dict):
        h = history[0]
        return h.get("problem"), h.get("solution"), h.get("answer")
    return entry.problem, entry.solution, entry.answer


def expected_id(entry) -> str | None:
    """The id an entry must have: the hash of its namespace, first version's texts and profile (None
    when the first version cannot be read)."""
    problem, solution, answer = first_version(entry)
    if not isinstance(problem, str) or not isinstance(solution, str) or not (answer is None or isinstance(answer, str)):
        return None
    return entry_id_for(entry.namespace, problem, solution, answer, entry.profile_id)
