"""`kvmemory bench serve`, tiny: one client, two requests of each kind, one repeat, against a real
`kvmemory serve` process and, where llama-cpp-python and its server's deps are installed, llama.cpp's
own server on the same GGUF file; where they are not, the report must say that side was not run.
The figures are not checked (a benchmark is not a timed test); the report's fields, the absence of
errors and the sampled exactness check are."""

from __future__ import annotations

import json

import pytest

from kvmemory.bench.serve import KINDS, format_table, llamacpp_missing, llamacpp_tokens_from_log, make_workload, plot

pytestmark = pytest.mark.slow


def test_the_workload_is_seeded_and_conversations_repeat_their_turns():
    a, b = make_workload(2, 3, seed=0, repeat=0), make_workload(2, 3, seed=0, repeat=0)
    assert [[r.messages for r in c] for c in a.clients] == [[r.messages for r in c] for c in b.clients]
    assert make_workload(2, 3, seed=0, repeat=1).library != a.library  # each run's content is new
    for reqs in a.clients:
        assert sorted(r.kind for r in reqs) == sorted(k for k in KINDS for _ in range(3))
        turns = [r for r in reqs if r.kind == "conversation"]
        assert [r.index for r in turns] == [0, 1, 2]
        for prev, cur in zip(turns, turns[1:]):  # turn k repeats turns 1..k-1
            assert cur.messages[: len(prev.messages)] == prev.messages and len(cur.messages) == len(prev.messages) + 2
    assert len(a.library) == 3 and all(e["solution"].endswith(f"The answer is {e['answer']}.") for e in a.library)


def test_llamacpp_tokens_are_read_per_request_from_its_log():
    log = "\n".join([
        "Llama._create_completion: cache miss",
        "llama_perf_context_print: prompt eval time =      12.00 ms /    50 tokens (0.2 ms per token)",
        "llama_perf_context_print:        eval time =      40.00 ms /    19 runs",
        "llama_perf_context_print:       total time =      60.00 ms /    69 tokens",
        "Llama.generate: 50 prefix-match hit, remaining 27 prompt tokens to eval",
        "llama_perf_context_print: prompt eval time =      10.00 ms /    27 tokens (0.3 ms per token)",
        "llama_perf_context_print:       total time =      30.00 ms /    42 tokens",
    ])
    assert llamacpp_tokens_from_log(log) == [{"tokens_computed": 50, "prefix_reused": 0, "prompt_tokens": 50},
                                             {"tokens_computed": 27, "prefix_reused": 50, "prompt_tokens": 77}]


def test_bench_serve_tiny(tmp_path):
    from kvmemory.bench.serve import run_serve_bench

    r = run_serve_bench((1,), per_kind=2, repeats=1, max_tokens=6, check_per_kind=1, progress=False)
    json.dumps(r)  # the report is plain JSON
    assert r["errors"] == 0 and r["ok"], format_table(r)
    assert r["machine"]["cores"] and len(r["machine"]["load_average"]) == 3 and len(r["load_average_after"]) == 3
    kv = r["sides"]["kvmemory"]
    assert kv["ran"] and len(kv["runs"]) == 1
    run = kv["runs"][0]
    assert run["requests"] == 6 and run["errors"] == 0 and len(run["records"]) == 6
    assert run["remembered"]["verified"] == 2 and not run["remembered"]["errors"]
    assert run["requests_per_s"] > 0 and 0 < run["ttft_p50_s"] <= run["last_token_p50_s"]
    for rec in run["records"]:
        assert rec["ok"] and rec["total_s"] >= rec["ttft_s"] > 0
        k = rec["kvmemory"]
        assert k["tokens_grafted"] + k["tokens_computed"] == rec["usage"]["prompt_tokens"]
        assert rec["usage"]["prompt_tokens_details"]["cached_tokens"] == k["tokens_grafted"]
    # the recurring questions were routed to their remembered entries and grafted them
    assert run["by_kind"]["recurring"]["routed"] >= 1 and run["by_kind"]["recurring"]["tokens_grafted_mean"] >= 64
    # turn 2 of a conversation grafted turn 1's blocks
    turn2 = [x for x in run["records"] if x["kind"] == "conversation" and x["index"] == 1]
    assert turn2 and turn2[0]["kvmemory"]["tokens_grafted"] >= 64
    e = r["exactness"]
    assert e["checked"] == 3 and e["equal"] == 3 and e["ok"]
    assert all(s["served_logits_sha256"] == s["recompute_logits_sha256"] for s in e["samples"])
    rows = {(x["side"], x["clients"]): x for x in r["summary"]}
    assert rows[("kvmemory", 1)]["errors"] == 0 and rows[("kvmemory", 1)]["requests_per_s"]["n"] == 1

    lc = r["sides"]["llamacpp"]
    why = llamacpp_missing()
    if why is None:
        assert lc["ran"] and lc["runs"][0]["errors"] == 0 and lc["runs"][0]["requests"] == 6
        # the very same requests, in the same order
        assert [x["request_sha256"] for x in lc["runs"][0]["records"]] == [x["request_sha256"] for x in run["records"]]
        assert lc["runs"][0]["log_requests"] == 6 and lc["runs"][0]["tokens_computed_mean"] is not None
        assert "llama-cpp-python" in lc["server"]["build"] and ("llamacpp", 1) in rows
    else:  # not faked: the report says it was not run, and why
        assert lc == {"ran": False, "reason": why} and why.startswith("not run")
        assert ("llamacpp", 1) not in rows and "llamacpp: not run" in format_table(r)
    assert run["completion_tokens"] == sum(x["usage"]["completion_tokens"] for x in run["records"])
    assert run["decode_tokens_per_s"] == pytest.approx(run["completion_tokens"] / run["wall_s"])
    ls = r["sides"]["llama-server"]
    if r["settings"]["llama_server"] is None:  # no binary given: not run, and the report says why
        assert ls["ran"] is False and ls["reason"].startswith("not run") and ("llama-server", 1) not in rows
        assert "llama-server: not run" in format_table(r)
    assert "| 1 | kvmemory |" in format_table(r)
    plot(r, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
