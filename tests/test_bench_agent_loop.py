"""`kvmemory bench agent-loop` on a tiny setting (2 turns, 2 repeats, a restart at turn 2): every side
runs every turn and keeps its samples, kvmemory's first token equals its recompute's (by equality),
turn k grafts the full blocks turn k-1 stored, the restart side runs in other processes, and llama.cpp
runs when llama-cpp-python is installed (skipped, with the reason stated, only when it is missing)."""

from __future__ import annotations

import json
import os
import statistics

from kvmemory.bench import llamacpp


def test_conversation_is_deterministic_and_resends_the_history():
    from kvmemory.bench.agent_loop import conversation

    turns = conversation(20)
    assert len(turns) == 20 and turns == conversation(20)
    assert turns[0][0]["role"] == "system" and "<tools>" in turns[0][0]["content"]
    for k in range(1, 20):  # each prompt is the previous one plus what happened since
        assert turns[k][: len(turns[k - 1])] == turns[k - 1]
    assert [m["role"] for m in turns[1][-3:]] == ["user", "assistant", "tool"]
    assert turns[1][-2]["content"].startswith("<tool_call>")


def test_bench_agent_loop_tiny(tmp_path):
    from kvmemory.bench.agent_loop import IN_PROCESS, RESTART, format_table, plot, run_agent_loop_bench

    # one thread: the test checks behaviour, and one thread is what a loaded shared machine runs steadily
    r = run_agent_loop_bench(2, repeats=2, restart_turns=[2], threads=1, progress=False)
    json.dumps(r)
    have_llama = llamacpp.available() is None
    assert r["sides_measured"] == (list(IN_PROCESS) if have_llama else ["kvmemory", "recompute"])
    assert r["restart_sides_measured"] == (list(RESTART) if have_llama else ["kvmemory"])
    if not have_llama:
        assert r["llamacpp"] == llamacpp.MISSING
    C = r["chunk"]
    first, second = r["rows"]
    for row in r["rows"]:
        assert row["first_token_equal_recompute"] == [True, True]  # exact, every repeat
        for side in r["sides_measured"]:
            t = row["ttft_s"][side]
            assert len(t["samples"]) == 2 and all(x > 0 for x in t["samples"])
            assert t["median"] == statistics.median(t["samples"])
            assert all(a <= b for a, b in zip(t["samples"], row["call_s"][side]["samples"]))
        if have_llama:  # same prompt ids, greedy: llama.cpp's first token is reported (not owed to be equal)
            assert all(isinstance(x, int) for x in row["first_tokens"]["llamacpp_ram"])
    # Turn 1 computes everything and stores its full blocks; turn 2 grafts them.
    assert first["tokens_grafted"] == [0, 0] and first["blocks_stored"] == [first["prompt_tokens"] // C] * 2
    assert second["shared_with_previous"] >= first["prompt_tokens"] - 1  # the whole history re-sent
    previous_blocks = (first["prompt_tokens"] - 1) // C * C
    assert second["expected_min_grafted"] >= previous_blocks > 0
    assert min(second["tokens_grafted"]) >= second["expected_min_grafted"]
    # The restart: two fresh processes (one per repeat), not this one, grafting the same blocks.
    rs = second["restart"]
    assert len(rs["pids"]) == 2 and os.getpid() not in rs["pids"] and r["bench_pid"] not in rs["pids"]
    assert len(set(rs["pids"])) == 2
    assert min(rs["tokens_grafted"]) >= second["expected_min_grafted"]
    assert rs["first_token_equal_recompute"] == [True, True]
    for side in r["restart_sides_measured"]:
        assert len(rs["ttft_s"][side]["samples"]) == 2 and all(x > 0 for x in rs["ttft_s"][side]["samples"])
    assert all(w["kvmemory"]["blocks_stored"] == 0 for w in rs["workers"])  # the restarted side writes nothing
    assert "after a process restart" in format_table(r)
    plot(r, str(tmp_path / "loop.png"))
    assert (tmp_path / "loop.png").stat().st_size > 0


def test_bench_agent_loop_cli_options():
    from kvmemory.cli import build_parser

    args = build_parser().parse_args(["bench", "agent-loop", "--turns", "4", "--repeats", "2", "--restart-turns",
                                      "2,4", "--threads", "1", "--no-llamacpp", "--llamacpp-setting", "flash-f16",
                                      "--plot", "l.png", "--json"])
    assert (args.turns, args.repeats, args.restart_turns, args.no_restart, args.threads, args.no_llamacpp,
            args.plot, args.json, args.llamacpp_setting) == (4, 2, (2, 4), False, 1, True, "l.png", True, "flash-f16")
    assert args.func.__name__ == "bench_agent_loop"
