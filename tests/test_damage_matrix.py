"""The damage matrix (issue 40), on the embedded SmolLM2, on a local store and on Redis.

A small store of three verified solutions (the muffin, cyclist and apples problems) is copied, one
kind of damage is done to the copy, and then, in this order:
1. the check-only `fsck` (what `kvmemory fsck` runs: no model) must exit non-zero naming the damage;
2. the problem the damage touches is asked (`answer(choices="numbers")`): the answer must be exact
   (the right number, from the right entry or from none) or a refusal that names the damaged entry
   (`Answer.refused`, or a typed error such as `CatalogueLost`), never a wrong answer;
3. `fsck --repair` (with the memory layer: texts re-tokenized, damaged entries recomputed and
   re-proven, the router rebuilt) must exit 1 (or 0 when the answer already healed the damage: an
   unrouted entry is routed again by `recall`), and a check-only `fsck` after it 0;
4. every entry must still be there (lost: 0) and `verify` must prove all three bit-identical, and the
   question must be answered exactly again.

Counts (tries, detected, exact, refused, wrong, repaired, verified, lost) are printed as JSON at the
end of the module (`pytest tests/test_damage_matrix.py -s`); with KVMEMORY_RELIABILITY_JSON=path they
are also written there (BENCHMARKS.md, "Reliability"). One engine (one model load) serves every case;
each case works on its own copy of the store.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sqlite3
import time
import uuid
from pathlib import Path

import pytest
from redis_server import RedisServer

from kvmemory.engine.engine import Engine
from kvmemory.errors import KVMemoryError
from kvmemory.memory.entry_check import EntryChecks
from kvmemory.memory.facade import KVMemory
from kvmemory.routing.check import router_checker
from kvmemory.routing.router import router_rebuilder
from kvmemory.store.fsck import fsck_at
from kvmemory.store.local import LocalStore
from kvmemory.store.redis_store import RedisStore

KEY = "9c" * 32
PROBLEMS = [  # (problem, solution, answer): each renders to more than one 64-token block
    ("A baker makes 3 trays of 9 muffins each. How many muffins does she bake?", "3 * 9 = 27. The answer is 27.", "27"),
    ("A cyclist rides 13 km every day for 6 days. How many km does she ride in total?",
     "13 * 6 = 78. The answer is 78.", "78"),
    ("144 apples are shared equally among 16 children. How many apples does each child get?",
     "144 / 16 = 9. The answer is 9.", "9"),
]
TALLY: dict[str, dict] = {}
CASES: list[dict] = []


def _count(kind: str, key: str, n: int = 1) -> None:
    t = TALLY.setdefault(kind, {k: 0 for k in ("tries", "detected", "exact", "refused", "wrong", "repaired",
                                               "verified", "lost")})
    t[key] += n


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    total = {k: sum(t[k] for t in TALLY.values()) for k in next(iter(TALLY.values()), {})}
    out = {"stores": TALLY, "total": total, "cases": CASES}
    print("\nRELIABILITY " + json.dumps(out, indent=1))
    path = os.environ.get("KVMEMORY_RELIABILITY_JSON")
    if path:
        Path(path).write_text(json.dumps(out, indent=1))


@pytest.fixture(scope="module")
def engine(smollm, tmp_path_factory):
    return Engine(smollm, LocalStore(tmp_path_factory.mktemp("engine") / "store"))


@pytest.fixture(scope="module")
def pristine_local(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "store"
    st = LocalStore(path)
    st.put_profile(engine.profile_id, engine.profile.to_dict())  # as an engine opened on it would
    mem = _memory(engine, st)
    entries = [mem.remember(p, s, a) for p, s, a in PROBLEMS]
    for (p, _, a), e in zip(PROBLEMS, entries):  # the undamaged store answers each exactly
        ans = mem.answer(p, choices="numbers", answer_prefix="The answer is")
        assert ans.text == f"The answer is {a}." and ans.entries == [e.id], ans.to_json()
    mem.store.close()
    return path, entries


@pytest.fixture(scope="module")
def srv():
    with RedisServer() as s:
        yield s


@pytest.fixture(scope="module")
def pristine_redis(engine, srv, tmp_path_factory):
    tier = tmp_path_factory.mktemp("pristine-tier")
    name = f"pristine{uuid.uuid4().hex[:6]}"
    st = RedisStore(srv.url, store=name, path=tier, signer=KEY)
    st.put_profile(engine.profile_id, engine.profile.to_dict())
    mem = _memory(engine, st)
    entries = [mem.remember(p, s, a) for p, s, a in PROBLEMS]
    st.close()
    return name, tier, entries


def _memory(engine, store) -> KVMemory:
    engine.store = store
    return KVMemory(engine)


# ---------------------------------------------------------------------- local damage
def _router_rows(path: Path):
    f = glob.glob(str(path / "router" / "ns-*.json"))[0]
    return f, json.loads(Path(f).read_text())


def swap_router_rows(ctx):
    f, d = _router_rows(ctx["path"])
    rows = {r[1]: r for r in d["rows"]}
    a, b = rows[ctx["ids"][0]], rows[ctx["ids"][1]]
    a[1], b[1] = b[1], a[1]
    Path(f).write_text(json.dumps(d))


def delete_router_row(ctx):
    f, d = _router_rows(ctx["path"])
    row = next(r for r in d["rows"] if r[1] == ctx["ids"][0])
    d["rows"].remove(row)
    d.setdefault("dead", []).append(row[0])  # a tombstone keeps the index's vector count consistent
    Path(f).write_text(json.dumps(d))


def _sql(ctx, *statements):
    db = sqlite3.connect(ctx["path"] / "catalogue.sqlite")
    for sql, args in statements:
        db.execute(sql, args)
    db.commit()
    db.close()


def edit_texts(ctx):  # repro 2 of the issue
    _sql(ctx, ("UPDATE entries SET solution=replace(solution,'144','154'), answer='154' WHERE id=?", (ctx["ids"][2],)))


def move_namespace(ctx):
    _sql(ctx, ("UPDATE entries SET namespace='elsewhere' WHERE id=?", (ctx["ids"][0],)))


def edit_token_ids(ctx):
    db = sqlite3.connect(ctx["path"] / "catalogue.sqlite")
    (blob,) = db.execute("SELECT token_ids FROM entries WHERE id=?", (ctx["ids"][0],)).fetchone()
    b = bytearray(blob)
    b[40] ^= 1  # one token id of the first block
    db.execute("UPDATE entries SET token_ids=? WHERE id=?", (bytes(b), ctx["ids"][0]))
    db.commit()
    db.close()


def edit_chain(ctx):
    _sql(ctx, ("UPDATE entry_blocks SET hash=(SELECT hash FROM entry_blocks WHERE entry_id=?) WHERE entry_id=?",
               (ctx["ids"][1], ctx["ids"][0])))


def _catalogue_files(ctx):
    return [ctx["path"] / n for n in ("catalogue.sqlite", "catalogue.sqlite-wal", "catalogue.sqlite-shm")]


def delete_catalogue(ctx):
    for f in _catalogue_files(ctx):
        f.unlink(missing_ok=True)


def empty_catalogue(ctx):
    delete_catalogue(ctx)
    (ctx["path"] / "catalogue.sqlite").write_bytes(b"")


def truncate_catalogue(ctx):
    f = ctx["path"] / "catalogue.sqlite"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def damage_catalogue_page(ctx):
    f = ctx["path"] / "catalogue.sqlite"
    data = bytearray(f.read_bytes())
    at = data.index(PROBLEMS[0][0][:30].encode())  # the page holding the muffin entry's row
    page = at // 4096
    data[page * 4096 + 200 : page * 4096 + 4000] = os.urandom(3800)
    f.write_bytes(bytes(data))


def delete_catalogue_rows(ctx):
    _sql(ctx, ("DELETE FROM entries", ()), ("DELETE FROM entry_blocks", ()))


def _block(ctx) -> Path:
    return LocalStore(ctx["path"]).block_path(ctx["entries"][0].chain[0])


def flip_block(ctx):
    f = _block(ctx)
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x10
    f.write_bytes(bytes(data))


def flip_block_header(ctx):
    f = _block(ctx)
    data = bytearray(f.read_bytes())
    data[30] ^= 0x02
    f.write_bytes(bytes(data))


def truncate_block(ctx):
    f = _block(ctx)
    f.write_bytes(f.read_bytes()[:-1000])


def delete_block(ctx):
    _block(ctx).unlink()


def alter_payload_hash(ctx):
    _sql(ctx, ("UPDATE blocks SET payload_sha256=? WHERE hash=?", ("ab" * 32, ctx["entries"][0].chain[0])))


def _record(ctx) -> Path:
    return ctx["path"] / "entries" / f"{ctx['ids'][0]}.json"


def damage_record(ctx):
    f = _record(ctx)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def delete_record(ctx):
    _record(ctx).unlink()


def nest_record(ctx):  # issue 47 item 7: a record nested 200,000 deep
    _record(ctx).write_bytes(b"[" * 200_000)


def symlink_block(ctx):  # issue 47 item 2: a block file that is a symlink to /dev/zero
    f = _block(ctx)
    f.unlink()
    f.symlink_to("/dev/zero")


def swap_router_vectors(ctx):  # issue 47 item 5: two rows' vectors swapped, the rows left as they were
    import faiss
    import numpy as np

    f, d = _router_rows(ctx["path"])
    index_file = Path(f).with_suffix(".faiss") if Path(f).with_suffix(".faiss").exists() else \
        next(Path(f).parent.glob("*.faiss"))
    index = faiss.read_index(str(index_file))
    vid = {r[1]: r[0] for r in d["rows"] if r[2] == "problem"}
    ids = [r[0] for r in d["rows"]]
    vecs = np.stack([index.reconstruct(int(i)) for i in ids])
    a, b = ids.index(vid[ctx["ids"][0]]), ids.index(vid[ctx["ids"][1]])
    vecs[[a, b]] = vecs[[b, a]]
    new = faiss.IndexIDMap2(faiss.IndexFlatIP(index.d))
    new.add_with_ids(vecs, np.asarray(ids, dtype=np.int64))
    faiss.write_index(new, str(index_file))


def edit_profile_file(ctx):  # issue 47 item 5: profiles/<sha>.json edited
    f = next((ctx["path"] / "profiles").glob("*.json"))
    d = json.loads(f.read_text())
    d["chunk"] = 32
    f.write_text(json.dumps(d))


def truncate_router_index(ctx):  # issue 47 item 8: fsck --repair rebuilds the router
    f = next((ctx["path"] / "router").glob("*.faiss"))
    f.write_bytes(f.read_bytes()[:100])


LOCAL = {  # name: (damage, the entry whose question is asked, kinds fsck must name)
    "router rows swapped": (swap_router_rows, 0, {"router_drift"}),
    "router row deleted": (delete_router_row, 0, {"router_drift"}),
    "router deleted": (lambda ctx: shutil.rmtree(ctx["path"] / "router"), 0, {"router_drift"}),
    "entry texts edited": (edit_texts, 2, {"entries_altered"}),
    "entry moved to another namespace": (move_namespace, 0, {"entries_altered"}),
    "entry token ids edited": (edit_token_ids, 0, {"entries_altered"}),
    "entry chain edited": (edit_chain, 0, {"entries_altered"}),
    "catalogue deleted": (delete_catalogue, 0, {"catalogue_lost"}),
    "catalogue emptied": (empty_catalogue, 0, {"catalogue_lost"}),
    "catalogue truncated": (truncate_catalogue, 0, {"catalogue_lost", "catalogue_damaged"}),
    "catalogue page damaged": (damage_catalogue_page, 0, {"catalogue_lost", "catalogue_damaged"}),
    "catalogue rows deleted": (delete_catalogue_rows, 0, {"entries_missing_from_catalogue"}),
    "block payload flipped": (flip_block, 0, {"blocks_damaged"}),
    "block header flipped": (flip_block_header, 0, {"blocks_damaged"}),
    "block truncated": (truncate_block, 0, {"blocks_damaged"}),
    "block deleted": (delete_block, 0, {"blocks_missing"}),
    "payload hash altered": (alter_payload_hash, 0, {"blocks_damaged"}),
    "entry record damaged": (damage_record, 0, {"entry_records_damaged"}),
    "entry record deleted": (delete_record, 0, {"entry_records_missing"}),
    "entry record nested 200,000 deep": (nest_record, 0, {"entry_records_damaged"}),
    "block file a symlink to /dev/zero": (symlink_block, 0, {"blocks_damaged"}),
    "router vectors swapped": (swap_router_vectors, 0, {"router_drift"}),
    "router index truncated": (truncate_router_index, 0, {"router_drift"}),
    "profile file edited": (edit_profile_file, 0, {"profile_files_damaged"}),
}


# ---------------------------------------------------------------------- Redis damage
def r_swap_router_rows(ctx):
    swap_router_rows({**ctx, "path": ctx["tier"]})


def r_edit_texts(ctx):
    st, eid = ctx["store"], ctx["ids"][2]
    sol = st.client.hget(st.k_entry(eid), "solution").decode().replace("144", "154")
    st.client.hset(st.k_entry(eid), mapping={"solution": sol, "answer": json.dumps("154")})


def r_delete_entry(ctx):
    ctx["store"].client.delete(ctx["store"].k_entry(ctx["ids"][0]))


def r_delete_indexes(ctx):
    st = ctx["store"]
    st.client.delete(st.k_entries(), st.k_ns("default"))


def _payload_key(ctx):
    return ctx["store"].k_payload(ctx["entries"][0].chain[0])


def r_flip_payload(ctx):
    r, k = ctx["store"].client, _payload_key(ctx)
    data = bytearray(r.get(k))
    data[-100] ^= 0x10
    r.set(k, bytes(data))


def r_truncate_payload(ctx):
    r, k = ctx["store"].client, _payload_key(ctx)
    r.set(k, r.get(k)[:-1000])


def r_delete_payload(ctx):
    ctx["store"].client.delete(_payload_key(ctx))


def r_alter_payload_hash(ctx):
    st = ctx["store"]
    st.client.hset(st.k_block(ctx["entries"][0].chain[0]), "payload_sha256", "ab" * 32)


def r_delete_block_row(ctx):
    st = ctx["store"]
    st.client.delete(st.k_block(ctx["entries"][0].chain[0]))


def r_damage_record(ctx):
    st = ctx["store"]
    st.client.setrange(st.k_record(ctx["ids"][0]), 60, b"#")


def r_delete_record(ctx):
    st = ctx["store"]
    st.client.delete(st.k_record(ctx["ids"][0]))


REDIS = {
    "router rows swapped": (r_swap_router_rows, 0, {"router_drift"}),
    "entry texts edited": (r_edit_texts, 2, {"entries_forged"}),
    "entry deleted": (r_delete_entry, 0, {"entries_missing_from_catalogue"}),
    "entry indexes deleted": (r_delete_indexes, 0, {"index_drift"}),
    "block payload flipped": (r_flip_payload, 0, {"blocks_damaged"}),
    "block payload truncated": (r_truncate_payload, 0, {"blocks_damaged"}),
    "block payload deleted": (r_delete_payload, 0, {"blocks_missing"}),
    "payload hash altered": (r_alter_payload_hash, 0, {"blocks_unsigned"}),
    "block row deleted": (r_delete_block_row, 0, {"blocks_adopted"}),
    "entry record damaged": (r_damage_record, 0, {"entry_records_damaged"}),
    "entry record deleted": (r_delete_record, 0, {"entry_records_missing"}),
}


# ---------------------------------------------------------------------- the trial
def _judge(ask, target_id: str, expected: str) -> tuple[str, dict]:
    """exact / refused / wrong for one answer (a typed error is a refusal)."""
    try:
        ans = ask()
    except KVMemoryError as exc:
        return "refused", {"error": f"{type(exc).__name__}: {exc}"[:300]}
    info = {"text": ans.text, "entries": ans.entries, "refused": ans.refused}
    if ans.entries and ans.entries != [target_id]:
        return "wrong", info  # another entry's KV answered this question
    if ans.text == expected:
        return "exact", info
    if any(r["entry"] == target_id for r in ans.refused) or (ans.refused and not ans.entries):
        return "refused", info
    return "wrong", info


def _trial(kind: str, name: str, case, engine, open_store, spec, signing_key, ids, entries):
    damage, target, kinds = case
    problem, _, answer = PROBLEMS[target]
    expected = f"The answer is {answer}."
    row = {"store": kind, "damage": name}
    _count(kind, "tries")
    router = lambda st: (router_checker(st), router_rebuilder(st))  # noqa: E731
    # 1. check only, as `kvmemory fsck` does: every check an answer makes (texts re-tokenized, router
    # vectors re-embedded)
    checks = EntryChecks(engine)
    rep = fsck_at(spec, signing_key=signing_key, router=lambda st: (router_checker(st, vectors=True), None),
                  entry_check=checks.entry)
    found = {p["kind"] for p in rep.problems}
    row["fsck"] = {"exit": rep.exit_code, "found": sorted(found)}
    detected = rep.exit_code != 0 and bool(kinds & found)
    _count(kind, "detected", int(detected))
    # 2. the answer: exact or refused, never wrong
    def ask():
        return _memory(engine, open_store()).answer(problem, choices="numbers", answer_prefix="The answer is")

    outcome, info = _judge(ask, ids[target], expected)
    row["answer"] = {"outcome": outcome, **info}
    _count(kind, outcome)
    # 3. repair, with the memory layer's checks and recompute, then a clean check
    fixed = fsck_at(spec, signing_key=signing_key, repair=True, router=router, entry_check=checks.entry,
                    recompute=lambda todo: _memory(engine, open_store()).recompute(todo))
    after = fsck_at(spec, signing_key=signing_key, router=lambda st: (router_checker(st, vectors=True), None),
                    entry_check=checks.entry)
    # exit 0 from the repair: the answer already healed it (recall routes an unrouted entry again)
    repaired = fixed.exit_code in (0, 1) and after.exit_code == 0
    row["repair"] = {"exit": fixed.exit_code, "after": after.exit_code, "recomputed": fixed.n("entries_recomputed"),
                     "healed_by_the_answer": fixed.exit_code == 0}
    _count(kind, "repaired", int(repaired))
    # 4. nothing lost, everything proven, the question answered exactly again
    mem = _memory(engine, open_store())
    held = set(mem.store.entry_ids())
    lost = [i for i in ids if i not in held]
    _count(kind, "lost", len(lost))
    summary = mem.verify(single_pass=False)
    proven = summary.checked == len(ids) == summary.bit_identical
    _count(kind, "verified", int(proven))
    again = mem.answer(problem, choices="numbers", answer_prefix="The answer is")
    row.update(lost=lost, verify={"checked": summary.checked, "bit_identical": summary.bit_identical,
                                  "unproven": summary.unproven}, again=again.text)
    mem.store.close()
    CASES.append(row)
    assert detected, row
    assert outcome in ("exact", "refused"), row
    assert repaired, (fixed.summary(), after.summary())
    assert not lost and proven, row
    assert again.text == expected and again.entries == [ids[target]], row


@pytest.mark.parametrize("name", list(LOCAL))
def test_local_damage(name, engine, pristine_local, tmp_path):
    src, entries = pristine_local
    path = tmp_path / "store"
    shutil.copytree(src, path)
    ids = [e.id for e in entries]
    ctx = {"path": path, "ids": ids, "entries": entries}
    LOCAL[name][0](ctx)
    _trial("local", name, LOCAL[name], engine, lambda: LocalStore(path), str(path), None, ids, entries)


def _copy_redis(r, src: str, dst: str) -> None:
    """Every key of store `src` copied under store `dst` (DUMP / RESTORE: values byte for byte)."""
    for pattern, old, new in ((f"kvm:{{{src}}}:*", f"{{{src}}}", f"{{{dst}}}"), (f"kvm:{src}:*", f"kvm:{src}:",
                                                                                 f"kvm:{dst}:")):
        for k in r.scan_iter(match=pattern, count=1000):
            r.restore(k.decode().replace(old, new, 1), 0, r.dump(k))


@pytest.mark.parametrize("name", list(REDIS))
def test_redis_damage(name, engine, srv, pristine_redis, tmp_path):
    src, src_tier, entries = pristine_redis
    store_name = f"d{uuid.uuid4().hex[:8]}"
    tier = tmp_path / "tier"
    spec = f"{srv.url}?store={store_name}&tier={tier}"
    probe = RedisStore(srv.url, store=src, path=tmp_path / "probe", signer=KEY)
    _copy_redis(probe.client, src, store_name)
    probe.close()
    ids = [e.id for e in entries]
    st = RedisStore(srv.url, store=store_name, path=tier, signer=KEY)
    shutil.copytree(src_tier / "router", tier / "router")  # the router only: the cache tier starts empty
    REDIS[name][0]({"store": st, "tier": tier, "ids": ids, "entries": entries})
    st.close()
    _trial("redis", name, REDIS[name], engine, lambda: RedisStore(srv.url, store=store_name, path=tier, signer=KEY),
           spec, KEY, ids, entries)


def test_the_entry_check_costs_little_per_answer(engine, pristine_local, tmp_path):
    """What checking entries against themselves costs an answer: the first answer per entry version
    tokenizes it and embeds its text; later ones hit the in-memory cache."""
    src, entries = pristine_local
    shutil.copytree(src, tmp_path / "store")
    mem = _memory(engine, LocalStore(tmp_path / "store"))
    rows = []
    for rnd in range(3):
        for p, _, a in PROBLEMS:
            before = mem.checks.stats["seconds"]
            t0 = time.perf_counter()
            ans = mem.answer(p, choices="numbers", answer_prefix="The answer is")
            total = time.perf_counter() - t0
            assert ans.text == f"The answer is {a}."
            rows.append({"round": rnd, "check_ms": round(1000 * (mem.checks.stats["seconds"] - before), 3),
                         "answer_ms": round(1000 * total, 1)})
    first = [r["check_ms"] for r in rows[:3]]
    cached = [r["check_ms"] for r in rows[3:]]
    CASES.append({"entry_check_cost": {"first_ms": first, "cached_ms": cached,
                                       "answer_ms": [r["answer_ms"] for r in rows], "stats": dict(mem.checks.stats)}})
    # each entry tokenized once; every later use (recall, then answer_from) a cache hit
    assert mem.checks.stats["entries_checked"] == 3 and mem.checks.stats["entries_cached"] >= 6
    assert max(cached) < 5.0  # milliseconds: a hash and a dictionary lookup per routed entry
