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
