"""`kvmemory bench answer` on a tiny setting: every side runs and keeps its samples, kvmemory's greedy
tokens equal its own recompute's (by equality), llama.cpp runs when llama-cpp-python is installed (it is
skipped, with the reason stated, only when it is missing). Behaviour, not speed: figures are measured
by the bench itself on a quiet machine."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from kvmemory.bench import llamacpp


def test_bench_answer_tiny(tmp_path):
    from kvmemory.bench.answer import SIDES, format_table, plot, run_answer_bench

    # one thread: the test checks behaviour, and one thread is what a loaded shared machine runs steadily
    r = run_answer_bench((64,), new_tokens=3, repeats=2, threads=1, progress=False)
    json.dumps(r)  # the JSON the CLI prints
    have_llama = llamacpp.available() is None
    assert r["sides_measured"] == (list(SIDES) if have_llama else ["kvmemory"])
    if not have_llama:
        assert r["llamacpp"] == llamacpp.MISSING
    (row,) = r["rows"]
    assert row["L"] == 64 and row["tokens_grafted"] == 64 and row["tokens_computed"] == row["question_tokens"]
    # exact: all N greedy tokens of every timed graft are the recompute's
    assert row["tokens_equal_recompute"] is True
    assert row["kvmemory_tokens"] == row["recompute_tokens"] and len(row["recompute_tokens"]) == 3
    for side in r["sides_measured"]:
        s = row["sides"][side]
        for key in ("ttft_s", "decode_s", "total_s"):
            assert len(s[key]["samples"]) == 2 and all(x > 0 for x in s[key]["samples"])
            assert s[key]["median"] == statistics.median(s[key]["samples"])
        assert s["decode_tokens_per_s"] == 2 / s["decode_s"]["median"]  # N - 1 steps
        assert all(t <= tot for t, tot in zip(s["ttft_s"]["samples"], s["total_s"]["samples"]))
    if have_llama:
        assert "same GGUF file" in r["llamacpp"] and f", {r['threads']} threads, setting default" in r["llamacpp"]
        assert row["llamacpp_state_bytes"] > 0
        assert set(row["targets"]) == {"decode_within_1.25x", "answer_below_restore"}
        assert row["decode_ratio_llamacpp_over_kvmemory"] == (row["sides"]["llamacpp_restore"]["decode_tokens_per_s"]
                                                              / row["sides"]["kvmemory"]["decode_tokens_per_s"])
    text = format_table(r)
    assert "| 64 |" in text and ("llama.cpp restore" in text) == have_llama
    plot(r, str(tmp_path / "answer.png"))
    assert (tmp_path / "answer.png").stat().st_size > 0


def test_llamacpp_missing_is_a_stated_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert llamacpp.available() == llamacpp.MISSING


def test_bench_answer_refuses_bad_settings_before_loading():
    from kvmemory.bench.answer import run_answer_bench
    from kvmemory.errors import InvalidInput

    for kw in ({"lengths": (100,)}, {"lengths": ()}, {"new_tokens": 1}, {"repeats": 0},
               {"llamacpp_setting": "fastest"}):
        with pytest.raises(InvalidInput):
            run_answer_bench(**{"lengths": (64,), **kw}, progress=False)


def test_bench_answer_cli_options():
    from kvmemory.cli import build_parser

    args = build_parser().parse_args(["bench", "answer", "--lengths", "64,128", "--new-tokens", "8", "--repeats", "2",
                                      "--threads", "1", "--no-llamacpp", "--llamacpp-setting", "flash-q8_0", "--seed",
                                      "3", "--plot", "a.png", "--json"])
    assert (args.lengths, args.new_tokens, args.repeats, args.threads, args.no_llamacpp, args.seed, args.plot,
            args.json, args.llamacpp_setting) == ((64, 128), 8, 2, 1, True, 3, "a.png", True, "flash-q8_0")
    assert args.func.__name__ == "bench_answer"
