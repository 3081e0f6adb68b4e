"""`kvmemory bench serve --llama-server PATH`: llama.cpp's C++ server as a third side. The CLI refuses a
path that is not an executable before any model loads (always run); with a binary present
($KVMEMORY_LLAMA_SERVER, or /work/llama-server/llama-server as scripts/build_llama_server.sh leaves it)
a tiny run (one client, one request per kind) must get llama-server's answers to the same requests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvmemory import cli
from kvmemory.bench import serve as bench_serve
from kvmemory.errors import InvalidInput

DEFAULT_BINARY = "/work/llama-server/llama-server"


def _binary() -> str | None:
    for p in (os.environ.get(bench_serve.LLAMA_SERVER_ENV), DEFAULT_BINARY):
        if p and Path(p).is_file() and os.access(p, os.X_OK):
            return p
    return None


def test_the_cli_refuses_a_missing_llama_server_before_loading_a_model(tmp_path, monkeypatch, capsys):
    def boom(*a, **k):
        raise AssertionError("the bench ran (a model would load) despite a bad --llama-server")

    monkeypatch.setattr(bench_serve, "run_serve_bench", boom)
    missing = tmp_path / "no-such-llama-server"
    assert cli.main(["bench", "serve", "--llama-server", str(missing), "--json"]) == 2
    out = capsys.readouterr()
    msg = json.loads(out.out.strip().splitlines()[-1])
    assert msg["error"] == "InvalidInput" and str(missing) in msg["message"] and "not a file" in msg["message"]
    not_exec = tmp_path / "llama-server"
    not_exec.write_text("#!/bin/sh\n")
    not_exec.chmod(0o644)
    assert cli.main(["bench", "serve", "--llama-server", str(not_exec)]) == 2
    assert "not executable" in capsys.readouterr().err
    # the environment variable is checked the same way; unset, the side is simply not run
    monkeypatch.setenv(bench_serve.LLAMA_SERVER_ENV, str(missing))
    with pytest.raises(InvalidInput):
        bench_serve.resolve_llama_server(None)
    monkeypatch.delenv(bench_serve.LLAMA_SERVER_ENV)
    assert bench_serve.resolve_llama_server(None) is None


def test_llama_server_command_has_one_slot_per_client(tmp_path):
    s = bench_serve.llama_server_process(tmp_path, "/bin/llama-server", "/m.gguf", 2, 16, "n16-r0")
    cmd = s.cmd
    assert cmd[cmd.index("-np") + 1] == "16" and cmd[cmd.index("-c") + 1] == str(16 * bench_serve.LLAMA_SERVER_CTX_PER_SLOT)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-tb") + 1] == "2" and "-cb" in cmd
    assert s.ready_path == "/health" and s.body_extra == {}  # byte-identical request bodies


@pytest.mark.slow
@pytest.mark.skipif(_binary() is None, reason=f"no llama-server binary (${bench_serve.LLAMA_SERVER_ENV} or {DEFAULT_BINARY})")
def test_bench_serve_runs_llama_server_at_one_client():
    r = bench_serve.run_serve_bench((1,), per_kind=1, repeats=1, max_tokens=6, check_per_kind=0, llamacpp=False,
                                    progress=False, llama_server=_binary())
    json.dumps(r)
    assert r["errors"] == 0 and r["ok"], bench_serve.format_table(r)
    ls = r["sides"]["llama-server"]
    assert ls["ran"] and len(ls["runs"]) == 1 and ls["server"]["build"]
    run = ls["runs"][0]
    assert run["requests"] == 3 and run["errors"] == 0 and run["exit_code"] is not None
    assert all(rec["ok"] and rec["text"].strip() for rec in run["records"])  # it answered every request
    kv = r["sides"]["kvmemory"]["runs"][0]
    assert [x["request_sha256"] for x in run["records"]] == [x["request_sha256"] for x in kv["records"]]
    assert run["decode_tokens_per_s"] > 0 and run["tokens_computed_mean"] is not None
    assert "| 1 | llama-server |" in bench_serve.format_table(r)
