"""The entry as stored (`EntryRecord`) and its type-checked reading from stored fields: what the
catalogue, the entry records (records.py), bundles and Redis all build entries with."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmemory.errors import IntegrityError


@dataclass(slots=True, frozen=True)
class EntryRecord:
    """A verified solution as stored: texts, verifier outcome, prompt token ids, chain, attestation."""

    id: str
    namespace: str
    problem: str
    solution: str
    answer: str | None
    verifier: dict
    verified: bool
    token_ids: tuple[int, ...]
    profile_id: str
    chain: tuple[str, ...]
    attestation: dict
    meta: dict
    created: float
    updated: float

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "namespace": self.namespace,
            "problem": self.problem,
            "solution": self.solution,
            "answer": self.answer,
            "verifier": self.verifier,
            "verified": self.verified,
            "n_tokens": len(self.token_ids),
            "profile_id": self.profile_id,
            "chain": list(self.chain),
            "attestation": self.attestation,
            "meta": self.meta,
            "created": self.created,
            "updated": self.updated,
        }


def _ids_from_blob(blob: bytes) -> tuple[int, ...]:
    if not isinstance(blob, bytes) or len(blob) % 4:
        raise ValueError("token ids are not a whole number of little-endian uint32")
    return tuple(int(x) for x in np.frombuffer(blob, dtype="<u4"))


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _is_hex64(x: object) -> bool:
    return isinstance(x, str) and _HEX64.fullmatch(x) is not None


def entry_from_fields(row: Sequence, chain: Sequence[str]) -> EntryRecord:
    """An EntryRecord from catalogue values (the order of `LocalStore._ENTRY_COLS`), type-checked."""
    try:
        (eid, ns, problem, solution, answer, verifier, verified, ids, profile, att, meta, created, updated) = row
        rec = EntryRecord(
            id=eid, namespace=ns, problem=problem, solution=solution, answer=answer,
            verifier=json.loads(verifier), verified=bool(verified), token_ids=_ids_from_blob(ids),
            profile_id=profile, chain=tuple(chain), attestation=json.loads(att), meta=json.loads(meta),
            created=float(created), updated=float(updated),
        )
        if not (all(isinstance(x, str) for x in (eid, ns, problem, solution, profile))
                and (answer is None or isinstance(answer, str)) and isinstance(verified, int)
                and all(isinstance(x, dict) for x in (rec.verifier, rec.attestation, rec.meta))
                and all(_is_hex64(h) for h in rec.chain)):
            raise ValueError("a field has the wrong type")
        return rec
    except (TypeError, ValueError) as exc:
        name = row[0] if row and isinstance(row[0], str) else "?"
        raise IntegrityError(f"the catalogue row of entry {name!r} is damaged ({exc}); run `kvmemory fsck`") from exc
