"""fsck for a Redis store that Redis lost (FLUSHALL, a restart without persistence, another server at the
same address) while its local read-through tier still holds entries and blocks: RedisStore notices it by
its generation (redis_store.py, `RedisStore.wiped`), `fsck` names it (`redis_wiped`, exit 4) and
`fsck --repair` restores every entry the tier holds whole.

Restoring is a new commit of each entry, signed again with the master key: so each one is checked first
as an answer would check it -- its chain is the chain of its own token ids, `entry_check` (the memory
layer: its texts re-tokenize to its ids) passes, and every chain block is read from the tier verified
(header, chain hash, payload SHA-256). An entry that fails, or whose blocks the tier never cached, is
named (`entries_lost`) and left out; the store then gets a new generation.
"""

from __future__ import annotations

import json

import torch

from kvmemory.errors import KVMemoryError
from kvmemory.store.fsck_common import EntryCheck, FsckReport
from kvmemory.store.fsck_records import chunk_for, self_problem


def report_wiped(rep: FsckReport, store) -> None:
    """Check-only: the loss is named, nothing is changed."""
    rep.catalogue = f"lost: {store.wiped}"
    rep.problem("redis_wiped", store.name, f"{store.wiped}; run `kvmemory fsck --repair` to restore the entries "
                "from the local tier", fixed=False)


def restore_from_tier(rep: FsckReport, store, entry_check: EntryCheck | None) -> None:
    """Commit again into Redis every entry the local tier holds whole (see the module docstring)."""
    signer = getattr(store, "signer", None)
    if signer is not None and signer.scope is not None:
        rep.problem("redis_wiped", store.name, f"{store.wiped}; restoring needs the master key (this one holds "
                    f"namespace {signer.scope!r})", fixed=False)
        return
    tier = store._tier
    for pid, body in tier._q("SELECT profile_id, profile_json FROM profiles"):
        try:
            store.put_profile(pid, json.loads(body))
        except (ValueError, TypeError, KVMemoryError):
            pass
    restored = 0
    for (eid,) in tier._q("SELECT id FROM entries ORDER BY created, id"):
        try:
            entry = tier.get_entry(eid)
        except KVMemoryError as exc:
            rep.problem("entries_lost", str(eid), f"its local tier copy is unreadable ({exc})", fixed=False)
            continue
        _, why = self_problem(entry, chunk_for(tier, entry), entry_check)
        if why is None:
            blocks, why = _tier_blocks(tier, entry)
        if why is not None:
            rep.problem("entries_lost", eid, f"Redis lost it and its local tier copy cannot be restored: {why}",
                        fixed=False)
            continue
        store.commit_entry(entry, blocks)
        restored += 1
        rep.problem("entries_restored", eid, "Redis lost it; restored from the local tier (checked, signed again)",
                    fixed=True)
    rep.problem("redis_wiped", store.name, f"{store.wiped}; {restored} entries restored from the local tier",
                fixed=True)
    store.new_generation()


def _tier_blocks(tier, entry) -> tuple[list, str | None]:
    blocks = []
    for i, h in enumerate(entry.chain):
        row = tier.get_block(h)
        if row is None or row.quarantined:
            return [], f"block {i} of its chain ({h[:12]}) is not in the local tier"
        try:
            meta, payload = tier.read_block(row)
        except KVMemoryError as exc:
            return [], f"block {i} of its chain does not check ({exc})"
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if row.payload_nbytes else \
            torch.empty(0, dtype=torch.uint8)
        blocks.append((meta, data))
    return blocks, None


__all__ = ["report_wiped", "restore_from_tier"]
