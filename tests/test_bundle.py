"""Portable bundles (`kvmemory export` / `kvmemory import`): the format, the round trip between two
stores (grafts there byte-equal to a recompute), chosen entries and namespaces, idempotence, signed
stores, damaged bundles refused with the target store byte-for-byte unchanged, foreign profiles
refused by name, a forged bundle caught by the proof on arrival, an export killed mid-way, and an
import into Redis in another process through the CLI.

Format tests use a tiny random-init llama (tests/tiny_models.py) and entries made from token ids;
the round trip that ends in `ask` / `recall`, the foreign KV dtype and the CLI use the embedded model.
Exactness is byte equality only (`torch.equal` on logits, `==` on payload bytes).

Untested (no GPU was lent when this was written): a CPU export refused by profile on a GPU machine,
and an export / import between two runs on the GPU machine shown exact.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_engine

from kvmemory.engine.engine import Engine
from kvmemory.errors import BundleError, InvalidInput, ProfileMismatch, UnknownEntry
from kvmemory.memory.facade import KVMemory
from kvmemory.memory.layout import entry_probe
from kvmemory.memory.ids import entry_id_for
from kvmemory.memory.prompts import entry_messages, render_ids
from kvmemory.store.bundle import MANIFEST_JSON, PREFIX, block_member, read_bundle, write_bundle
from kvmemory.store.local import EntryRecord, LocalStore
from kvmemory.store.signing import SignedLocalStore

KEY = "6b" * 32
C = 16  # the tiny engines' chunk grid


# ---------------------------------------------------------------------- helpers
def _texts(seed: int, shared: bool, tokenizer, n: int = 70) -> tuple[str, str, str, list[int]]:
    """Texts whose rendering is `n` token ids (entries check against themselves: their texts must
    render to their ids, memory/entry_check.py); `shared` entries begin with the same first block."""
    solution, answer = f"Worked solution {seed}.", str(seed)
    head = "Shared, " if shared else f"{seed:03d} own, "
    problem = f"{head}{seed}: how many"
    while True:
        ids = render_ids(tokenizer, entry_messages(problem, solution, answer))
        if len(ids) >= n:
            assert len(ids) == n, "pad by one character at a time"
            return problem, solution, answer, ids
        problem += "?"


def add_entry(mem: KVMemory, seed: int, namespace: str = "default", shared: bool = False) -> EntryRecord:
    """An entry made as `remember` makes one (compute, write, prove the graft, commit), without running a
    verifier (the tiny model's tokenizer speaks in bytes)."""
    eng = mem.engine
    problem, solution, answer, ids = _texts(seed, shared, eng.tokenizer)
    # its ids and the probe question after them, cut at its end (memory/layout.py), as remember proves
    probe = entry_probe(eng.tokenizer, ids, problem, solution, answer)
    ref, blocks = eng.compute_blocks(probe.ids, max_new_tokens=4, cuts=probe.cuts, upto=len(ids))
    eng.store.write_block_files(blocks)
    vr = eng.verify_tokens(probe.ids, decode_tokens=4, single_pass=False, reference=ref, rows=eng.rows_for(blocks),
                           cuts=probe.cuts)
    assert vr.bit_identical
    now = time.time()
    e = EntryRecord(id=entry_id_for(namespace, problem, solution, answer, eng.profile_id), namespace=namespace,
                    problem=problem, solution=solution, answer=answer,
                    verifier={"name": "none", "version": "0", "ok": True, "detail": ""}, verified=True,
                    token_ids=tuple(ids), profile_id=eng.profile_id, chain=tuple(m.hash for m, _ in blocks),
                    attestation=vr.attestation, meta={"aliases": []}, created=now, updated=now)
    eng.store.commit_entry(e, blocks)
    return e


def tiny_memory(path, *, store=None, chunk: int = C) -> KVMemory:
    eng = tiny_engine("llama", path, chunk=chunk)
    if store is not None:
        eng = Engine(eng.loaded, store, chunk=chunk)
    return KVMemory(eng)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under a store folder, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def members_of(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path, "r:") as tf:
        return [(ti.name, tf.extractfile(ti).read()) for ti in tf.getmembers()]


def write_tar(path: Path, members: list[tuple[str, bytes]], *, manifest: str = "rebuild",
              links: tuple[str, ...] = ()) -> Path:
    """A tar of `members` (name, bytes) in order. manifest="rebuild": the old manifest dropped and a
    new one (true sizes and SHA-256s) appended last; "keep": members written as given."""
    if manifest == "rebuild":
        members = [(n, d) for n, d in members if n != MANIFEST_JSON]
        listed = [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in members]
        members = members + [(MANIFEST_JSON, json.dumps({"format": "kvmemory-bundle", "version": 1,
                                                         "members": listed}).encode())]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name in links:
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(ti)
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def edit_json(members, name, fn):
    return [(n, json.dumps(fn(json.loads(d))).encode() if n == name else d) for n, d in members]


# ---------------------------------------------------------------------- tiny-model fixtures
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A store with four entries: three in "default" (two sharing their first block) and one in "team"."""
    mem = tiny_memory(tmp_path_factory.mktemp("src") / "store")
    entries = [add_entry(mem, 1, shared=True), add_entry(mem, 2, shared=True), add_entry(mem, 3),
               add_entry(mem, 4, namespace="team")]
    bundle = tmp_path_factory.mktemp("out") / "all.kvmb"
    report = mem.export_bundle(bundle)
    return mem, entries, bundle, report


@pytest.fixture
def target(tmp_path):
    """A fresh store under the same profile, already holding one entry of its own."""
    mem = tiny_memory(tmp_path / "target")
    add_entry(mem, 50)
    return mem


# ---------------------------------------------------------------------- format
def test_bundle_layout_manifest_last_every_member_hashed(source):
    mem, entries, bundle, report = source
    names = [n for n, _ in members_of(bundle)]
    assert names[:3] == [PREFIX + "bundle.json", PREFIX + "profiles.json", PREFIX + "entries.json"]
    assert names[-2:] == [PREFIX + "catalogue.json", MANIFEST_JSON]  # the manifest is the last member
    blocks = list(dict.fromkeys(h for e in entries for h in e.chain))
    # 70 tokens = 4 blocks of 16 and a 6-token tail block each; the shared first block once
    assert len(blocks) == 4 * 5 - 1
    assert names[3:-2] == [block_member(h) for h in blocks]
    data = dict(members_of(bundle))
    manifest = json.loads(data[MANIFEST_JSON])
    assert [m["name"] for m in manifest["members"]] == names[:-1]
    for m in manifest["members"]:
        assert m["size"] == len(data[m["name"]]) and m["sha256"] == hashlib.sha256(data[m["name"]]).hexdigest()
    # Block members are the payload bytes exactly as the store holds them; the catalogue has their headers.
    rows = mem.store.known_blocks(blocks)
    for h in blocks:
        meta, payload = mem.store.read_block(rows[h])
        assert data[block_member(h)] == bytes(payload)
        assert hashlib.sha256(data[block_member(h)]).hexdigest() == meta.payload_sha256
    catalogue = json.loads(data[PREFIX + "catalogue.json"])["blocks"]
    assert [b["hash"] for b in catalogue] == blocks
    profiles = json.loads(data[PREFIX + "profiles.json"])
    assert profiles == {mem.engine.profile_id: mem.engine.profile.to_dict()}
    got = json.loads(data[PREFIX + "entries.json"])
    assert [g["id"] for g in got] == [e.id for e in entries]
    assert all(g["token_ids"] == list(e.token_ids) and g["attestation"] == e.attestation for g, e in zip(got, entries))
    # No pickle anywhere: every member is either JSON or a block's payload bytes as the store holds them.
    for name, d in data.items():
        if name not in {block_member(h) for h in blocks}:
            json.loads(d.decode("utf-8"))
    # The report: counts, sizes and the file's own SHA-256.
    raw = bundle.read_bytes()
    assert report.sha256 == hashlib.sha256(raw).hexdigest() and report.bytes == len(raw)
    assert report.to_json()["entries"] == 4 and report.blocks == 19  # 4 x (4 whole + 1 tail) - the shared first
    assert report.payload_bytes == sum(len(data[block_member(h)]) for h in blocks)
    assert read_bundle(bundle).sha256 == report.sha256


def test_export_a_namespace_or_chosen_entries_only(source, tmp_path):
    mem, entries, _, _ = source
    team = mem.export_bundle(tmp_path / "team.kvmb", namespace="team")
    b = read_bundle(tmp_path / "team.kvmb")
    assert team.entry_ids == [entries[3].id] and [e.id for e in b.entries] == [entries[3].id]
    assert list(b.blocks) == list(entries[3].chain)
    chosen = mem.export_bundle(tmp_path / "two.kvmb", entry_ids=[entries[2].id, entries[0].id, entries[2].id])
    b = read_bundle(tmp_path / "two.kvmb")
    assert chosen.entry_ids == [entries[2].id, entries[0].id] == [e.id for e in b.entries]
    assert set(b.blocks) == set(entries[2].chain) | set(entries[0].chain)
    with pytest.raises(UnknownEntry):
        mem.export_bundle(tmp_path / "x.kvmb", entry_ids=[entries[3].id], namespace="default")
    with pytest.raises(InvalidInput, match="nothing to export"):
        mem.export_bundle(tmp_path / "x.kvmb", namespace="nobody")
    assert not (tmp_path / "x.kvmb").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["team.kvmb", "two.kvmb"]  # no partial file left


# ---------------------------------------------------------------------- round trip
def test_import_round_trip_grafts_byte_equal_to_a_recompute(source, target):
    src, entries, bundle, export = source
    before = target.store.stats()
    report = target.import_bundle(bundle)
    assert report.ok and report.sha256 == export.sha256
    assert report.imported == [e.id for e in entries] and report.skipped == []
    assert report.blocks == 19 and report.blocks_new == 19
    v = report.verify
    assert report.proof == "sample" and v["checked"] == 3 and v["bit_identical"] == 3
    assert v["attestation_match"] == 3 and v["kl_max"] == 0.0 and v["argmax_agreement"] == 1.0
    assert target.store.stats().entries == before.entries + 4
    eng = target.engine
    for e in entries:
        assert target.store.get_entry(e.id) == e  # every field as exported
        rows = target.store.known_blocks(list(e.chain))
        src_rows = src.store.known_blocks(list(e.chain))
        for h in e.chain:  # the same payload bytes, block by block
            assert bytes(target.store.read_block(rows[h])[1]) == bytes(src.store.read_block(src_rows[h])[1])
        got, rep = eng.forward(list(e.token_ids), max_new_tokens=4, stop_token_ids=(), keep_logits=True)
        ref = eng.recompute(list(e.token_ids), max_new_tokens=4)
        assert rep.tokens_grafted == 64 and set(rep.blocks_used) <= set(e.chain)
        assert torch.equal(got.prefill_logits, ref.prefill_logits[64:])
        assert torch.equal(got.decode_logits, ref.decode_logits) and got.generated == ref.generated
    # The router knows them: recall finds each by its problem, in its own namespace.
    assert target.recall(entries[2].problem, k=1)[0].entry.id == entries[2].id
    assert target.recall(entries[3].problem, k=1, namespace="team")[0].entry.id == entries[3].id


def test_importing_twice_adds_nothing(source, target):
    _, entries, bundle, _ = source
    first = target.import_bundle(bundle, verify_all=True)
    assert first.ok and first.proof == "all" and first.verify["checked"] == 4 == first.verify["bit_identical"]
    # SQLite readers write their read marks into the WAL index (-shm) by design: it is no content.
    before = {k: v for k, v in snapshot(target.store.path).items() if not k.endswith("-shm")}
    again = target.import_bundle(bundle)
    assert again.ok and again.imported == [] and again.skipped == [e.id for e in entries]
    assert again.verify["checked"] == 0 and again.blocks_new == 0
    after = {k: v for k, v in snapshot(target.store.path).items() if not k.endswith("-shm")}
    assert after == before  # byte for byte: nothing written


def test_partial_overlap_imports_only_what_is_missing(source, tmp_path):
    src, entries, _, _ = source
    src.export_bundle(tmp_path / "one.kvmb", entry_ids=[entries[0].id])
    dst = tiny_memory(tmp_path / "dst")
    assert dst.import_bundle(tmp_path / "one.kvmb").imported == [entries[0].id]
    src.export_bundle(tmp_path / "two.kvmb", entry_ids=[entries[0].id, entries[1].id])
    r = dst.import_bundle(tmp_path / "two.kvmb", sample=0)
    assert r.imported == [entries[1].id] and r.skipped == [entries[0].id]
    assert r.blocks_new == 4 and r.proof == "none" and r.verify["checked"] == 0  # 3 whole + the tail; the shared block was there
    assert dst.verify().bit_identical == 2


# ---------------------------------------------------------------------- signed stores
def test_into_a_signed_store_every_entry_is_proved_then_signed_with_its_key(source, tmp_path):
    _, entries, bundle, _ = source
    signed = SignedLocalStore(tmp_path / "signed", signer=KEY)
    mem = tiny_memory(tmp_path / "unused", store=signed)
    r = mem.import_bundle(bundle, sample=1)
    assert r.ok and r.proof == "all (signed store)" and r.verify["checked"] == 4 == r.verify["bit_identical"]
    reader = SignedLocalStore(tmp_path / "signed", signer=KEY)
    assert [e.id for e in reader.list_entries()] == [e.id for e in entries] and reader.rejected == []
    other = SignedLocalStore(tmp_path / "signed", signer="another key of 32 chars, not ours")
    assert other.list_entries() == [] and len(other.rejected) == 4  # signed with the target's key, no other
    # Export from the signed store carries no signatures, and imports anywhere under the same profile.
    out = mem.export_bundle(tmp_path / "from-signed.kvmb", namespace="default")
    assert b"v1:" not in (tmp_path / "from-signed.kvmb").read_bytes()
    plain = tiny_memory(tmp_path / "plain")
    assert plain.import_bundle(tmp_path / "from-signed.kvmb").imported == out.entry_ids


def test_a_namespace_scoped_store_refuses_other_namespaces_untouched(source, tmp_path):
    _, _, bundle, _ = source
    scoped = SignedLocalStore(tmp_path / "scoped", signer=KEY, namespace="team")
    mem = tiny_memory(tmp_path / "unused", store=scoped)
    before = snapshot(scoped.path)
    with pytest.raises(InvalidInput, match="scoped to namespace 'team'"):
        mem.import_bundle(bundle)
    assert snapshot(scoped.path) == before


# ---------------------------------------------------------------------- refusals
def _flip(path: Path, name: str, at: int = 0, dst: Path | None = None) -> Path:
    with tarfile.open(path, "r:") as tf:
        off = tf.getmember(name).offset_data
    raw = bytearray(path.read_bytes())
    raw[off + at] ^= 0x40
    dst = dst or path
    dst.write_bytes(bytes(raw))
    return dst


def _forge_payload(members, h: str, at: int = 3):
    """Alter a block's payload and make every hash agree with it (what a forger, not damage, does)."""
    out = []
    for n, d in members:
        if n == block_member(h):
            d = bytearray(d)
            d[at] ^= 0x80  # a K value's sign (float32, little endian: byte 3 holds it)
            d = bytes(d)
            new_sha = hashlib.sha256(d).hexdigest()
        out.append((n, d))
    return edit_json(out, PREFIX + "catalogue.json",
                     lambda c: {"blocks": [{**b, "payload_sha256": new_sha} if b["hash"] == h else b
                                           for b in c["blocks"]]})


def damaged_bundles(good: Path, tmp: Path, first_block: str):
    members = members_of(good)
    raw = good.read_bytes()
    with tarfile.open(good, "r:") as tf:
        manifest_end = tf.getmember(MANIFEST_JSON).offset_data + tf.getmember(MANIFEST_JSON).size
    blk = block_member(first_block)
    not_last = [m for m in members if m[0] == MANIFEST_JSON] + [m for m in members if m[0] != MANIFEST_JSON]
    return {
        "flipped byte in a block member": (_flip(good, blk, 100, tmp / "flip.kvmb"),
                                           "SHA-256 does not match the manifest"),
        "truncated inside a block": (_w(tmp / "t1.kvmb", raw[: len(raw) // 2]), "truncated|not a complete"),
        "truncated inside the manifest's padding": (_w(tmp / "t2.kvmb", raw[: manifest_end + 100]), "truncated"),
        "truncated before the end marker": (_w(tmp / "t3.kvmb", raw[: manifest_end + (-manifest_end % 512)]),
                                            "end-of-archive marker is missing"),
        "manifest missing": (write_tar(tmp / "nomani.kvmb", [m for m in members if m[0] != MANIFEST_JSON],
                                       manifest="keep"), "no manifest"),
        "manifest not last": (write_tar(tmp / "first.kvmb", not_last, manifest="keep"), "not the last member"),
        "extra member": (write_tar(tmp / "extra.kvmb", members[:-1] + [(PREFIX + "run.sh", b"#!/bin/sh\n")]),
                         "unknown member"),
        "extra block member outside the manifest": (
            write_tar(tmp / "extra2.kvmb", members[:-1] + [(block_member("ab" * 32), b"x" * 8), members[-1]],
                      manifest="keep"), "not in the manifest"),
        "../ member name": (write_tar(tmp / "dotdot.kvmb", members[:-1] + [(PREFIX + "../../evil.json", b"{}")]),
                            "path-traversing"),
        "absolute member name": (write_tar(tmp / "abs.kvmb", members[:-1] + [("/tmp/evil.json", b"{}")]),
                                 "path-traversing"),
        "symbolic link member": (write_tar(tmp / "link.kvmb", members, links=(PREFIX + "profiles.json",)),
                                 "symbolic link"),
        "duplicate member": (write_tar(tmp / "dup.kvmb", members[:-1] + [members[0]]), "appears twice"),
        "member hash matches the manifest, block hash does not": (
            write_tar(tmp / "blockhash.kvmb", [(n, (d[:10] + bytes([d[10] ^ 1]) + d[11:]) if n == blk else d)
                                               for n, d in members]),
            "does not match the block's recorded payload_sha256"),
        "chain incomplete": (write_tar(tmp / "chain.kvmb", edit_json(
            [m for m in members if m[0] != blk], PREFIX + "catalogue.json",
            lambda c: {"blocks": [b for b in c["blocks"] if b["hash"] != first_block]})), "chain is incomplete"),
        "block header not its chain": (write_tar(tmp / "header.kvmb", edit_json(
            members, PREFIX + "catalogue.json",
            lambda c: {"blocks": [{**b, "token_ids": [7] * len(b["token_ids"])} if b["hash"] == first_block else b
                                  for b in c["blocks"]]})), "not self-consistent"),
        "entry tokens not its chain": (write_tar(tmp / "tokens.kvmb", edit_json(
            members, PREFIX + "entries.json",
            lambda es: [{**e, "token_ids": [1] + e["token_ids"][1:]} for e in es])), "not the chain of its own"),
        "entry id not its content": (write_tar(tmp / "id.kvmb", edit_json(
            members, PREFIX + "entries.json", lambda es: [{**e, "problem": e["problem"] + "!"} for e in es])),
            "id is not the hash"),
        "data appended": (_w(tmp / "append.kvmb", raw + b"trailing"), "after the last member"),
        "not a tar": (_w(tmp / "random.kvmb", os.urandom(4096)), "not a complete uncompressed tar"),
        "compressed": (_w(tmp / "gz.kvmb", __import__("gzip").compress(raw)), "not a complete uncompressed tar"),
        "newer bundle version": (write_tar(tmp / "v2.kvmb", edit_json(
            members, PREFIX + "bundle.json", lambda b: {**b, "version": 2})), "newer kvmemory"),
    }


def _w(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_damaged_bundles_are_refused_and_the_target_is_untouched(source, target, tmp_path):
    _, entries, bundle, _ = source
    cases = damaged_bundles(bundle, tmp_path, entries[0].chain[0])
    before = snapshot(target.store.path)
    for what, (path, message) in cases.items():
        with pytest.raises(BundleError, match=message) as err:
            target.import_bundle(path)
        assert snapshot(target.store.path) == before, f"{what}: the target changed"
        assert str(err.value), what
    assert target.import_bundle(bundle).ok  # the good one still imports


def test_a_forged_bundle_is_caught_by_the_proof_and_nothing_is_imported(source, target, tmp_path):
    """Consistent hashes over altered K/V pass every check of the file; the proof on arrival catches it."""
    src, entries, _, _ = source
    one = src.export_bundle(tmp_path / "one.kvmb", entry_ids=[entries[2].id])
    forged = write_tar(tmp_path / "forged.kvmb", _forge_payload(members_of(Path(one.out)), entries[2].chain[1]))
    assert read_bundle(forged).entries[0].id == entries[2].id  # the file itself checks
    ids_before = target.store.entry_ids()
    r = target.import_bundle(forged)
    assert not r.ok and r.failed == [entries[2].id] and r.imported == []
    (res,) = r.verify["entries"]
    assert res["bit_identical"] is False and res["ok"] is False
    assert target.store.entry_ids() == ids_before  # nothing committed
    assert target.store.known_blocks(list(entries[2].chain)) == {}  # no block catalogued either


def test_another_profile_is_refused_by_name_and_the_target_is_untouched(source, tmp_path):
    _, _, bundle, _ = source
    other = tiny_memory(tmp_path / "c32", chunk=32)
    before = snapshot(other.store.path)
    with pytest.raises(ProfileMismatch, match="chunk: stored 16 vs current 32") as err:
        other.import_bundle(bundle)
    assert "chunk" in err.value.fields
    assert snapshot(other.store.path) == before
    # A profile altered to read like this machine's under its old id is caught too.
    members = edit_json(members_of(bundle), PREFIX + "profiles.json",
                        lambda p: {pid: other.engine.profile.to_dict() for pid in p})
    with pytest.raises(BundleError, match="under another id"):
        other.import_bundle(write_tar(tmp_path / "relabelled.kvmb", members))
    assert snapshot(other.store.path) == before


# ---------------------------------------------------------------------- atomic export
_KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from kvmemory.store.local import LocalStore
from kvmemory.store.bundle import write_bundle
calls = [0]
real = LocalStore.read_block
def read_block(self, row, into=None):
    calls[0] += 1
    if calls[0] == 3:
        {action}
    return real(self, row, into)
LocalStore.read_block = read_block
write_bundle(LocalStore({store!r}), {out!r})
"""


@pytest.mark.parametrize("action", ["os.kill(os.getpid(), signal.SIGKILL)", "raise KeyboardInterrupt"])
def test_an_export_stopped_mid_way_leaves_no_bundle(source, tmp_path, action):
    mem, _, _, _ = source
    out = tmp_path / "b.kvmb"
    out.write_bytes(b"the previous bundle")  # an older bundle under the name stays whole
    script = _KILL_SCRIPT.format(tests=str(Path(__file__).parent), store=str(mem.store.path), out=str(out),
                                 action=action)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert p.returncode != 0
    assert out.read_bytes() == b"the previous bundle"
    leftovers = [x.name for x in tmp_path.iterdir() if x.name != "b.kvmb"]
    if "SIGKILL" in action:
        assert p.returncode == -signal.SIGKILL
        assert len(leftovers) == 1 and leftovers[0].startswith(".b.kvmb.") and leftovers[0].endswith(".partial")
    else:
        assert leftovers == []  # removed on the way out


# ---------------------------------------------------------------------- the embedded model, the CLI, Redis
PROBLEMS = [
    ("A farmer has 12 rows of 15 cabbages. Rabbits eat 23 cabbages. How many cabbages are left?",
     "Cabbages planted: 12 * 15 = 180.\nAfter the rabbits: 180 - 23 = 157.\nThe answer is 157.", "157", "default"),
    ("Ana reads 14 pages a day for 9 days. How many pages does she read?",
     "Pages: 14 * 9 = 126.\nThe answer is 126.", "126", "default"),
    ("A tank holds 450 litres and leaks 35 litres. How much water is left?",
     "Water left: 450 - 35 = 415.\nThe answer is 415.", "415", "team"),
]


def _as_opened(smollm, store, **kw) -> Engine:
    """An engine on the session's model under the profile `kvmemory` commands (Engine.open) run: the
    model named by its files (these tests never change its weights), so bundles pass between the two."""
    from kvmemory.models.loading import files_model_sha256

    return Engine(smollm, store, model_sha256=files_model_sha256(smollm.weights_files), **kw)


def kvm(*args, env=None, check=True):
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "kvmemory.cli", *args], capture_output=True, text=True, env=e,
                       timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(f"kvmemory {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def real_source(smollm, tmp_path_factory):
    """Three remembered solutions under the CLI's default profile (kv_dtype "auto": bfloat16 K/V), and
    the bundle `kvmemory export` wrote of them (through the CLI: no model is loaded for it)."""
    root = tmp_path_factory.mktemp("real")
    mem = KVMemory(_as_opened(smollm, LocalStore(root / "store"), kv_dtype="auto"))
    entries = [mem.remember(p, s, a, namespace=ns) for p, s, a, ns in PROBLEMS]
    out = json.loads(kvm("export", "--store", str(root / "store"), "--out", str(root / "three.kvmb"), "--json").stdout)
    return mem, entries, root / "three.kvmb", out


def test_cli_export_reports_json(real_source):
    mem, entries, path, out = real_source
    raw = path.read_bytes()
    assert out["entries"] == 3 and out["entry_ids"] == [e.id for e in entries]
    assert out["sha256"] == hashlib.sha256(raw).hexdigest() and out["bytes"] == len(raw)
    assert out["blocks"] == len({h for e in entries for h in e.chain}) and out["namespaces"] == ["default", "team"]
    assert out["profiles"] == [mem.engine.profile_id]


def test_real_round_trip_ask_recall_and_graft_there(real_source, smollm, tmp_path):
    src, entries, path, _ = real_source
    dst = KVMemory(_as_opened(smollm, LocalStore(tmp_path / "there"), kv_dtype="auto"))
    r = dst.import_bundle(path, verify_all=True)
    assert r.ok and r.imported == [e.id for e in entries]
    assert r.verify["bit_identical"] == 3 and r.verify["attestation_match"] == 3 and r.verify["kl_max"] == 0.0
    hit = dst.recall("Ana reads 14 pages every day for 9 days. How many pages does she read?", k=1)
    assert [h.entry.id for h in hit] == [entries[1].id]
    ans = dst.ask(entries[0].id, "How many cabbages were planted?", max_new_tokens=8)
    assert ans.report.tokens_grafted > 0 and ans.entries == [entries[0].id]
    prompt = dst.question_layout("How many cabbages were planted?", [entries[0]])  # cut at the entry's end
    got, rep = dst.engine.forward(prompt.ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True, cuts=prompt.cuts)
    ref = dst.engine.recompute(prompt.ids, max_new_tokens=4, cuts=prompt.cuts)
    g = rep.tokens_grafted
    assert g == len(entries[0].token_ids)  # the whole entry, its tail block included
    assert torch.equal(got.prefill_logits, ref.prefill_logits[g:]) and torch.equal(got.decode_logits, ref.decode_logits)
    assert dst.verify().bit_identical == 3


def test_cli_refuses_a_foreign_kv_dtype_by_name_and_leaves_the_target_untouched(real_source, smollm, tmp_path):
    """Entries made with float32 K/V, imported by the CLI's default profile (bfloat16 K/V)."""
    src32 = KVMemory(_as_opened(smollm, LocalStore(tmp_path / "f32"), kv_dtype="float32"))
    e = src32.remember(*PROBLEMS[0][:3])
    src32.export_bundle(tmp_path / "f32.kvmb")
    _, _, path, _ = real_source
    target = tmp_path / "target"
    kvm("import", str(path), "--store", str(target), "--sample", "1", "--json")  # a store under the default profile
    before = snapshot(target)
    p = kvm("import", str(tmp_path / "f32.kvmb"), "--store", str(target), "--json", check=False)
    assert p.returncode == 2
    err = json.loads(p.stdout)
    assert err["error"] == "ProfileMismatch" and "kv_dtype: stored 'float32' vs current 'bfloat16'" in err["message"]
    assert "--kv-dtype float32" in p.stderr  # how to open under the bundle's profile
    assert snapshot(target) == before
    # In-process, the same refusal names the field in ProfileMismatch.fields.
    dst = KVMemory(_as_opened(smollm, LocalStore(target), kv_dtype="auto"))
    with pytest.raises(ProfileMismatch) as exc:
        dst.import_bundle(tmp_path / "f32.kvmb")
    assert "kv_dtype" in exc.value.fields and e.id not in dst.store.entry_ids()


def test_cli_import_of_a_forged_bundle_exits_1_naming_the_entry(real_source, tmp_path):
    src, entries, _, _ = real_source
    src.export_bundle(tmp_path / "one.kvmb", entry_ids=[entries[1].id])
    forged = write_tar(tmp_path / "forged.kvmb",
                       _forge_payload(members_of(tmp_path / "one.kvmb"), entries[1].chain[0], at=1001))
    p = kvm("import", str(forged), "--store", str(tmp_path / "t"), check=False)
    assert p.returncode == 1, p.stderr
    assert f"verification FAILED on this machine for 1 entries: {entries[1].id}" in p.stdout
    assert "Nothing was imported" in p.stdout
    assert LocalStore(tmp_path / "t").entry_ids() == []


def test_cli_refuses_a_damaged_bundle_before_loading_the_model(real_source, tmp_path):
    _, entries, path, _ = real_source
    bad = _flip(path, block_member(entries[0].chain[0]), 7, tmp_path / "bad.kvmb")
    t0 = time.monotonic()
    p = kvm("import", str(bad), "--store", str(tmp_path / "t"), "--json", check=False)
    assert p.returncode == 2 and json.loads(p.stdout)["error"] == "BundleError"
    assert "SHA-256 does not match the manifest" in p.stderr
    assert not (tmp_path / "t").exists()  # the target was not even opened
    assert time.monotonic() - t0 < 120


def test_import_into_redis_in_another_process_then_verify_and_recall_there(real_source, smollm, tmp_path):
    """Exported here; imported by `kvmemory import` in a subprocess into a signed Redis store (every entry
    proved before it is signed); then read back from Redis by this process: verify, recall, ask."""
    from redis_server import RedisServer

    from kvmemory.store.redis_store import RedisStore

    _, entries, path, _ = real_source
    with RedisServer() as srv:
        url = f"{srv.url}?store=bundle{uuid.uuid4().hex[:8]}"
        cli_tier = RedisStore(url, signer=KEY).path  # where the subprocess's read-through tier goes
        try:
            p = kvm("import", str(path), "--store", url, "--sample", "1", "--json",
                    env={"KVMEMORY_SIGNING_KEY": KEY})
            r = json.loads(p.stdout)
            assert r["ok"] and r["imported"] == [e.id for e in entries] and r["proof"] == "all (signed store)"
            assert r["verify"]["checked"] == 3 == r["verify"]["bit_identical"] == r["verify"]["attestation_match"]
            again = json.loads(kvm("import", str(path), "--store", url, "--json",
                                   env={"KVMEMORY_SIGNING_KEY": KEY}).stdout)
            assert again["imported"] == [] and again["skipped"] == r["imported"]
            rstore = RedisStore(url, signer=KEY, path=tmp_path / "tier")
            mem = KVMemory(_as_opened(smollm, rstore, kv_dtype="auto"))
            assert sorted(rstore.entry_ids()) == sorted(e.id for e in entries)
            summary = mem.verify()
            assert summary.checked == 3 == summary.bit_identical == summary.attested_match
            hit = mem.recall("A tank holds 450 litres and leaks 35 litres. How much is left?", k=1, namespace="team")
            assert [h.entry.id for h in hit] == [entries[2].id]
            ans = mem.ask(entries[2].id, "How much water leaked?", namespace="team", max_new_tokens=6)
            assert ans.report.tokens_grafted > 0
            rstore.close()
        finally:
            import shutil

            shutil.rmtree(cli_tier, ignore_errors=True)


def test_a_hand_edited_entry_with_its_id_and_manifest_recomputed_is_refused(source, target, tmp_path):
    """Issue 47 item 6: a new solution text in a bundle entry, its id recomputed from the new texts and
    the manifest rebuilt, passes every check of the file; its texts no longer re-tokenize to its token
    ids (which hash to its chain), so the import refuses it, as an answer would, and imports nothing."""
    src, entries, _, _ = source
    one = src.export_bundle(tmp_path / "one.kvmb", entry_ids=[entries[2].id])

    def edit(listed):
        e = listed[0]
        e["solution"] = e["solution"].replace("Worked", "Wrong!")
        e["id"] = entry_id_for(e["namespace"], e["problem"], e["solution"], e["answer"], e["profile_id"])
        return listed

    edited = write_tar(tmp_path / "edited.kvmb", edit_json(members_of(Path(one.out)), PREFIX + "entries.json", edit))
    b = read_bundle(edited)  # the file itself checks
    assert b.entries[0].id != entries[2].id
    ids_before = target.store.entry_ids()
    with pytest.raises(BundleError, match="re-tokenize"):
        target.import_bundle(edited)
    assert target.store.entry_ids() == ids_before
