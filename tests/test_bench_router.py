"""The router benchmark in its tiny mode: the result is well-formed and its numbers are plausible."""

from __future__ import annotations

import json

import pytest

from kvmemory.routing import router as R
from kvmemory.bench.router import run_router_bench


@pytest.fixture(scope="module")
def result() -> dict:
    return run_router_bench(tiny=True, progress=False)


def _check_latency(d: dict) -> None:
    assert d["queries"] > 0
    assert 0 < d["p50_ms"] <= d["p99_ms"]
    assert d["mean_ms"] > 0


def test_result_is_json_and_complete(result):
    assert json.loads(json.dumps(result)) == result
    assert {"config", "sizes", "crossover", "end_to_end", "total_s"} <= set(result)
    cfg = result["config"]
    assert cfg["dim"] == 384 and cfg["tiny"] is True and cfg["hnsw_threshold"] == 1_000
    assert [s["n"] for s in result["sizes"]] == [1_000, 5_000]


def test_each_size_measures_flat_and_the_chosen_type(result):
    kinds = [s["chosen_kind"] for s in result["sizes"]]
    assert kinds == [R.index_kind_for(n, hnsw_threshold=1_000, ivf_threshold=5_000) for n in (1_000, 5_000)]
    assert kinds == ["hnsw", "ivf"]
    for s in result["sizes"]:
        for part in ("flat", "chosen"):
            d = s[part]
            assert d["kind"] == (s["chosen_kind"] if part == "chosen" else "flat")
            _check_latency(d)
            _check_latency(d["near"])
            # the index holds n x 384 float32 at least, and the process grew by something
            assert d["index_bytes"] >= s["n"] * 384 * 4
            assert d["rss_delta_bytes"] > 0 and d["build_s"] > 0
        assert s["flat"]["near"]["top1_is_source"] == 1.0  # exact search finds the vector a query came from
        assert s["chosen"]["near"]["top1_is_source"] >= 0.9
        assert 0.0 < s["chosen"]["recall_at_10"] <= 1.0
    assert result["sizes"][1]["chosen"]["nlist"] >= 1


def test_crossover_and_end_to_end(result):
    for row in result["crossover"]:
        assert row["flat_p50_ms"] > 0 and row["hnsw_p50_ms"] > 0
        assert row["flat_p99_ms"] >= row["flat_p50_ms"] and row["hnsw_p99_ms"] >= row["hnsw_p50_ms"]
        assert 0.0 < row["hnsw_recall_at_10"] <= 1.0
    e = result["end_to_end"]
    assert e["n"] == 5_000 and e["kind"] == "ivf" and e["queries"] == 10
    assert 0 < e["embed_p50_ms"] <= e["embed_p99_ms"]
    assert 0 < e["total_p50_ms"] <= e["total_p99_ms"]
    # every end-to-end query is its embedding plus a search, so its percentiles dominate the embedding's
    for d in (e, e["one_thread"]):
        assert d["total_p50_ms"] >= d["embed_p50_ms"] and d["total_p99_ms"] >= d["embed_p99_ms"]
    assert e["one_thread"]["torch_threads"] == 1


def test_recall_scaling_bench_runs_side_by_side():
    """`python -m kvmemory.bench.router recall` in small: both sizes measured, the routed questions found,
    a change made by another process applied (bench/router_recall.py; the figures are BENCHMARKS.md's)."""
    from kvmemory.bench.router_recall import run_recall_scaling

    import torch

    threads = torch.get_num_threads()
    r = run_recall_scaling(sizes=(10, 300), queries=8, progress=False)
    assert torch.get_num_threads() == threads  # restored: an engine opened after it pins the usual count
    assert json.loads(json.dumps(r)) == r
    for n in ("10", "300"):
        assert r[n]["entries"] == int(n) and r[n]["routed_found"] == 4
        for kind in ("routed", "nowhere", "nowhere_listing_per_question"):
            assert 0 < r[n][kind]["p50_ms"] <= r[n][kind]["p99_ms"]
    assert set(r["ratio_p50"]) == {"routed", "nowhere", "nowhere_listing_per_question"}
