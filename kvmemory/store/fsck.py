"""`kvmemory fsck`: check a store from end to end, and with `repair=True` put it back in order.

    report = run_fsck(store, repair=False)                       # check only: nothing is changed
    report = run_fsck(store, repair=True, router_rebuild=router_rebuilder(store))   # kvmemory.routing.router; or mem.reindex
    report = fsck_at("./my-store", repair=True)                  # also a store whose catalogue is lost
    print(report.summary()); json.dumps(report.to_json()); sys.exit(report.exit_code)

What is checked (LocalStore, SignedLocalStore and RedisStore alike):
- the catalogue itself: SQLite `PRAGMA integrity_check` (local); index sets against the keys they
  index (Redis); every row parsed and type-checked; a local catalogue that is missing or empty while
  entry records or blocks are there (the store then refuses every other command: `CatalogueLost`);
- every entry against its record (store/records.py: a second copy beside the blocks, with its own
  SHA-256): a row that differs from its record, a missing or damaged record, a record whose row is
  gone, a forget that was interrupted;
- every block: its file (or Redis payload) read whole and checked as a graft would check it --
  canonical header, header against the catalogue row, payload size, payload SHA-256 -- plus, in signed
  stores opened with the master key, that some namespace signed the row;
- orphans: block files or payloads no row names, and stale `tmp/` files of dead writers;
- every entry: readable, signed (signed stores), its chain the chain of its own token ids, what
  `entry_check` (the memory layer: its texts re-tokenize to its token ids) says, and whether its chain
  references blocks that are missing, quarantined or damaged;
- the router, when `router_check` is given (routing/check.py: every routed row names an entry of its
  namespace by one of that entry's own texts, and every entry is routed; `router_checker(vectors=True)`
  also re-embeds every routed text against its vector and the index's dimension against the manifest);
- profile files (profiles/<id>.json) against their names;
- a Redis store that Redis lost while its local tier still holds it (its generation: redis_store.py),
  named `redis_wiped` (store/fsck_wiped.py);
- every file opened bounded (store/safe_files.py): regular files only, sizes checked before reading,
  JSON nesting limited.

What `repair=True` does, never deleting what could still serve:
- rebuilds a missing, empty or damaged local catalogue from the records and the blocks
  (store/rebuild.py; the old catalogue is kept in quarantine/);
- puts back entry rows from their records (a damaged row is kept in `quarantined_entries`), writes
  missing records, moves damaged records into quarantine/records/ and writes them again from a sound
  row; sets aside entries with no sound copy at all (kept, never served);
- catalogues again a block file that an entry names and whose header and payload check; quarantines
  damaged, missing and forged blocks (never read again; a later write of the same block replaces them);
- moves orphans older than `grace_seconds` into quarantine/orphans/ (younger ones may belong to a
  writer that has not committed yet); `purge_orphans=True` deletes them, and empties that folder;
- marks entries with broken chains (table `fsck_damaged_entries` locally, hash `kvm:{<s>}:damaged` in
  Redis) and, when `recompute` is given (the memory layer: `KVMemory.recompute`), recomputes and
  re-proves their blocks, clearing the mark; marks of entries found whole again are cleared;
- recounts Redis block references, and calls `router_rebuild()` (e.g. `KVMemory.reindex`) so the
  router matches the catalogue again (a damaged router is kept in quarantine/router-* and built anew);
- restores a Redis store that Redis lost from its local tier (store/fsck_wiped.py);
- refuses to act (RepairRefused, nothing changed) when it would take most of the store out of service:
  a wrong signing key, model or store is likelier than that much damage (`force=True` acts anyway).

Exit codes (`FsckReport.exit_code`): 0 clean, 1 problems found and all repaired, 4 problems left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvmemory.errors import CatalogueLost, KVMemoryError, StoreError
from kvmemory.store.fsck_common import (GRACE_SECONDS, MAX_LISTED, EntryCheck, FsckReport, Recompute,  # noqa: F401
                                        RouterCheck, check_block_bytes, set_aside_local)
from kvmemory.store.fsck_local import fsck_local, note_rebuild
from kvmemory.store.fsck_redis import fsck_redis
from kvmemory.store.local import LocalStore


def run_fsck(store, repair: bool = False, router_rebuild: Callable[[], int] | None = None, *,
             grace_seconds: float = GRACE_SECONDS, purge_orphans: bool = False, router_check: RouterCheck | None = None,
             entry_check: EntryCheck | None = None, recompute: Recompute | None = None,
             progress: bool = False, force: bool = False) -> FsckReport:
    """Check (and with `repair`, fix) `store`; see the module docstring. Never raises for damage it finds:
    damage is what it reports. Raises StoreError only when the store cannot be reached at all.
    `progress`: a bar on stderr over the blocks read and hashed. A repair first checks (the cost of one
    more check-only pass) and raises RepairRefused, changing nothing, when it would take most of the
    store out of service (`mass_repair_refusal`); `force` repairs anyway."""
    t0 = time.perf_counter()
    if repair and getattr(store, "readonly", False):
        from kvmemory.errors import StoreReadOnly

        raise StoreReadOnly("fsck --repair needs a writable store (this one was opened read-only)")
    if repair and getattr(store, "namespace", None) is not None:
        from kvmemory.errors import InvalidInput

        raise InvalidInput("fsck --repair works on the whole store: open it without a namespace, with the master key")
    if getattr(store, "wiped", None):  # Redis lost the store; its local tier still holds it
        from kvmemory.store.fsck_wiped import report_wiped, restore_from_tier

        rep = FsckReport(getattr(store, "url", ""), "redis", repair)
        if not repair:
            report_wiped(rep, store)
            rep.seconds = time.perf_counter() - t0
            return rep
        restore_from_tier(rep, store, entry_check)
        after = run_fsck(store, True, router_rebuild, grace_seconds=grace_seconds, purge_orphans=purge_orphans,
                         router_check=router_check, entry_check=entry_check, recompute=recompute, progress=progress,
                         force=True)
        after.problems = (rep.problems + after.problems)[:MAX_LISTED]
        for k, v in rep.counts.items():
            after.add(k, v)
        after.seconds = time.perf_counter() - t0
        return after
    if repair and not force:
        why = mass_repair_refusal(_backend(store, False, grace_seconds, purge_orphans, entry_check, False))
        if why is not None:
            from kvmemory.errors import RepairRefused

            raise RepairRefused(why)
    report = _backend(store, repair, grace_seconds, purge_orphans, entry_check, progress)
    if report.catalogue == "ok" and router_check is not None:
        try:
            found = router_check()
        except KVMemoryError as exc:  # an unreadable router: rebuilt by the repair
            found = [("router", str(exc))]
        for key, detail in found:
            report.problem("router_drift", key, detail, fixed=repair and router_rebuild is not None)
    if repair and report.broken:
        _recompute(report, store, recompute)
    if repair and router_rebuild is not None and report.catalogue == "ok":
        report.router_rebuilt = int(router_rebuild())
    report.seconds = time.perf_counter() - t0
    return report


def _backend(store, repair: bool, grace: float, purge: bool, entry_check, progress: bool) -> FsckReport:
    if getattr(store, "kind", "") == "redis":
        return fsck_redis(store, repair, grace, purge_orphans=purge, entry_check=entry_check, progress=progress)
    if isinstance(store, LocalStore):
        return fsck_local(store, repair, grace, purge, entry_check, progress)
    raise StoreError(f"fsck does not know stores of kind {getattr(store, 'kind', type(store).__name__)!r}")


_BLOCKS_OUT = ("blocks_damaged", "blocks_missing", "blocks_unsigned", "block_rows_damaged")
_ENTRIES_OUT = ("entries_forged", "entry_rows_damaged", "entries_self_mismatch", "entries_inconsistent")


def mass_repair_refusal(pre: FsckReport) -> str | None:
    """Why a repair must not act on what the check-only pass `pre` found (None: it may): quarantine is
    for the few damaged items, never the lot. More than half of the blocks (or entries) checked, and at
    least two, would be quarantined (set aside): that is a wrong signing key, a wrong profile or model,
    or a different store far more often than damage."""
    blocks = sum(pre.n(k) for k in _BLOCKS_OUT)
    entries = sum(pre.n(k) for k in _ENTRIES_OUT)
    nb, ne = pre.n("blocks_checked"), pre.n("entries_checked")
    if not ((blocks >= 2 and 2 * blocks > nb) or (entries >= 2 and 2 * entries > ne)):
        return None
    unsigned = pre.n("blocks_unsigned") + pre.n("entries_forged")
    if unsigned * 2 >= blocks + entries:
        cause = ("most signatures do not verify: the signing key (--signing-key / KVMEMORY_SIGNING_KEY) is "
                 "probably not this store's")
    elif pre.n("entries_self_mismatch") * 2 >= entries and entries:
        cause = ("most entries do not re-tokenize to their own token ids: the model or profile (--model, "
                 "--dtype, --chunk ...) is probably not the one they were stored under")
    else:
        cause = "most blocks or entries are missing or damaged: is this the store you meant?"
    return (f"fsck --repair refused, nothing was changed: it would take {blocks} of {nb} blocks and {entries} of "
            f"{ne} entries out of service; {cause}. Check with `kvmemory fsck` (no --repair); if the damage is "
            "real, repair anyway with `kvmemory fsck --repair --force`")


def _recompute(rep: FsckReport, store, recompute: Recompute | None) -> None:
    """Entries whose chains are broken: recomputed and re-proven by the memory layer when it is given
    (then their marks are cleared), else left marked: `kvmemory verify` counts them unproven."""
    if recompute is None:
        rep.add("entries_unproven", len(rep.broken))
        return
    results = recompute(list(rep.broken))
    for eid in rep.broken:
        why = results.get(eid, "not recomputed")
        if why is None:
            rep.problem("entries_recomputed", eid, "its blocks were computed again from its own texts and the graft "
                        "proven bit-identical", fixed=True)
            _unmark(store, eid)
        else:
            rep.add("entries_unproven")
            rep.problem("entries_unproven", eid, f"its blocks could not be recomputed and re-proven: {why}",
                        fixed=False)


def _unmark(store, eid: str) -> None:
    if getattr(store, "kind", "") == "redis":
        store.client.hdel(store.k_damaged(), eid)
        return
    try:
        with store._tx() as db:
            db.execute("DELETE FROM fsck_damaged_entries WHERE entry_id=?", (eid,))
    except StoreError:
        pass  # never marked (no table yet)


def fsck_at(spec, *, signing_key=None, repair: bool = False, router: Callable | None = None, **kw) -> FsckReport:
    """`run_fsck` on the store `spec` names (a folder or a redis:// URL), including a local store whose
    catalogue is lost (which every other command refuses): check-only reports it without creating
    anything; `repair` rebuilds the catalogue first (store/rebuild.py). `router(store)` returns
    (router_check, router_rebuild) for the opened store; `kw` goes to `run_fsck`."""
    from kvmemory.store.open import is_redis_url, open_store, resolve_spec

    spec = resolve_spec(spec)  # once: the open, the rebuild and the report all name this store
    # a Redis store that Redis lost is opened anyway: fsck names the loss, the repair restores it
    extra = {"allow_wiped": True} if is_redis_url(spec) else {"create": False}
    rebuilt = None
    try:
        store = open_store(spec, signing_key=signing_key, **extra)
    except CatalogueLost as exc:
        path = Path(str(spec)).expanduser()
        if not repair:
            rep = FsckReport(str(path), "local", False, catalogue=f"lost: {exc}")
            rep.problem("catalogue_lost", "catalogue.sqlite", str(exc), fixed=False)
            return rep
        from kvmemory.store.rebuild import rebuild_catalogue
        from kvmemory.store.signing import Signer

        rebuilt = rebuild_catalogue(path, signer=Signer.resolve(signing_key) if signing_key is not None else None)
        store = open_store(spec, signing_key=signing_key, **extra)
    try:
        check, rebuild = router(store) if router is not None else (None, None)
        rep = run_fsck(store, repair=repair, router_rebuild=rebuild, router_check=check, **kw)
    finally:
        store.close()
    if rebuilt is not None:
        note_rebuild(rep, rebuilt, "the catalogue was missing or empty")
    return rep


__all__ = ["run_fsck", "fsck_at", "FsckReport", "check_block_bytes", "GRACE_SECONDS"]
