"""Multi-lane SHA-256 (kvmemory/kernels/sha256_lanes.py, kernels/csrc/sha256_lanes.cpp) and the graft reads that use it.

The digests must be SHA-256's, byte for byte (against hashlib), for every lane count and for
messages cut into segments; the reader must report truncated and extended files; a store read of a
group must catch every kind of damage in any one of its blocks; and a graft whose chain is read in
groups must give the recompute's logits exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from redis_server import expected_payload, synth_entry
from test_faults import _damage
from tiny_models import tiny_engine

from kvmemory.engine import graft
from kvmemory.kernels import sha256_lanes
from kvmemory.errors import IntegrityError
from kvmemory.store.local import LocalStore

pytestmark = pytest.mark.skipif(sha256_lanes.kind() is None,
                                reason="the lanes' SHA-256 runs on CPUs with AVX-512 or the SHA extensions only")


def test_builds_here():
    assert sha256_lanes.load() is not None, sha256_lanes.why_unavailable()


def test_loads_without_a_compiler_or_a_cache(tmp_path):
    """Nothing is compiled at run time: in a new process with no compiler on PATH and an empty cache
    folder the installed library loads and hashes, and the cache folder stays empty."""
    env = dict(os.environ, KVMEMORY_CACHE=str(tmp_path / "cache"), PATH=str(tmp_path / "no-bin"))
    env.pop("CXX", None)
    code = ("import hashlib; from kvmemory.kernels import sha256_lanes as s; b = [bytearray(b'x' * 640)] * 16; "
            "print('OK' if s.load() is not None and s.sha256_many(b) == [hashlib.sha256(b[0]).digest()] * 16 "
            "else 'FAILED: ' + str(s.why_unavailable()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("OK"), out.stdout + out.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("variant", ["avx512", "sha-ni"])
def test_every_build_compiles(variant, tmp_path):
    """Both builds compile from the checkout's sources, the one this CPU does not run included."""
    from kvmemory.kernels import build

    b = build.find("sha256", variant)
    build.compile_library(b, tmp_path)
    out = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / b.filename)], capture_output=True, text=True,
                         check=True).stdout
    assert {"kvm_sha256_lanes", "kvm_read_hash_lanes"} <= {line.split()[-1] for line in out.split("\n") if line}


@pytest.mark.parametrize("build", ["sha-ni", "avx512"])
def test_each_build_this_cpu_runs_passes_the_hash_and_reader_tests(tmp_path, build):
    """Both builds of the one source, not only the one this CPU picks by itself: the digest, segment and
    reader tests of this file run again in a fresh process with the build asked for (a build that were
    refused would skip them there, which fails here)."""
    if not sha256_lanes.builds_here()[build]:
        pytest.skip(f"this CPU does not run the {build} build")
    env = dict(os.environ, KVMEMORY_CACHE=str(tmp_path), KVMEMORY_SHA256_LANES=build)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "digests_are_sha256 or segments_hash or reader_fills or reader_stores or bad_arguments"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and " passed" in out.stdout and "skipped" not in out.stdout, out.stdout + out.stderr


def test_a_build_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv("KVMEMORY_SHA256_LANES", "neon")
    sha256_lanes.KERNEL_LIB.forget()
    try:
        assert sha256_lanes.kind() is None and "none of avx512, sha-ni, off" in sha256_lanes.why_unavailable()
        assert sha256_lanes.load() is None
    finally:
        monkeypatch.delenv("KVMEMORY_SHA256_LANES")
        sha256_lanes.KERNEL_LIB.forget()
    assert sha256_lanes.kind() is not None


@pytest.mark.parametrize("lanes", [1, 2, 9, 15, 16])
@pytest.mark.parametrize("size", [0, 64, 128, 4096, 1 << 20])
def test_digests_are_sha256(lanes, size):
    rng = random.Random(lanes * 7919 + size)
    bufs = [bytearray(rng.randbytes(size)) for _ in range(lanes)]
    assert sha256_lanes.sha256_many(bufs) == [hashlib.sha256(b).digest() for b in bufs]


def test_segments_hash_as_one_message():
    """Lane l's message is its segments in order, wherever they lie (here: interleaved rows of one array)."""
    lib = sha256_lanes.load()
    lanes, nseg, seg = 13, 7, 192
    data = np.frombuffer(os.urandom(lanes * nseg * seg), dtype=np.uint8).reshape(nseg, lanes, seg).copy()
    addrs = np.array([[data[k, l].ctypes.data for k in range(nseg)] for l in range(lanes)], dtype=np.uint64)
    out = np.empty(32 * lanes, dtype=np.uint8)
    assert lib.kvm_sha256_lanes(lanes, nseg, seg, addrs, out) == 0
    for l in range(lanes):
        assert out[32 * l : 32 * l + 32].tobytes() == hashlib.sha256(data[:, l].tobytes()).digest()


def test_bad_arguments_are_refused():
    lib = sha256_lanes.load()
    out = np.empty(32 * 17, dtype=np.uint8)
    addrs = np.zeros(17, dtype=np.uint64)
    assert lib.kvm_sha256_lanes(17, 1, 64, addrs, out) == -1  # more lanes than the register holds
    assert lib.kvm_sha256_lanes(1, 1, 65, addrs, out) == -1  # segments not whole 64-byte blocks
    with pytest.raises(ValueError):
        sha256_lanes.sha256_many([bytearray(64), bytearray(128)])


def test_reader_fills_hashes_and_reports_file_ends(tmp_path):
    """Each lane's segments get its file's bytes after the header; short and long files, a missing file
    and a header unlike the one expected are reported, each lane on its own."""
    head, nseg, seg = 64, 5, 256
    payloads = [os.urandom(nseg * seg) for _ in range(14)]
    extra = {3: b"", 7: b"x"}  # lane 3 truncated (below), lane 7 one byte too long
    paths = [tmp_path / f"{l}.bin" for l in range(14)]
    for l, p in enumerate(payloads):
        body = p[: nseg * seg - 100] if l == 3 else p + extra.get(l, b"")
        if l != 12:  # lane 12's file is missing
            paths[l].write_bytes((b"H" if l == 13 else b"h") * head + body)  # lane 13's header differs
    dest = np.zeros((14, nseg, seg), dtype=np.uint8)
    addrs = np.array([[dest[l, k].ctypes.data for k in range(nseg)] for l in range(14)], dtype=np.uint64)
    heads = [b"h" * head] * 13 + [b"h" * head]
    got, digests = sha256_lanes.read_hash_lanes(paths, [head] * 14, addrs, seg, heads, slab=2)
    assert got[12] == sha256_lanes.MISSING and got[13] == sha256_lanes.HEAD_CHANGED
    for l, p in enumerate(payloads[:12]):
        if l == 3:
            assert got[l] == nseg * seg - 100
            continue
        assert got[l] == nseg * seg + (1 if l == 7 else 0)
        assert dest[l].tobytes() == p
        assert digests[l] == hashlib.sha256(p).digest()
    # Without expected heads the header bytes are not looked at (the bench's raw read does this).
    got, digests = sha256_lanes.read_hash_lanes(paths[13:], [head], addrs[13:], seg)
    assert got == [nseg * seg] and digests[0] == hashlib.sha256(payloads[13]).digest()
    with pytest.raises(ValueError):  # a head that is not its offset's length
        sha256_lanes.read_hash_lanes(paths[:1], [head], addrs[:1], seg, [b"h"])
    # Without segments nothing is stored: read and hashed only (the bench's raw floor).
    dest[:] = 0
    got, digests = sha256_lanes.read_hash_lanes(paths[:3], [head] * 3, None, seg, nseg=nseg)
    assert got == [nseg * seg, nseg * seg, nseg * seg] and not dest.any()
    assert digests == [hashlib.sha256(p).digest() for p in payloads[:3]]
    with pytest.raises(ValueError):
        sha256_lanes.read_hash_lanes(paths[:3], [head] * 3, None, seg)  # how many segments, then?


@pytest.mark.parametrize("misalign", [0, 16])
@pytest.mark.parametrize("lanes,nseg,seg,slab", [(16, 9, 4096, 4), (11, 3, 320 << 10, 16), (3, 5, 1 << 20, 16)])
def test_reader_stores_what_it_hashed(tmp_path, misalign, lanes, nseg, seg, slab):
    """The reader reads slabs into its own scratch and stores them into the segments: non-temporal
    stores into 64-byte aligned segments (misalign 0), plain ones elsewhere (16), slabs cut short
    where every lane's would pass the scratch's 4 MB (320 KB and 1 MB segments). Either way every
    byte lands in place and the digests are SHA-256's; a lane whose file ends inside a slab keeps
    what came before that slab and has nothing of it stored."""
    payloads = [os.urandom(nseg * seg) for _ in range(lanes)]
    paths = [tmp_path / f"{l}.bin" for l in range(lanes)]
    short = lanes - 1  # this lane's file ends 100 bytes into its last segment
    for l, p in enumerate(payloads):
        paths[l].write_bytes(b"h" * 64 + (p[: (nseg - 1) * seg + 100] if l == short else p))
    room = torch.zeros(lanes * nseg * seg + 64, dtype=torch.uint8)  # torch's CPU buffers: 64-byte aligned
    assert room.data_ptr() % 64 == 0
    dest = room.numpy()[misalign : misalign + lanes * nseg * seg].reshape(nseg, lanes, seg)  # interleaved, as cache rows
    addrs = np.array([[dest[k, l].ctypes.data for k in range(nseg)] for l in range(lanes)], dtype=np.uint64)
    got, digests = sha256_lanes.read_hash_lanes(paths, [64] * lanes, addrs, seg, [b"h" * 64] * lanes, slab=slab)
    for l, p in enumerate(payloads):
        if l == short:
            assert got[l] == (nseg - 1) * seg + 100
            per_slab = min(slab, max(1, (4 << 20) // (lanes * seg)))  # rows per slab, as the reader cuts them
            stored = (nseg - 1) // per_slab * per_slab
            assert dest[:stored, l].tobytes() == p[: stored * seg]  # the slabs read whole
            assert not dest[stored:, l].any()  # the slab read short: hashed, never stored
            continue
        assert got[l] == nseg * seg
        assert dest[:, l].tobytes() == p
        assert digests[l] == hashlib.sha256(p).digest()


def _segments(buffers):
    """A `place` for LocalStore.read_blocks_lanes: each block's payload into its own buffer, in 64-byte-
    multiple segments."""
    def place(meta):
        buf = buffers.setdefault(meta.hash, np.zeros(meta.payload_nbytes, dtype=np.uint8))
        seg = 256
        return buf.ctypes.data + np.arange(meta.payload_nbytes // seg, dtype=np.uint64) * np.uint64(seg), seg
    return place


def test_group_reads_catch_every_damage(tmp_path):
    """As test_faults' damage test, through the grouped read: one damaged block among 12 is refused and
    quarantined, the 11 others are read byte-exact, 150 times over every kind of damage."""
    store = LocalStore(tmp_path / "s")
    made = [synth_entry(i, n_blocks=3, shared=0) for i in range(4)]
    for e, b in made:
        store.commit_entry(e, b)
    blocks = {m.hash: (m, p) for _, bl in made for m, p in bl}
    hashes = sorted(blocks)
    assert len(hashes) == 12
    rng = random.Random(7)
    kinds = {}
    for _ in range(150):
        bad = rng.choice(hashes)
        path = store.block_path(bad)
        damaged, how = _damage(path.read_bytes(), rng)
        path.write_bytes(damaged)
        kinds[how] = kinds.get(how, 0) + 1
        buffers = {}
        out = store.read_blocks_lanes([store.get_block(h) for h in hashes], _segments(buffers))
        for h, res in zip(hashes, out):
            if h == bad:
                assert isinstance(res, IntegrityError), f"{how} damage was not detected"
            else:
                assert res.hash == h and buffers[h].tobytes() == expected_payload(h)
        assert store.get_block(bad).quarantined
        store.put_blocks([blocks[bad]])  # write it again: replaces the quarantined copy
    assert set(kinds) == {"bitflip", "truncate", "extend", "overwrite"}


@pytest.mark.parametrize("seen", [False, True], ids=["header-unread", "header-checked-before"])
def test_missing_file_in_a_group_is_refused(tmp_path, seen):
    """A missing file is refused and quarantined whether its header was checked before (the reader
    finds it gone) or not (the header check does)."""
    store = LocalStore(tmp_path / "s")
    made = [synth_entry(i, n_blocks=3, shared=0) for i in range(4)]
    for e, b in made:
        store.commit_entry(e, b)
    hashes = sorted(m.hash for _, bl in made for m, _ in bl)
    if seen:
        store.read_blocks_lanes([store.get_block(h) for h in hashes], _segments({}))
        assert hashes[5] in store._checked_headers
    store.block_path(hashes[5]).unlink()
    buffers = {}
    out = store.read_blocks_lanes([store.get_block(h) for h in hashes], _segments(buffers))
    assert isinstance(out[5], IntegrityError) and "missing" in str(out[5])
    assert store.get_block(hashes[5]).quarantined
    assert all(buffers[h].tobytes() == expected_payload(h) for i, h in enumerate(hashes) if i != 5)


def test_header_damaged_after_it_was_checked_is_caught(tmp_path):
    """The reader compares each file's header with the one checked before: one flipped header byte
    sends the block back to a full check, which refuses and quarantines it; the others are read."""
    store = LocalStore(tmp_path / "s")
    made = [synth_entry(i, n_blocks=3, shared=0) for i in range(4)]
    for e, b in made:
        store.commit_entry(e, b)
    hashes = sorted(m.hash for _, bl in made for m, _ in bl)
    store.read_blocks_lanes([store.get_block(h) for h in hashes], _segments({}))
    path = store.block_path(hashes[2])
    data = bytearray(path.read_bytes())
    data[40] ^= 0x04  # inside the header's JSON
    path.write_bytes(bytes(data))
    buffers = {}
    out = store.read_blocks_lanes([store.get_block(h) for h in hashes], _segments(buffers))
    assert isinstance(out[2], IntegrityError)
    assert store.get_block(hashes[2]).quarantined
    assert all(buffers[h].tobytes() == expected_payload(h) for i, h in enumerate(hashes) if i != 2)


def _spy(store, monkeypatch):
    calls = []
    real = store.read_blocks_lanes

    def spy(rows, place):
        calls.append(len(rows))
        return real(rows, place)

    monkeypatch.setattr(store, "read_blocks_lanes", spy)
    return calls


def _stored_chain(tmp_path, monkeypatch, seed, dtype=torch.float32):
    """A tiny engine (two reader threads) whose store holds a chain of 40 blocks of 16 tokens, the
    prompt (the chain + 9 tokens) and the chain's catalogue rows."""
    monkeypatch.setattr(graft, "_READ_THREADS", 2)
    eng = tiny_engine("llama", tmp_path / "s", dtype)
    ids = torch.randint(0, 512, (40 * 16 + 9,), generator=torch.Generator().manual_seed(seed)).tolist()
    eng.store_prefix(ids[: 40 * 16])
    return eng, ids, graft.plan_chain(eng.store, eng.profile_id, ids, 16)


def _flip(store, row, offset: int, bit: int) -> None:
    path = store.block_path(row.hash)
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


def _graft_matches_recompute(eng, ids, new_tokens: int):
    """Graft and recompute `ids`; asserts every logit after the graft point is byte-equal. Returns the report."""
    got, rep = eng.forward(ids, max_new_tokens=new_tokens, stop_token_ids=(), keep_logits=True)
    ref = eng.recompute(ids, max_new_tokens=new_tokens, stop_token_ids=())
    assert torch.equal(got.prefill_logits, ref.prefill_logits[rep.tokens_grafted :])
    assert torch.equal(got.decode_logits, ref.decode_logits)
    return rep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graft_read_in_groups_is_exact(tmp_path, monkeypatch, dtype):
    """A chain of 40 blocks is read in groups (the spy sees them) and the grafted logits equal the
    recompute's, byte for byte."""
    eng, ids, _ = _stored_chain(tmp_path, monkeypatch, 3, dtype)
    calls = _spy(eng.store, monkeypatch)
    rep = _graft_matches_recompute(eng, ids, 3)
    assert calls == [14, 14, 12]  # 40 blocks: three groups of at most 16 for two threads
    assert rep.tokens_grafted == 640 and not rep.quarantined


def test_graft_cut_at_a_damaged_block_in_a_group(tmp_path, monkeypatch):
    """A bit flipped in block 25 of 40: the grouped read refuses it, the chain is cut before it, and the
    rest is recomputed — the logits still equal the recompute's."""
    eng, ids, rows = _stored_chain(tmp_path, monkeypatch, 4)
    _flip(eng.store, rows[25], -1000, 0x10)
    calls = _spy(eng.store, monkeypatch)
    rep = _graft_matches_recompute(eng, ids, 2)
    assert calls == [14, 14, 12]
    assert rep.quarantined == [rows[25].hash] and rep.tokens_grafted == 25 * 16


def test_without_the_lanes_blocks_are_read_one_by_one(tmp_path, monkeypatch):
    """Where the library cannot be built, the same chain is read block by block (hashlib), as exactly."""
    monkeypatch.setattr(sha256_lanes, "load", lambda: None)
    eng, ids, _ = _stored_chain(tmp_path, monkeypatch, 5)
    calls = _spy(eng.store, monkeypatch)
    rep = _graft_matches_recompute(eng, ids, 2)
    assert calls == [] and rep.tokens_grafted == 640


@pytest.mark.parametrize("where", ["header", "payload"])
def test_damaged_first_block(tmp_path, monkeypatch, where):
    """The cache is shaped on the first block's header, read before the rest: a damaged header stops the
    graft before any payload is read, a damaged payload is caught in its group; either way nothing is
    grafted and the logits are the recompute's."""
    eng, ids, rows = _stored_chain(tmp_path, monkeypatch, 6)
    _flip(eng.store, rows[0], 20 if where == "header" else -10, 0x01)
    calls = _spy(eng.store, monkeypatch)
    rep = _graft_matches_recompute(eng, ids, 2)
    assert calls == ([] if where == "header" else [14, 14, 12])
    assert rep.quarantined == [rows[0].hash] and rep.tokens_grafted == 0


def test_a_block_claiming_a_far_position_is_refused_before_any_write(tmp_path, monkeypatch):
    """Blocks are read into the cache through raw addresses: one whose header and catalogue row agree on
    an index far past the chain (a crafted store) is refused by `place`, never written out of bounds."""
    eng, ids, rows = _stored_chain(tmp_path, monkeypatch, 8)
    real = eng.store.read_blocks_lanes
    seen = []

    def far(rows_, place):
        def shifted(meta):  # the header says index 10**6 (as a crafted file + row would)
            m = dataclasses.replace(meta, index=10**6, position=10**6 * 16) if meta.hash == rows[30].hash else meta
            try:
                return place(m)
            except IntegrityError as exc:
                seen.append(str(exc))
                raise
        return real(rows_, shifted)

    monkeypatch.setattr(eng.store, "read_blocks_lanes", far)
    rep = _graft_matches_recompute(eng, ids, 1)
    assert seen and "claims position 16000000, not 480" in seen[0]  # its own place in the chain, checked first
    assert rep.tokens_grafted == 30 * 16
