"""The local store: content addressing, verified reads, atomicity, concurrency, bad input, eviction."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny_models import tiny_engine

from kvmemory.store.blocks import BlockMeta, encode_header, parse_header
from kvmemory.errors import IntegrityError, StoreFormatError, StoreFull, StoreReadOnly
from kvmemory.store.local import STORE_FORMAT, LocalStore


def _ids(n, seed=1):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chain_rows(eng, ids):
    from kvmemory.engine.graft import plan_chain

    return plan_chain(eng.store, eng.profile_id, ids, eng.chunk)


def test_shared_prefixes_are_stored_once(store_dir):
    eng = tiny_engine("llama", store_dir)
    shared = _ids(64)
    eng.store_prefix(shared + _ids(32, seed=2))
    eng.store_prefix(shared + _ids(32, seed=3))
    s = eng.store.stats()
    assert s.blocks == 4 + 2 + 2  # the 4 shared blocks once
    files = list((store_dir / "blocks").rglob("*.kvb"))
    assert len(files) == s.blocks


def test_block_file_roundtrip_and_header_checks(store_dir):
    eng = tiny_engine("llama", store_dir)
    ids = _ids(40)
    eng.store_prefix(ids)
    row = _chain_rows(eng, ids + [1])[0]
    raw = eng.store.block_path(row.hash).read_bytes()
    meta, off = parse_header(raw)
    assert meta.hash == row.hash and off % 64 == 0 and len(raw) - off == row.payload_nbytes
    assert encode_header(meta) == raw[:off]
    for bad in (b"", b"XXXX" + raw[4:], raw[:10]):
        with pytest.raises(IntegrityError):
            parse_header(bad)
    with pytest.raises(IntegrityError):
        BlockMeta.from_json({"hash": "x"})


@pytest.mark.parametrize("read_first", [False, True], ids=["cold", "after-a-good-read"])
@pytest.mark.parametrize("damage", ["truncate", "bitflip_header", "bitflip_payload", "delete", "trailing"])
def test_damaged_blocks_are_never_grafted(store_dir, damage, read_first):
    """Damage is caught on a block never read before and on one whose header the store has already
    checked (it then compares the header bytes instead of parsing them again)."""
    eng = tiny_engine("llama", store_dir)
    ids = _ids(70)
    eng.store_prefix(ids)
    rows = _chain_rows(eng, ids)
    if read_first:
        assert eng.forward(ids)[1].tokens_grafted == 64
        assert rows[1].hash in eng.store._checked_headers
    path = eng.store.block_path(rows[1].hash)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "bitflip_header":
        data[30] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "bitflip_payload":
        data[len(data) - 100] ^= 0x80
        path.write_bytes(bytes(data))
    elif damage == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(data) + b"\0")
    got, report = eng.forward(ids, keep_logits=True)
    assert report.tokens_grafted == 16 and report.fallback and report.quarantined == [rows[1].hash]
    assert torch.equal(got.prefill_logits, eng.recompute(ids).prefill_logits[16:])
    with pytest.raises(IntegrityError):  # a direct read is refused too
        eng.store.read_block(rows[1])


def test_newer_format_is_refused(store_dir):
    LocalStore(store_dir)
    (store_dir / "FORMAT").write_text(json.dumps({"format": STORE_FORMAT + 1}))
    with pytest.raises(StoreFormatError, match="newer"):
        LocalStore(store_dir)


def test_foreign_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreFormatError, match="not a kvmemory store"):
        LocalStore(tmp_path)


def test_read_only_store_serves_reads_and_refuses_writes(store_dir):
    eng = tiny_engine("llama", store_dir)
    ids = _ids(50)
    eng.store_prefix(ids)
    eng.store.close()
    store = LocalStore(store_dir, readonly=True)
    eng.store = store
    got, report = eng.forward(ids, keep_logits=True)
    assert report.tokens_grafted == 48
    with pytest.raises(StoreReadOnly):
        eng.store_prefix(_ids(40, seed=5))


def _mount(args: list[str]) -> bool:
    return subprocess.run(args, capture_output=True).returncode == 0


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs: a real full disk (this suite runs as root; elsewhere the test is skipped)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or not _mount(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    _mount(["umount", "-l", str(mnt)])


def test_full_disk_gives_a_clean_error_and_keeps_the_store(tiny_disk):
    eng = tiny_engine("llama", tiny_disk / "store")
    ids = _ids(40)
    eng.store_prefix(ids)  # fits
    before = eng.store.stats()
    with pytest.raises(StoreFull):
        for seed in range(10, 20):  # ~0.5 MB of blocks each: the 2 MiB disk fills up
            before = eng.store.stats()
            eng.store_prefix(_ids(1000, seed=seed))
    after = eng.store.stats()
    assert after.blocks == before.blocks and after.bytes == before.bytes  # the failed write left nothing
    assert not list((tiny_disk / "store" / "tmp").iterdir())
    got, report = eng.forward(ids + [3], keep_logits=True)
    assert report.tokens_grafted == 32 and report.fallback is None


def test_eviction_keeps_pinned_and_verified_blocks(store_dir):
    eng = tiny_engine("llama", store_dir)
    eng.store_prefix(_ids(64, seed=1), pinned=True)
    eng.store_prefix(_ids(64, seed=2), pinned=False)
    time.sleep(0.01)
    eng.store_prefix(_ids(64, seed=3), pinned=False)
    block = eng.store.stats().bytes // 12
    freed = eng.store.evict(max_bytes=8 * block)
    s = eng.store.stats()
    assert freed >= 4 * block and s.blocks == 8
    # The pinned prefix and the most recently used loose prefix survive.
    assert len(_chain_rows(eng, _ids(64, seed=1) + [0])) == 4
    assert len(_chain_rows(eng, _ids(64, seed=3) + [0])) == 4
    assert _chain_rows(eng, _ids(64, seed=2) + [0]) == []
    eng.store.evict(max_bytes=0)
    assert eng.store.stats().blocks == 4  # pinned ones are never evicted


WRITER = r"""
import sys, torch
sys.path.insert(0, {tests!r})
from tiny_models import tiny_engine
eng = tiny_engine("llama", {store!r})
i = {seed}
while True:
    ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(i)).tolist()
    eng.store_prefix(ids, pinned=False)
    print(i, flush=True)
    i += 1
"""


def test_killed_writers_leave_no_partial_blocks(store_dir):
    """Writers killed with SIGKILL at random points: the store opens, every catalogued block verifies."""
    tests = os.path.dirname(__file__)
    LocalStore(store_dir)
    import random

    rng = random.Random(0)
    kills = 0
    for k in range(6):
        p = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=tests, store=str(store_dir), seed=k * 1000)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        p.stdout.readline()  # it has started writing
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        kills += 1
    store = LocalStore(store_dir)
    s = store.stats()
    assert s.blocks > 0
    db = store._db()
    for (h,) in db.execute("SELECT hash FROM blocks"):
        store.read_block(store.get_block(h))  # raises on any damage
    visible = {p.stem for p in (store_dir / "blocks").rglob("*.kvb")}
    catalogued = {h for (h,) in db.execute("SELECT hash FROM blocks")}
    assert catalogued <= visible  # orphan files may exist (written, not committed); no missing ones
    print(f"{kills} writers killed; {s.blocks} blocks intact")


def _rw_worker(store_path, tests, role, seed, seconds, q):
    sys.path.insert(0, tests)
    from tiny_models import tiny_engine as te

    eng = te("llama", store_path)
    end = time.time() + seconds
    done = errors = 0
    i = seed
    while time.time() < end:
        ids = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(i % 6)).tolist()
        try:
            if role == "w":
                eng.store_prefix(ids, pinned=False)
            else:
                got, report = eng.forward(ids, keep_logits=True)
                if not torch.equal(got.prefill_logits, eng.recompute(ids).prefill_logits[report.tokens_grafted:]):
                    errors += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors += 1
            print(role, type(exc).__name__, exc, file=sys.stderr)
        done += 1
        i += 1
    q.put((role, done, errors))


def test_concurrent_writers_and_readers(store_dir):
    LocalStore(store_dir)
    tests = os.path.dirname(__file__)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rw_worker, args=(str(store_dir), tests, role, n * 3, 6.0, q))
             for n, role in enumerate("wwrr")]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(e == 0 for _, _, e in results), results
    assert sum(d for r, d, _ in results if r == "r") > 0
    print("ops (role, done, errors):", results)
