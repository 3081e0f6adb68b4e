"""Proving entries (`KVMemory.verify`) and making damaged ones provable again (`KVMemory.recompute`).

`verify` recomputes each entry from scratch and compares the logits with a graft of its stored blocks
(SHA-256 of the logits bytes, KL, argmax) and with its attestation. An entry counts as bit-identical
only when that comparison proves something:
- the entry checks against itself first (memory/entry_check.py: texts -> token ids -> chain); one
  that does not is reported, never compared;
- something was grafted: a graft of nothing (graft point 0: an entry whose first block is gone)
  compares a recompute with itself and proves nothing;
- its whole chain was grafted: a chain cut short by missing or quarantined blocks proves only a part.
Such entries are counted `unproven`, with the reason, and `kvmemory verify` exits 1.

`recompute` computes an entry's blocks again from its own texts (which must re-tokenize to its token
ids), proves the graft bit-identical as `remember` does, and commits them with a new attestation:
what `kvmemory fsck --repair` runs for entries whose blocks were damaged, lost or quarantined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmemory.errors import KVMemoryError
from kvmemory.memory import writes
from kvmemory.memory.layout import entry_probe
from kvmemory.store.local import EntryRecord


@dataclass(slots=True)
class VerifySummary:
    checked: int = 0
    bit_identical: int = 0  # proven: the whole chain grafted, logits equal to the recompute's
    unproven: int = 0  # nothing (or not all) grafted, or the entry does not check against itself
    kl_max: float = 0.0
    argmax_agreement: float = 1.0
    attested_match: int = 0
    results: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "checked": self.checked,
            "bit_identical": self.bit_identical,
            "unproven": self.unproven,
            "kl_max": self.kl_max,
            "argmax_agreement": self.argmax_agreement,
            "attestation_match": self.attested_match,
            "entries": self.results,
        }


def expected_graft(entry: EntryRecord, chunk: int) -> int:
    """Tokens a graft of the entry's whole chain covers: all its tokens (its last block is a tail block
    cut at its end), or for an entry made before cuts, its whole grid blocks."""
    return min(len(entry.chain) * chunk, len(entry.token_ids))


def unproven_reason(entry: EntryRecord, graft_point: int, chunk: int) -> str | None:
    """Why a verify run that grafted `graft_point` tokens proves nothing (or not all) of `entry`."""
    want = expected_graft(entry, chunk)
    if graft_point == 0:
        if want == 0:
            return (f"nothing was grafted: the entry ({len(entry.token_ids)} tokens) has no stored blocks, so a "
                    "graft of it compares the recompute with itself")
        return ("nothing was grafted: its first block is missing, damaged or quarantined; "
                "run `kvmemory fsck --repair` (it recomputes and re-proves the entry)")
    if graft_point < want:
        return (f"only {graft_point} of its {want} stored tokens were grafted (blocks missing, damaged or "
                "quarantined); run `kvmemory fsck --repair` (it recomputes and re-proves the entry)")
    return None


def verify(mem, entry_ids: Sequence[str] | None = None, *, namespace: str | None = None, single_pass: bool = True,
           progress: bool = False) -> VerifySummary:
    """Recompute each entry from scratch and compare it with its graft and its attestation (see the
    module docstring for what counts as proven)."""
    ids = list(entry_ids) if entry_ids is not None else mem.store.entry_ids(namespace)
    summary = VerifySummary()
    it = ids
    if progress:
        from tqdm import tqdm

        it = tqdm(ids, desc="verify", unit="entry")
    chunk = mem.engine.chunk
    for eid in it:
        entry = mem.store.get_entry(eid)
        summary.checked += 1
        why = mem.checks.entry(entry)
        if why is not None:
            summary.unproven += 1
            summary.results.append({"entry": eid, "proven": False, "unproven_reason": why, "bit_identical": False,
                                    "attestation_match": False, "graft_point": 0, "tokens": len(entry.token_ids),
                                    "positions": 0, "single_pass_max_abs_diff": None})
            continue
        vr = verify_entry(mem, eid, single_pass=single_pass)
        c = vr.comparison
        attested = (entry.attestation.get("logits_sha256") == c.reference_sha256
                    and entry.attestation.get("graft_point") == vr.graft_point)
        reason = unproven_reason(entry, vr.graft_point, chunk)
        summary.bit_identical += int(c.bit_identical and reason is None)
        summary.unproven += int(reason is not None)
        summary.kl_max = max(summary.kl_max, c.kl_max)
        summary.argmax_agreement = min(summary.argmax_agreement, c.argmax_agreement)
        summary.attested_match += int(attested)
        summary.results.append({"entry": eid, "attestation_match": attested, **vr.to_json(),
                                "proven": reason is None, "unproven_reason": reason})
    return summary


def verify_entry(mem, entry_id: str, *, decode_tokens: int | None = None, single_pass: bool = True,
                 namespace: str | None = None):
    """The VerifyReport of one entry (graft vs recompute), without the proof bookkeeping of `verify`."""
    entry = mem.store.get_entry(entry_id, namespace)
    mem.engine.require_profile(entry.profile_id, f"entry {entry.id}'s blocks")
    k = decode_tokens if decode_tokens is not None else int(entry.attestation.get("decode_tokens", mem.probe_tokens))
    # What `remember` proved: the entry's ids and the probe question, cut at the entry's end (layout.py)
    probe = entry_probe(mem.engine.tokenizer, entry.token_ids, entry.problem, entry.solution, entry.answer)
    return mem.engine.verify_tokens(probe.ids, decode_tokens=k, single_pass=single_pass, cuts=probe.cuts)


def recompute(mem, entry_ids: Sequence[str]) -> dict[str, str | None]:
    """Compute the blocks of each entry again from its own texts, prove the graft, commit them with a
    new attestation. Returns, per entry, None (re-proven) or why it could not be."""
    out: dict[str, str | None] = {}
    eng = mem.engine
    for eid in entry_ids:
        try:
            entry = mem.store.get_entry(eid)
            why = mem.checks.entry(entry)
            if why is not None:
                out[eid] = why
                continue
            if entry.profile_id != eng.profile_id:
                out[eid] = (f"it was made under another execution profile ({entry.profile_id[:12]}); recompute it "
                            "with that profile, or remember it again under this one")
                continue
            ids, blocks, attestation = writes.compute_kv(mem, entry.problem, entry.solution, entry.answer)
            if tuple(ids) != tuple(entry.token_ids):
                out[eid] = "its texts no longer render to its token ids under this tokenizer"
                continue
            # the chain as `remember` makes it now (an entry made before cuts gains its tail block)
            chain = tuple(m.hash for m, _ in blocks)
            mem.store.commit_entry(dataclasses.replace(entry, attestation=attestation, chain=chain), blocks)
            out[eid] = None
        except KVMemoryError as exc:
            out[eid] = f"{type(exc).__name__}: {exc}"
    return out


__all__ = ["VerifySummary", "verify", "verify_entry", "recompute", "unproven_reason", "expected_graft"]
