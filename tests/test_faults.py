"""Fault tests, bounded in time, each printing its counts:

- 200 writer processes SIGKILLed at random points (local store and Redis): the store opens, no partial
  entry is visible, every byte read back is exactly what was written, fsck finds no damage;
- random bit flips, truncations, extensions and overwrites in block files and Redis payloads: 100 %
  detected before a byte is returned;
- random bit flips in the catalogue (the SQLite file of a signed store, Redis entry and row fields):
  every change is refused or harmless, none delivered; unsigned, the KV bytes are still never wrong,
  and an entry field changed silently is found by fsck against the entry's record;
- a full disk (a 2 MiB tmpfs): a clean StoreFull, the store intact; the Redis tier on a full disk
  keeps serving;
- 4 writer and 4 reader processes at once (signed local store, Redis): nothing lost, nothing corrupted.

Writers are forked from this process (torch already imported), so 200 of them cost milliseconds each.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import time
import uuid

import pytest
from redis_server import RedisServer, check_entry_readable, expected_payload, synth_entry

from kvmemory.errors import IntegrityError, KVMemoryError, StoreFull, UnknownEntry
from kvmemory.store.fsck import run_fsck
from kvmemory.store.redis_store import RedisStore
from kvmemory.store.signing import SignedLocalStore
from kvmemory.store.local import LocalStore

KEY = "e5" * 32
CTX = mp.get_context("fork")


@pytest.fixture(scope="module")
def srv():
    with RedisServer() as s:
        yield s


def _open(kind: str, where: str, name: str | None = None, **kw):
    if kind == "local":
        return LocalStore(where)
    if kind == "signed":
        return SignedLocalStore(where, signer=KEY)
    return RedisStore(where, store=name, path=kw.get("tier"), signer=KEY)


# ---------------------------------------------------------------------- SIGKILLed writers
def _kill_writer(kind, where, name, tier, base, ready, ops):
    store = _open(kind, where, name, tier=tier)
    ready.set()
    i = 0
    while True:
        e, b = synth_entry(base + i, n_blocks=3, shared=1)
        store.commit_entry(e, b)
        if i % 3 == 2:  # deletes too: the GC path must be crash-safe as well
            store.delete_entries([synth_entry(base + i - 1)[0].id])
        i += 1
        ops.value = i


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_200_writers_killed_at_random_points(kind, srv, tmp_path):
    where = str(tmp_path / "store") if kind == "local" else srv.url
    name = f"kill{uuid.uuid4().hex[:6]}"
    _open(kind, where, name, tier=tmp_path / "tier0").close()
    rng = random.Random(1234)
    kills = mid_run = 0
    t0 = time.perf_counter()
    for k in range(200):
        # lock=False: a writer killed while holding a lock would leave it held for ever
        ready, ops = CTX.Event(), CTX.Value("i", 0, lock=False)
        p = CTX.Process(target=_kill_writer, args=(kind, where, name, str(tmp_path / f"tier{k % 4}"), k * 10_000,
                                                   ready, ops))
        p.start()
        ready.wait(10)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL, "a writer ended by itself (an error?) instead of being killed"
        kills += 1
        mid_run += ops.value > 0
    elapsed = time.perf_counter() - t0
    store = _open(kind, where, name, tier=tmp_path / "check")
    ids = store.entry_ids()
    blocks_read = sum(check_entry_readable(store, eid) for eid in ids)  # exact bytes, or AssertionError
    assert blocks_read == 3 * len(ids), "a visible entry is missing blocks: a partial entry"
    rep = run_fsck(store, grace_seconds=0)
    for bad in ("blocks_damaged", "blocks_missing", "block_rows_damaged", "entries_broken_chain",
                "entry_rows_damaged", "entries_forged", "blocks_unsigned"):
        assert rep.n(bad) == 0, rep.summary()
    assert rep.catalogue == "ok"
    repaired = run_fsck(store, repair=True, grace_seconds=0)
    assert run_fsck(store, grace_seconds=0).exit_code == 0
    print(f"\n[{kind}] {kills} writers SIGKILLed ({mid_run} after >= 1 commit) in {elapsed:.1f}s; "
          f"{len(ids)} entries visible, all whole ({blocks_read} blocks read back byte-exact); orphans left by "
          f"kills: {repaired.n('orphan_payloads')} payloads (set aside by fsck --repair), "
          f"{repaired.n('stale_tmp_files')} tmp files (removed); entries whose record was written before the "
          f"kill put back: {repaired.n('entries_restored')}")
    assert mid_run >= 100  # most kills landed while writing, not before the first commit


# ---------------------------------------------------------------------- damage in blocks
def _damage(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(["bitflip", "bitflip", "bitflip", "truncate", "extend", "overwrite"])
    b = bytearray(data)
    if kind == "bitflip":
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        b = b[: rng.randrange(len(b))]
    elif kind == "extend":
        b += os.urandom(rng.randint(1, 64))
    else:
        i = rng.randrange(len(b))
        n = rng.randint(1, 32)
        new = os.urandom(n)
        if bytes(b[i : i + n]) == new[: len(b[i : i + n])]:
            new = bytes(x ^ 0xFF for x in new)
        b[i : i + n] = new[: len(b[i : i + n])]
    return bytes(b), kind


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_damaged_blocks_are_always_detected(kind, srv, tmp_path):
    trials = 400
    store = (LocalStore(tmp_path / "s") if kind == "local"
             else RedisStore(srv.url, store=f"flip{uuid.uuid4().hex[:6]}", path=tmp_path / "t", signer=KEY))
    made = [synth_entry(i, n_blocks=3) for i in range(4)]
    for e, b in made:
        store.commit_entry(e, b)
    blocks = {m.hash: (m, p) for _, bl in made for m, p in bl}
    rng = random.Random(99)
    detected, kinds = 0, {}
    for _ in range(trials):
        h = rng.choice(sorted(blocks))
        row = store.get_block(h)
        if kind == "local":
            path = store.block_path(h)
            damaged, how = _damage(path.read_bytes(), rng)
            path.write_bytes(damaged)
        else:
            key = store.k_payload(h)
            damaged, how = _damage(store.client.get(key), rng)
            store.client.set(key, damaged)
            store.block_path(h).unlink(missing_ok=True)  # no tier copy: the read goes to Redis
        kinds[how] = kinds.get(how, 0) + 1
        try:
            _, buf = store.read_block(row)
        except IntegrityError:
            detected += 1
        else:
            raise AssertionError(f"{how} damage was not detected (bytes equal: {bytes(buf) == expected_payload(h)})")
        store.put_blocks([blocks[h]])  # write it again: replaces the quarantined copy
        assert bytes(store.read_block(store.get_block(h))[1]) == expected_payload(h)
    print(f"\n[{kind}] block damage: {detected}/{trials} detected before any byte was returned ({kinds})")
    assert detected == trials


# ---------------------------------------------------------------------- damage in the catalogue
def _snapshot(store, ids):
    out = {}
    for eid in ids:
        e = store.get_entry(eid)
        out[eid] = (e, {h: store.get_block(h) for h in e.chain})
    return out


def _signed_fields(row):
    return (row.hash, row.parent, row.profile_id, row.index, row.n_tokens, row.payload_sha256, row.payload_nbytes)


def _judge(store, truth) -> tuple[str, list[str]]:
    """'detected' (a typed error or a refusal), 'lost' (a row gone: fail-safe), 'harmless' (everything
    served is identical), or 'silent' (something different was served) -- with what differed."""
    detected = lost = False
    silent: list[str] = []
    try:
        listed = {e.id: e for e in store.list_entries()}
    except KVMemoryError:
        listed, detected = {}, True
    for eid, (entry, rows) in truth.items():
        if eid in listed and listed[eid] != entry:
            silent.append(f"list_entries served a changed {eid}")
        try:
            got = store.get_entry(eid)
        except UnknownEntry:
            lost = True
            got = None
        except KVMemoryError:
            detected = True
            got = None
        if got is not None and got != entry:
            silent.append(f"entry {eid} served changed")
        for h, row in rows.items():
            try:
                r = store.get_block(h)
            except KVMemoryError:
                detected = True
                continue
            if r is None:
                detected = True
                continue
            if _signed_fields(r) != _signed_fields(row):
                detected = True  # a changed row is only a problem if it serves changed bytes (below)
            if r.quarantined:
                continue
            try:
                _, buf = store.read_block(r)
            except KVMemoryError:
                detected = True
                continue
            if bytes(buf) != expected_payload(h):
                silent.append(f"block {h[:12]} served wrong bytes")
    if silent:
        return "silent", silent
    return ("detected" if detected else "lost" if lost else "harmless"), []


@pytest.mark.parametrize("signed", [True, False])
def test_catalogue_bit_flips_never_reach_the_model(signed, tmp_path):
    trials = 150 if signed else 80
    src = tmp_path / "pristine"
    store = SignedLocalStore(src, signer=KEY) if signed else LocalStore(src)
    made = [synth_entry(i, n_blocks=3) for i in range(5)]
    for e, b in made:
        store.commit_entry(e, b)
    truth = _snapshot(store, [e.id for e, _ in made])
    store.close()
    pristine = (src / "catalogue.sqlite").read_bytes()
    assert not (src / "catalogue.sqlite-wal").exists() or (src / "catalogue.sqlite-wal").stat().st_size == 0
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    entry_text_changes = found_by_fsck = 0
    for t in range(trials):
        work = tmp_path / f"w{t % 2}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(src, work, ignore=shutil.ignore_patterns("catalogue.sqlite*"))
        data = bytearray(pristine)
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        (work / "catalogue.sqlite").write_bytes(bytes(data))
        try:
            st = SignedLocalStore(work, signer=KEY) if signed else LocalStore(work)
        except KVMemoryError:
            outcomes["detected"] = outcomes.get("detected", 0) + 1
            continue
        verdict, what = _judge(st, truth)
        if verdict == "silent" and not signed and not any("block" in w for w in what):
            entry_text_changes += 1  # unsigned stores do not protect entry texts: counted, not hidden
            verdict = "silent entry fields (unsigned)"
            # ... but each entry's record (beside its blocks) tells: fsck finds the changed row
            assert run_fsck(st).exit_code == 4, f"flip at byte {i}: fsck did not find {what}"
            found_by_fsck += 1
        st.close()
        outcomes[verdict] = outcomes.get(verdict, 0) + 1
        assert verdict != "silent", f"flip at byte {i}: {what}"
    label = "signed" if signed else "unsigned"
    print(f"\n[{label}] catalogue bit flips: {trials} trials -> {outcomes}; silent entry changes found by fsck "
          f"against the entries' records: {found_by_fsck} of {entry_text_changes}")
    assert sum(outcomes.values()) == trials


def test_redis_catalogue_bit_flips_are_refused(srv, tmp_path):
    trials = 100
    store = RedisStore(srv.url, store=f"cf{uuid.uuid4().hex[:6]}", path=tmp_path / "t", signer=KEY)
    made = [synth_entry(i, n_blocks=3) for i in range(4)]
    for e, b in made:
        store.commit_entry(e, b)
    truth = _snapshot(store, [e.id for e, _ in made])
    keys = [store.k_entry(e.id) for e, _ in made] + sorted({store.k_block(h) for _, rows in truth.values() for h in rows})
    r = store.client
    rng = random.Random(3)
    outcomes: dict[str, int] = {}
    for _ in range(trials):
        key = rng.choice(keys)
        field = rng.choice(sorted(r.hkeys(key)))
        old = r.hget(key, field)
        b = bytearray(old)
        if b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        r.hset(key, field, bytes(b))
        shutil.rmtree(tmp_path / "reader", ignore_errors=True)
        reader = RedisStore(srv.url, store=store.name, path=tmp_path / "reader", signer=KEY, readonly=True)
        verdict, what = _judge(reader, truth)
        reader.close()
        r.hset(key, field, old)
        outcomes[verdict] = outcomes.get(verdict, 0) + 1
        assert verdict != "silent", f"flip in {key} {field}: {what}"
    print(f"\n[redis] catalogue field bit flips: {trials} trials -> {outcomes}")


# ---------------------------------------------------------------------- full disk
@pytest.fixture
def tiny_disk(tmp_path):
    """A real full disk: a 2 MiB tmpfs (the suite runs as root; elsewhere this is an error to look at)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        raise RuntimeError(f"cannot mount a tmpfs: {r.stderr}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_is_a_clean_error_and_the_store_stays_whole(tiny_disk):
    store = SignedLocalStore(tiny_disk / "store", signer=KEY)
    ok = 0
    with pytest.raises(StoreFull):
        for i in range(10_000):
            before = store.stats()
            store.commit_entry(*synth_entry(i, n_blocks=8, shared=1))
            ok += 1
    after = store.stats()
    assert (after.entries, after.blocks, after.bytes) == (before.entries, before.blocks, before.bytes)
    assert not list((tiny_disk / "store" / "tmp").iterdir())
    for eid in store.entry_ids():
        assert check_entry_readable(store, eid) == 8
    rep = run_fsck(store)
    assert rep.catalogue == "ok" and rep.n("blocks_damaged") == rep.n("blocks_missing") == 0, rep.summary()
    assert rep.n("entries_broken_chain") == 0
    freed = run_fsck(store, repair=True, grace_seconds=0)  # the refused entry's block files are orphans
    assert freed.n("unrepaired") == 0, freed.summary()
    print(f"\nfull disk: {ok} entries stored, then StoreFull; store whole; fsck set aside "
          f"{freed.n('orphan_payloads')} orphan block files of the refused entry")


def test_redis_tier_on_a_full_disk_keeps_serving(srv, tiny_disk):
    store = RedisStore(srv.url, store=f"fd{uuid.uuid4().hex[:6]}", path=tiny_disk / "tier", signer=KEY)
    made = [synth_entry(i, n_blocks=3) for i in range(3)]
    for e, b in made:
        store.commit_entry(e, b)
    filler = tiny_disk / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    for e, _ in made:  # the tier cannot cache anything now; reads still come, verified, from Redis
        assert check_entry_readable(store, e.id) == 3


# ---------------------------------------------------------------------- concurrent processes
def _rw(kind, where, name, tier, role, seed, seconds, q):
    store = _open(kind, where, name, tier=tier)
    end = time.time() + seconds
    done, errors, committed, blocks = 0, [], [], 0
    i = 0
    rng = random.Random(seed)
    while time.time() < end:
        try:
            if role == "w":
                e, b = synth_entry(seed * 100_000 + i, n_blocks=3, shared=1)
                store.commit_entry(e, b)
                committed.append(e.id)
                if i % 4 == 3:
                    store.update_attestation(e.id, {"attestation_id": f"re{i}"}, verified=True)
            else:
                ids = store.entry_ids()
                for eid in rng.sample(ids, min(3, len(ids))):
                    blocks += check_entry_readable(store, eid)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors.append(f"{type(exc).__name__}: {exc}")
        done += 1
        i += 1
    q.put((role, done, committed, blocks, errors))


@pytest.mark.parametrize("kind", ["signed", "redis"])
def test_four_writers_four_readers(kind, srv, tmp_path):
    where = str(tmp_path / "store") if kind == "signed" else srv.url
    name = f"rw{uuid.uuid4().hex[:6]}"
    _open(kind, where, name, tier=tmp_path / "t0").close()
    q = CTX.Queue()
    procs = [CTX.Process(target=_rw, args=(kind, where, name, str(tmp_path / f"t{n}"), role, n + 1, 5.0, q))
             for n, role in enumerate("wwwwrrrr")]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [e for *_, errs in results for e in errs]
    committed = [c for role, _, cs, _, _ in results if role == "w" for c in cs]
    reads = sum(d for role, d, *_ in results if role == "r")
    blocks = sum(b for _, _, _, b, _ in results)
    store = _open(kind, where, name, tier=tmp_path / "check")
    present = set(store.entry_ids())
    lost = [c for c in committed if c not in present]
    for eid in random.Random(0).sample(committed, min(200, len(committed))):  # readers checked bytes all along
        assert check_entry_readable(store, eid) == 3
    print(f"\n[{kind}] 4 writers + 4 readers for 5s: {len(committed)} entries committed, {reads} reader passes, "
          f"{blocks} blocks read back byte-exact, lost {len(lost)}, errors {len(errors)}")
    assert not errors, errors[:5]
    assert not lost
    assert committed and reads > 0 and blocks > 0
