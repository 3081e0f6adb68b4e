"""`kvmemory bench gpu` on the CPU with the tiny shape (the path CI covers; the figures themselves are
measured on a GPU by scripts/gpu_check.py and recorded in BENCHMARKS.md)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from kvmemory.bench.gpu import SHAPES, format_table, plot, run_gpu_bench
from kvmemory.errors import InvalidInput

SIDES = {"single_pass", "graft", "recompute", "remember"}


def test_bench_gpu_tiny_on_the_cpu(tmp_path):
    seen = []
    r = run_gpu_bench(["tiny"], lengths=(128, 192), repeats=3, device="cpu", step="static", progress=False,
                      on_result=lambda rep: seen.append(json.dumps(rep)))
    json.dumps(r)
    assert r["ok"] is True and r["device"] == "cpu" and r["targets"] == []  # issue 39's goals are the GPU's
    assert r["link"]["gb_s"] > 0 and "no host-to-device link" in r["link"]["kind"]
    assert len(seen) == 3 and json.loads(seen[-1]) == json.loads(json.dumps(r))  # written after each length
    (shape,) = r["shapes"]
    assert shape["shape"] == "tiny" and shape["step_mode"] == "static" and shape["skipped"] == []
    assert [x["L"] for x in shape["rows"]] == [128, 192]
    for x in shape["rows"]:
        # the premise: all but the last 64 tokens grafted, one grid step computed
        assert x["tokens_grafted"] == x["L"] - 64 and x["tokens_computed"] == 64 and "premise_broken" not in x
        assert x["first_token_equal_recompute"] is True and x["remember_bit_identical"] is True
        assert x["first_token"]["graft"] == x["first_token"]["recompute"]
        assert set(x["samples_s"]) == SIDES and all(len(v) == 3 for v in x["samples_s"].values())
        for side, samples in x["samples_s"].items():
            sp = x["ttft_s"][side]
            assert (sp["median"], sp["min"], sp["max"], sp["n"]) == (statistics.median(samples), min(samples),
                                                                      max(samples), 3)
        # interleaved: the second round runs the sides in reverse
        assert x["round_orders"][1] == x["round_orders"][0][::-1] and x["round_orders"][2] == x["round_orders"][0]
        # the floor: the grafted bytes over the measured link, plus the graft's own step
        assert x["bytes_grafted"] > 0
        assert x["floor_parts_s"]["link"] == x["bytes_grafted"] / (r["link"]["gb_s"] * 1e9)
        assert x["floor_s"] == x["floor_parts_s"]["link"] + x["floor_parts_s"]["step"]
        assert x["floor_parts_s"]["step"] == x["graft_parts_s"]["compute_seconds"]
        assert x["graft_over_floor"] == x["ttft_s"]["graft"]["median"] / x["floor_s"]
        assert x["speedup_vs_single_pass"] == x["ttft_s"]["single_pass"]["median"] / x["ttft_s"]["graft"]["median"]
        # the hot tier is a hook until a build has one: skipped, with the reason
        assert "hot tier" in x["sides_skipped"]["graft_hot_tier"]
    table = format_table(r)
    assert "| 192 |" in table and "side graft_hot_tier not timed" in table
    plot(r, str(tmp_path / "gpu.png"))
    assert (tmp_path / "gpu.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_gpu_command_line(capsys):
    from kvmemory.cli import main

    assert main(["bench", "gpu", "--shapes", "tiny", "--device", "cpu", "--lengths", "128", "--repeats", "1",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["shapes"][0]["rows"][0]["first_token_equal_recompute"] is True
    assert r["shapes"][0]["step_mode"] == "dynamic"  # auto on the CPU


def test_bench_gpu_refuses_bad_arguments():
    with pytest.raises(InvalidInput, match="shapes"):
        run_gpu_bench(["llama-70b"], device="cpu")
    with pytest.raises(InvalidInput, match="multiples"):
        run_gpu_bench(["tiny"], lengths=(100,), device="cpu")


def test_shapes_are_the_models_configs():
    """The configs written in code have the parameter counts of the models they stand for."""
    from transformers import AutoModelForCausalLM

    for name, params in (("smollm2-135m", 134.5e6), ("llama-3.1-8b", 8.03e9)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(SHAPES[name](4096))
        assert abs(sum(p.numel() for p in model.parameters()) - params) / params < 0.001
