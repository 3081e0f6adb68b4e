"""fsck on a Redis store (store/fsck.py has the report, the local store and what is checked).

In Redis the entry hashes are the catalogue; each entry also has a record (`kvm:{<s>}:r:<id>`, the
JSON of store/records.py with the entry's signature) written in the same script. Order of the pass:
block index drift; entries against their records (a damaged, forged or lost entry is put back from a
sound record; a missing or damaged record is written again from a sound entry); block rows and their
payloads; orphan payloads (one an entry names whose row is gone is catalogued again when it checks on
its own; the rest are set aside under `op:` keys, deleted only with `purge_orphans`); the entries'
chains; reference counts. Nothing is deleted that could still serve: set-aside entries, records and
rows are renamed (`qe:`, `qr:`, `qb:`), never dropped.

Which copy wins when an entry and its record differ (they are written in one script, so only damage
makes them differ): in a signed store, the copy whose signature verifies (the entry first); unsigned,
the record when it is sound (its own SHA-256, its chain the chain of its token ids, `entry_check`),
else the entry when it is.
"""

from __future__ import annotations

import json
import time

from kvmemory.errors import IntegrityError
from kvmemory.store.fsck_common import broken_chain
from kvmemory.store.fsck_common import EntryCheck, FsckReport, check_block_bytes, master_signer, progress_bar
from kvmemory.store.fsck_records import differing_fields, self_problem, signature_ok
from kvmemory.store.local import BlockRow, EntryRecord
from kvmemory.store.rebuild import check_block_file, chunk_of
from kvmemory.store.records import content_sha256, make_record, parse_record, record_bytes


def fsck_redis(store, repair: bool, grace: float, *, purge_orphans: bool = False,
               entry_check: EntryCheck | None = None, progress: bool = False) -> FsckReport:
    r = store.client
    rep = FsckReport(f"{store.url} store {store.name!r}", store.kind, repair)
    if not store.ping():
        raise store._unavailable_error("fsck")
    signer = master_signer(store)
    now = time.time()
    pre = store.k_block("")

    # -- index drift: row keys the blocks zset does not list, and the reverse
    indexed = set(_index(store, rep, repair, store.k_blocks(), lambda: store.all_block_hashes()))
    keyed = {k.decode()[len(pre):] for k in r.scan_iter(match=pre + "*", count=1000)}
    for h in sorted(keyed - indexed):
        if repair:
            r.zadd(store.k_blocks(), {h: now})
        rep.problem("index_drift", h, "block row missing from the blocks index", fixed=repair)
    for h in sorted(indexed - keyed):
        if repair:
            r.zrem(store.k_blocks(), h)
        rep.problem("index_drift", h, "blocks index names a row that does not exist", fixed=repair)

    # -- entries against their records (before the blocks: entries put back name blocks adopted below)
    entries = _reconcile(rep, store, repair, entry_check, now)

    # -- block rows and their payloads
    rows: dict[str, BlockRow] = {}
    usable: set[str] = set()
    hashes = sorted(keyed)
    bar = progress_bar(len(hashes), progress)
    for i in range(0, len(hashes), 200):
        chunk = hashes[i : i + 200]
        bar.update(len(chunk))
        raws = store._fetch(lambda c=chunk: store._raw_rows(c), "fsck")
        p = r.pipeline(transaction=False)
        for h in chunk:
            p.get(store.k_payload(h))
        try:
            payloads = p.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - a pipeline-level failure is an outage
            raise store._unavailable_error("fsck", exc) from exc
        for h, raw, data in zip(chunk, raws, payloads):
            rep.add("blocks_checked")
            try:
                row, sigs = store.parse_block_row(h, raw)
            except IntegrityError as exc:
                if repair:
                    r.rename(store.k_block(h), f"{store._pre}qb:{h}")
                    r.zrem(store.k_blocks(), h)
                    r.rpush(store.k_qlog(), json.dumps({"hash": h, "reason": f"fsck: {exc}", "at": now}))
                rep.problem("block_rows_damaged", h, str(exc), fixed=repair)
                continue
            rows[h] = row
            if row.quarantined:
                rep.add("blocks_already_quarantined")
                continue
            if signer is not None and not store._visible(row, sigs):
                if repair:
                    store.quarantine(h, "fsck: no valid signature")
                rep.problem("blocks_unsigned", h, "no namespace signed this row validly (forged or unsigned)",
                            fixed=repair)
                continue
            if data is None:
                if repair:
                    store.quarantine(h, "fsck: missing payload")
                rep.problem("blocks_missing", h, "catalogued but its payload is missing", fixed=repair)
                continue
            why = (f"unreadable payload key: {data}" if isinstance(data, Exception)
                   else check_block_bytes(bytes(data), row))
            if why is not None:
                if repair:
                    store.quarantine(h, f"fsck: {why}")
                rep.problem("blocks_damaged", h, why, fixed=repair)
                continue
            rep.add("blocks_ok")
            usable.add(h)

    bar.close()
    # -- orphan payloads: adopted when an entry names them (and its signed chain has their hash), else set
    # aside (older than the grace period: a writer SETs payloads before it commits)
    named: dict[str, tuple[EntryRecord, str]] = {}  # hash -> (an entry naming it, the payload SHA-256 it names)
    for e, chain_sha in entries.values():
        for h, sha in zip(e.chain, chain_sha):
            named.setdefault(h, (e, sha))
    ppre = store.k_payload("")[:-2]  # "kvm:<s>:p:"
    adopted: set[str] = set()
    for k in r.scan_iter(match=ppre + "{*}", count=1000):
        h = k.decode()[len(ppre) + 1 : -1]
        if h in rows:
            continue
        if h in named:
            if _adopt(rep, store, h, *named[h], repair, now):
                usable.add(h)
                adopted.add(h)
            continue
        idle = r.object("idletime", k) or 0
        if idle < grace:
            rep.add("orphans_recent_kept")
            continue
        if repair:
            if purge_orphans:
                r.delete(k)
                rep.add("orphans_purged")
            else:
                r.rename(k, store.k_orphan(h))
        rep.problem("orphan_payloads", h, "no catalogue row names this payload" + (
            "" if not repair else " (removed)" if purge_orphans else " (kept under an op: key)"), fixed=repair)
    if repair and purge_orphans:
        for k in r.scan_iter(match=store.k_orphan("")[:-2] + "{*}", count=1000):
            r.delete(k)
            rep.add("orphans_purged")

    # -- the entries' chains, their marks, and the blocks' reference counts
    refs: dict[str, int] = {}
    marked = set(_index(store, rep, repair, store.k_damaged(), lambda: [k.decode() for k in r.hkeys(store.k_damaged())]))
    flagged = set() if repair else {p["key"] for p in rep.problems if p["kind"] in (
        "entries_forged", "entry_rows_damaged", "entries_altered", "entries_missing_from_catalogue")}
    for eid, (entry, _) in sorted(entries.items()):
        for h in entry.chain:
            refs[h] = refs.get(h, 0) + 1
        why = broken_chain(entry.chain, usable)
        if why is not None:
            rep.broken.append(eid)
            if eid in marked:
                rep.add("entries_broken_chain")  # known and marked by an earlier repair: not a new problem
            else:
                if repair:
                    r.hset(store.k_damaged(), eid, why)
                    rep.add("entries_marked")
                rep.problem("entries_broken_chain", eid, why, fixed=repair)
        elif eid in flagged:
            pass  # check-only: reported above (forged, altered, missing: only its record holds it), not ok
        else:
            rep.add("entries_ok")
            if repair and eid in marked:
                r.hdel(store.k_damaged(), eid)
                rep.add("entries_unmarked")
    for h in [*rows, *sorted(adopted)]:
        raw_refs = r.hget(store.k_block(h), "refs")
        want = refs.get(h, 0)
        try:
            have = int(raw_refs) if raw_refs is not None else None
        except ValueError:
            have = -1
        if have is not None and have != want:
            if repair:
                r.hset(store.k_block(h), "refs", want)
                rep.add("refs_fixed")
    return rep


def _chunk(store, entry: EntryRecord, chain_sha) -> int | None:
    try:
        profile = store.get_profile(entry.profile_id)
    except IntegrityError:
        profile = None
    if chunk_of(profile) or not entry.chain:
        return chunk_of(profile)
    try:
        row = store.client.hget(store.k_block(entry.chain[0]), "n_tokens")
        return int(row) if row is not None else None
    except (ValueError, store._resp_err):  # a damaged row (a number that is not, a key of the wrong type)
        return None


def _sound(store, entry: EntryRecord, chain_sha, sig: str, entry_check) -> str | None:
    """Why this copy of an entry cannot be trusted (its chain, its texts, its signature), or None."""
    _, why = self_problem(entry, _chunk(store, entry, chain_sha), entry_check)
    if why is not None:
        return why
    if getattr(store, "signer", None) is not None and not signature_ok(
            store, entry, {"namespace": entry.namespace, "sig": sig, "chain_sha256": list(chain_sha)}):
        return "its signature does not verify"
    return None


def _put_back(store, entry: EntryRecord, chain_sha, sig: str, record: bytes) -> None:
    """Write an entry (its hash, its indexes, its record) back from its record's copy."""
    r = store.client
    fields = store._entry_fields(entry, chain_sha, sig)
    p = r.pipeline(transaction=True)
    p.delete(store.k_entry(entry.id))
    p.hset(store.k_entry(entry.id), mapping=dict(zip(fields[::2], fields[1::2])))
    p.zadd(store.k_entries(), {entry.id: entry.created})
    p.zadd(store.k_ns(entry.namespace), {entry.id: entry.created})
    p.set(store.k_record(entry.id), record)
    p.execute()
    store.note_change("put", entry.id, entry.namespace)  # every router hears of it (store/feed.py)


def _set_aside_record(store, eid: str) -> None:
    r = store.client
    if r.exists(store.k_record(eid)):
        r.rename(store.k_record(eid), store.k_qrecord(eid))


def _reconcile(rep: FsckReport, store, repair: bool, entry_check, now: float) -> dict[str, tuple[EntryRecord, list]]:
    """Every entry key and record key compared; returns the entries that stand (after repair; check-only:
    the ones found sound), by id, each with its chain's payload hashes."""
    r = store.client
    epre, rpre = store.k_entry(""), store.k_record("")
    ekeys = {k.decode()[len(epre):] for k in r.scan_iter(match=epre + "*", count=1000)}
    rkeys = {k.decode()[len(rpre):] for k in r.scan_iter(match=rpre + "*", count=1000)}
    listed = set(_index(store, rep, repair, store.k_entries(),
                        lambda: [x.decode() for x in r.zrange(store.k_entries(), 0, -1)]))
    for eid in sorted(listed - ekeys - rkeys):
        if repair:
            r.zrem(store.k_entries(), eid)
        rep.problem("index_drift", eid, "entries index names an entry that does not exist", fixed=repair)
    out: dict[str, tuple[EntryRecord, list]] = {}
    for eid in sorted(ekeys | rkeys):
        raw = store._hgetall_many([store.k_entry(eid)])[0] if eid in ekeys else None
        rec, rec_err = None, None
        if eid in rkeys:
            try:
                data = r.get(store.k_record(eid))
                rec = parse_record(data if isinstance(data, bytes) else b"", eid)
            except (IntegrityError, store._resp_err) as exc:
                rec_err = str(exc)
        rec_sha = list((rec.signature or {}).get("chain_sha256") or ()) if rec is not None else []
        rec_sig = (rec.signature or {}).get("sig") or "" if rec is not None else ""
        rec_why = _sound(store, rec.entry, rec_sha, rec_sig, entry_check) if rec is not None else rec_err
        def from_record() -> None:
            _put_back(store, rec.entry, rec_sha, rec_sig, record_bytes(make_record(
                rec.entry, signature={"namespace": rec.entry.namespace, "sig": rec_sig, "chain_sha256": rec_sha})))

        if raw is None:  # a record whose entry is gone
            if rec_why is None:
                if repair:
                    from_record()
                    rep.add("entries_restored")
                rep.problem("entries_missing_from_catalogue", eid, "its record is here but the entry is not: put back "
                            "from the record", fixed=repair)
                out[eid] = (rec.entry, rec_sha)
            else:
                if repair:
                    _set_aside_record(store, eid)
                rep.problem("entry_records_damaged", eid, f"a record without an entry that does not check ({rec_why}); "
                            "set aside", fixed=repair)
            continue
        rep.add("entries_checked")
        try:
            parsed = store.parse_entry(eid, raw)
            if store.namespace is not None and parsed[0].namespace != store.namespace:
                rep.add("entries_checked", -1)  # another tenant's entry (a scoped store): not ours to judge
                continue
            entry, chain_sha, sig = parsed
            store.check_entry(entry, chain_sha, sig)
        except IntegrityError as exc:
            kind = "entries_forged" if type(exc).__name__ == "SignatureError" else "entry_rows_damaged"
            back = rec_why is None
            if repair:
                _set_aside_redis(store, eid, raw, f"fsck: {exc}")
                if back:
                    from_record()
            rep.problem(kind, eid, f"{exc}" + ("; put back from its record" if back else ""), fixed=repair)
            if back:
                out[eid] = (rec.entry, rec_sha)
            continue
        why_entry = _sound(store, entry, chain_sha, sig, entry_check)
        if rec is not None and content_sha256(entry) != rec.content_sha256:
            fields = ", ".join(differing_fields(entry, rec.entry))
            signed_entry = getattr(store, "signer", None) is not None and why_entry is None
            if rec_why is None and not signed_entry:
                if repair:
                    _set_aside_redis(store, eid, raw, f"fsck: differs from its record in {fields}")
                    from_record()
                rep.problem("entries_altered", eid, f"the entry differs from its record in {fields}: put back from "
                            "the record", fixed=repair)
                out[eid] = (rec.entry, rec_sha)
                continue
            rec_why = rec_why or f"it differs from the signed entry in {fields}"
        if why_entry is not None:
            if repair:
                _set_aside_redis(store, eid, raw, f"fsck: {why_entry}")
                _set_aside_record(store, eid)
            kind, _ = self_problem(entry, _chunk(store, entry, chain_sha), entry_check)
            rep.problem(kind if "signature" not in why_entry else "entries_forged", eid,
                        f"{why_entry}; set aside with its record, never served", fixed=repair)
            continue
        out[eid] = (entry, chain_sha)
        if rec is None or rec_why is not None:
            if repair:
                if rec is not None or rec_err is not None:
                    _set_aside_record(store, eid)
                r.set(store.k_record(eid), store.record_of(entry, chain_sha, sig))
            kind = "entry_records_missing" if rec is None and rec_err is None else "entry_records_damaged"
            rep.problem(kind, eid, (rec_why or "no record beside the entry") + "; written again from the entry",
                        fixed=repair)
        # its indexes
        try:
            in_ns = r.zscore(store.k_ns(entry.namespace), eid) is not None
        except store._resp_err:  # the namespace index is not a sorted set: damaged
            if repair:
                r.delete(store.k_ns(entry.namespace))
            rep.problem("index_drift", entry.namespace, "namespace index key is damaged", fixed=repair)
            in_ns = False
        if eid not in listed or not in_ns:
            if repair:
                r.zadd(store.k_entries(), {eid: entry.created})
                r.zadd(store.k_ns(entry.namespace), {eid: entry.created})
                store.note_change("put", eid, entry.namespace)
            rep.problem("index_drift", eid, "entry missing from its indexes", fixed=repair)
    return out


def _adopt(rep: FsckReport, store, h: str, entry: EntryRecord, sha: str, repair: bool, now: float) -> bool:
    """A payload an entry names whose row is gone: catalogued again (and signed for the entry's namespace)
    when it checks on its own and is the payload the entry's chain names. True when it is usable."""
    data = store.client.get(store.k_payload(h))
    meta, why = check_block_file(bytes(data or b""), h)
    if meta is not None and meta.payload_sha256 != sha:
        meta, why = None, "its payload is not the one the entry's chain names"
    if meta is None:
        if repair:
            store.client.rename(store.k_payload(h), store.k_qpayload(h))
        rep.problem("blocks_damaged", h, f"an entry names this uncatalogued payload, but {why}", fixed=repair)
        return False
    if repair:
        args = [repr(now), *store._block_args(meta, len(data), entry.verified, False, entry.namespace)]
        store._write(lambda: store._scripts["put"](keys=[store.k_blocks(), store.k_block(h)], args=args),
                     "catalogueing a block again")
    rep.problem("blocks_adopted", h, "a payload an entry names had no row; it checks on its own and is catalogued "
                "again", fixed=repair)
    return repair


def _index(store, rep: FsckReport, repair: bool, key: str, read) -> list[str]:
    """Read an index key; a key of the wrong type is damage: reported, and with repair deleted (fsck then
    re-adds what it finds under the keys it scans)."""
    try:
        return read()
    except (IntegrityError, store._resp_err):  # WRONGTYPE, through the store or the raw client
        pass
    if repair:
        store.client.delete(key)
    rep.problem("index_drift", key, "index key is damaged (wrong type)", fixed=repair)
    return []


def _set_aside_redis(store, eid: str, raw: dict, reason: str) -> None:
    r = store.client
    ns = raw.get(b"namespace", b"").decode("utf-8", "replace") if b"\x00damaged" not in raw else ""
    if b"\x00damaged" not in raw:
        r.hset(store.k_entry(eid), mapping={"fsck_reason": reason, "fsck_at": time.time()})
    r.rename(store.k_entry(eid), store.k_qentry(eid))
    r.zrem(store.k_entries(), eid)
    if ns:
        r.zrem(store.k_ns(ns), eid)
        store.note_change("del", eid, ns)  # routers stop routing to it (store/feed.py)


__all__ = ["fsck_redis"]
