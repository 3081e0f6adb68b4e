"""Each benchmark runs on a tiny size and reports well-formed results (benchmarks are not timed tests:
the figures themselves are measured by `kvmemory bench ...` and recorded in BENCHMARKS.md)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from kvmemory.kernels import sha256_lanes
from kvmemory.kernels.cpu import isa


def _positive(*xs):
    return all(isinstance(x, float) and x > 0 for x in xs)


def test_bench_graft_tiny(tmp_path):
    from kvmemory.bench.graft import format_table, plot, run_graft_bench

    threads = torch.get_num_threads()
    r = run_graft_bench((64, 128), repeats=2, llamacpp=False, progress=False)
    torch.set_num_threads(threads)
    json.dumps(r)
    assert [row["L"] for row in r["rows"]] == [64, 128]
    for row in r["rows"]:
        assert row["tokens_grafted"] == row["L"] and row["tokens_computed"] == 16
        assert _positive(row["graft_ttft_s"], row["recompute_ttft_s"], row["single_pass_ttft_s"])
        assert row["first_token_equal_recompute"] is True
        # every timing is kept: the medians reported are the samples' medians (the tables print the spread)
        samples = row["samples_s"]
        assert [len(samples[k]) for k in ("graft", "graft_cold", "recompute", "single_pass")] == [2, 2, 2, 2]
        # Rounds alternate direction: the second is the first reversed (the floor then before its graft),
        # so no side always follows the same one.
        first_round, second_round = row["round_orders"]
        assert second_round == first_round[::-1]
        assert first_round[:3] == ["graft", "floor_hashlib:warm", "floor_lanes:warm"]
        assert set(first_round) >= {"graft_cold", "recompute", "single_pass", "floor_lanes:cold"}
        assert row["graft_ttft_s"] == statistics.median(samples["graft"])
        # the same graft with its block files dropped from the page cache, held to the floor in that state
        assert row["graft_cold_ttft_s"] == statistics.median(samples["graft_cold"])
        assert row["graft_cold_over_floor"] == row["graft_cold_ttft_s"] / (
            row["read_hash_cold_floor_s"] + row["graft_cold_compute_s"])
        assert row["read_hash_cold_floor_s"] == row["bytes_grafted"] / row["raw_read_hash_cold_gb_s"] / 1e9
        assert row["recompute_ttft_s"] == statistics.median(samples["recompute"])
        assert _positive(row["graft_compute_s"], row["read_hash_floor_s"], row["ceiling_vs_recompute"])
        # The ceiling is the recompute over the floor's two parts: the graft's own step and its bytes
        # read + hashed at the raw bandwidth.
        assert row["ceiling_vs_recompute"] == row["recompute_ttft_s"] / (row["graft_compute_s"] + row["read_hash_floor_s"])
        assert row["read_hash_floor_s"] == row["bytes_grafted"] / row["raw_read_hash_gb_s"] / 1e9
        # The raw bandwidth is the better of hashlib and the 16-lane hash (None: too few blocks for lanes).
        lanes = row["raw_read_hash_lanes_gb_s"]
        assert _positive(row["raw_read_hashlib_gb_s"]) and (lanes is None or _positive(lanes))
        assert row["raw_read_hash_gb_s"] == max(row["raw_read_hashlib_gb_s"], lanes or 0.0)
    assert _positive(r["throughput"]["graft_gb_s"], r["throughput"]["raw_read_hash_gb_s"])
    # the CPU and the kernels' ISA are part of the report (the VMs of one kind differ in both)
    assert r["machine"]["cpu_isa"] == isa() and r["machine"]["sha256_lanes"] == sha256_lanes.kind()
    assert len(r["machine"]["cpu_vendor_family_model"].split()) == 3
    assert "| 128 |" in format_table(r) and "median [min-max]" in format_table(r)
    assert "files cold" in format_table(r)
    plot(r, str(tmp_path / "graft.png"))
    assert (tmp_path / "graft.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_graft_llamacpp_baselines_are_all_timed_interleaved():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (kvmemory[llamacpp]) is not installed")
    from kvmemory.bench.graft import format_table, run_graft_bench
    from kvmemory.bench.llamacpp import LLAMACPP_CONFIGS

    threads = torch.get_num_threads()
    r = run_graft_bench((64,), repeats=2, progress=False)
    torch.set_num_threads(threads)
    json.dumps(r)
    row = r["rows"][0]
    sides = {f"llamacpp_{kind}:{name}" for kind in ("prefill", "restore", "restore_cold") for name in LLAMACPP_CONFIGS}
    assert sides | {"graft", "graft_cold", "recompute", "single_pass"} == set(row["samples_s"])
    assert all(len(v) == 2 for v in row["samples_s"].values())  # every side at every repeat
    for kind in ("prefill", "restore", "restore_cold"):
        by_config = row[f"llamacpp_{kind}_ttft_s_by_config"]
        assert by_config == {n: statistics.median(row["samples_s"][f"llamacpp_{kind}:{n}"]) for n in LLAMACPP_CONFIGS}
        # compared at llama.cpp's fastest setting
        assert row[f"llamacpp_{kind}_ttft_s"] == min(by_config.values())
        assert by_config[row[f"llamacpp_{kind}_config"]] == row[f"llamacpp_{kind}_ttft_s"]
    assert row["speedup_vs_llamacpp_prefill"] == row["llamacpp_prefill_ttft_s"] / row["graft_ttft_s"]
    # cold against cold: both sides' files dropped from the page cache before each timing
    assert row["speedup_vs_llamacpp_cold"] == row["llamacpp_restore_cold_ttft_s"] / row["graft_cold_ttft_s"]
    # a Q8_0 K/V cache saves a smaller state than F16
    assert row["llamacpp_state_bytes"]["flash-q8_0"] < row["llamacpp_state_bytes"]["flash-f16"]
    assert {t["target"].split(" faster")[0] for t in r["targets"]} >= {"graft >= 1.3x"}
    assert all(isinstance(t["met"], bool) for t in r["targets"])
    assert "llama.cpp prefill s (setting)" in format_table(r) and "targets:" in format_table(r)


def test_bench_store_tiny():
    from kvmemory.bench.store import format_table, run_store_bench

    r = run_store_bench(blocks=4, block_bytes=1 << 16, threads=(1, 2))
    assert [x["threads"] for x in r["results"]] == [1, 2]
    for x in r["results"]:
        assert _positive(x["write_store_gb_s"], x["write_raw_gb_s"], x["read_verified_store_gb_s"],
                         x["read_raw_gb_s"], x["read_raw_plus_sha256_gb_s"], x["sha256_only_gb_s"])
        if sha256_lanes.kind() is not None:  # the grouped read and the lanes' hash (AVX-512 or SHA-NI)
            assert _positive(x["read_verified_store_lanes_gb_s"], x["sha256_lanes_only_gb_s"])
    assert format_table(r).count("\n") == 3
    assert all(len(v) == 5 for v in r["results"][0]["read_samples_s"].values())


def test_bench_capacity_tiny(tmp_path):
    from kvmemory.bench.capacity import format_table, plot, run_capacity_bench

    threads = torch.get_num_threads()
    r = run_capacity_bench(target_tokens=20_000, seq_tokens=512, probe_tokens=128, queries=3, progress=False,
                           checkpoints=(15_000,))
    torch.set_num_threads(threads)
    assert [x["target"] for x in r["points"]] == [10_000, 15_000, 20_000]
    assert format_table(r).count("\n") == 6
    plot(r, str(tmp_path / "capacity.png"))
    assert (tmp_path / "capacity.png").read_bytes()[:4] == b"\x89PNG"
    assert r["small"]["store_tokens"] >= 10_000 and r["large"]["store_tokens"] >= 20_000
    assert r["small"]["tokens_grafted"] == r["large"]["tokens_grafted"] == 128
    assert _positive(r["small"]["graft_p50_s"], r["large"]["graft_p50_s"], r["latency_ratio_large_over_small"])


def test_bench_recurring_tiny(real_memory):
    from kvmemory.bench.recurring import format_table, run_recurring_bench

    r = run_recurring_bench(real_memory, problems=2, rewordings=1, unrelated=4, base_budget=24, progress=False)
    json.dumps(r)
    assert r["library"]["entries"] == 2 and r["grafted"]["questions"] == 2 and r["base"]["questions"] == 2
    assert 0.0 <= r["grafted"]["accuracy"] <= 1.0 and 0.0 <= r["routing_recall_at_1"] <= 1.0
    assert r["grafted"]["grafted_tokens_per_question"] > 0
    assert r["grafted"]["decode_tokens_per_question"] <= 8 and r["grafted"]["choice_tokens_scored_per_question"] > 0
    assert r["grafted_free_decode"]["questions"] == 2 and r["grafted_free_decode"]["decode_tokens_per_question"] <= 8
    assert "answer chosen among the solution's numbers" in format_table(r)


def test_study_choices_tiny():
    from kvmemory.bench.recurring import study_choices

    r = study_choices(seeds=(3,), problems=2, rewordings=1, contrasts=(0.0, 0.5), progress=False)
    s = r["seeds"][0]
    assert s["questions"] == 2 and set(s["correct"]) == {"free_decode", "contrast_0.0", "contrast_0.5"}
    assert all(0 <= v <= 2 for v in s["correct"].values()) and r["questions"] == 2


def test_bench_graft_refuses_bad_lengths_before_loading():
    import pytest

    from kvmemory.bench.graft import run_graft_bench
    from kvmemory.errors import InvalidInput

    for bad in ((100,), (0,), ()):
        with pytest.raises(InvalidInput, match="multiples of the grid"):
            run_graft_bench(bad, llamacpp=False, progress=False)
    with pytest.raises(InvalidInput, match="repeats"):
        run_graft_bench((64,), repeats=0, llamacpp=False, progress=False)


def test_bench_cli_arguments_are_checked(capsys):
    import pytest

    from kvmemory.cli import main

    for argv in (["bench", "graft", "--lengths", "abc"], ["bench", "graft", "--lengths", "0,64"],
                 ["bench", "graft", "--repeats", "0"], ["bench", "router", "--sizes", ","]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "error: argument" in capsys.readouterr().err


def test_bench_capacity_refuses_a_target_not_above_the_small_store():
    import pytest

    from kvmemory.bench.capacity import run_capacity_bench
    from kvmemory.errors import InvalidInput

    with pytest.raises(InvalidInput, match="more than the 10,000 tokens"):
        run_capacity_bench(target_tokens=5_000, progress=False)
