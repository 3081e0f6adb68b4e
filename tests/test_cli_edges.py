"""The command line's edges a script depends on (issue 40, items 5-7): exit statuses it can trust
(`remember --jsonl` exits 3 when any line is refused, and says which), reading commands that work on a
read-only store and never create a store at a mistyped path, bad input refused before the model loads,
and a reader that closes stdout early (`| head -1`) ending the command quietly.

A tiny random-init Llama with the embedded model's tokenizer stands in for the model (every command
runs end to end in seconds); `--model /nonexistent-model` shows that a check ran before the model
would have loaded (otherwise the error would be UnknownModel).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvmemory.cli import main

NO_MODEL = "/nonexistent-model"
EGGS = ("Tom has 3 boxes of 12 eggs and breaks 5. How many are left?", "3 * 12 = 36. 36 - 5 = 31. The answer is 31.",
        "31")
PAGES = ("Ana reads 14 pages a day for 9 days. How many pages?", "14 * 9 = 126. The answer is 126.", "126")


def kvm(*args: str | bytes, env: dict | None = None, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmemory.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=600)


def run_main(*argv: str) -> tuple[int, str, str]:
    """`kvmemory.cli.main` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_model():
    """A tiny Llama with the embedded model's tokenizer and chat template (read from its files, no model load)."""
    from tiny_models import save_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="kvm-cli-edges-"))
    yield save_tiny_llama(root)
    shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------- bad input before the model loads
@pytest.mark.parametrize("argv, what", [
    (["remember", "--problem", "", "--solution", "x. The answer is 3.", "--answer", "3"], "problem is empty"),
    (["remember", "--problem", "   ", "--solution", "x"], "problem is empty"),
    (["remember", "--problem", b"Tom has 3 boxes\xff of eggs?", "--solution", "x"], "problem is not valid text"),
    (["remember", "--problem", "p?", "--solution", b"\xed\xa0\x80 The answer is 3."], "solution is not valid text"),
    (["ask", ""], "question is empty"),
    (["ask", b"How many eggs\xff?"], "question is not valid text"),
    (["ask", "How many eggs?", "--entry", b"e\xff"], "entry_id is not valid text"),
    (["ask", "How many eggs?", "--choice", ""], "choice is empty"),
    (["recall", ""], "query is empty"),
    (["recall", b"eggs\xfe"], "query is not valid text"),
    (["recall", "eggs", "--threshold", "nan"], "threshold must be"),
    (["recall", "eggs", "--namespace", b"tenant\xff"], "namespace is not valid text"),
    (["verify", "--entry", b"e\xff"], "entry_id is not valid text"),
    (["forget"], "give --entry ID"),
])
def test_bad_input_is_refused_before_the_model_loads(tmp_path, argv, what):
    store = tmp_path / "store"
    p = kvm(*argv, "--model", NO_MODEL, "--store", str(store), "--json")
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)
    assert err["error"] == "InvalidInput" and what in err["message"], err
    assert "Traceback" not in p.stderr.decode(errors="replace")


@pytest.mark.parametrize("argv, option", [
    (["ask", "How many eggs?", "--k", str(2**70)], "--k"),
    (["ask", "How many eggs?", "--k", "0"], "--k"),
    (["ask", "How many eggs?", "--max-tokens", "-1"], "--max-tokens"),
    (["ask", "How many eggs?", "--max-tokens", str(2**70)], "--max-tokens"),
    (["recall", "eggs", "--k", str(2**70)], "--k"),
    (["recall", "eggs", "--k", "-3"], "--k"),
])
def test_out_of_range_counts_are_usage_errors(tmp_path, argv, option):
    p = kvm(*argv, "--model", NO_MODEL, "--store", str(tmp_path / "store"))
    assert p.returncode == 2
    assert f"argument {option}" in p.stderr.decode() and "UnknownModel" not in p.stderr.decode()


# ---------------------------------------------------------------------- a store path that is not there
@pytest.mark.parametrize("argv", [
    ["recall", "How many eggs?"], ["ask", "How many eggs?"], ["ask", "How many eggs?", "--entry", "e0123456789abcdef"],
    ["verify", "--all"], ["forget", "--entry", "e0123456789abcdef"], ["reindex"],
    ["list"], ["stats"], ["export", "--out", "x.kvmb"],
])
def test_a_reading_command_on_a_missing_store_is_an_error_and_creates_nothing(tmp_path, argv):
    typo = tmp_path / "typo" / "store"
    extra = [] if argv[0] in ("list", "stats", "export") else ["--model", NO_MODEL]
    p = kvm(*argv, *extra, "--store", str(typo), "--json")
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)
    assert err["error"] == "StoreError" and f"no store at {typo}" in err["message"], err
    assert "remember` creates one" in err["message"]
    assert not typo.exists() and not typo.parent.exists()


# ---------------------------------------------------------------------- stdout closed by its reader
def test_a_reader_that_closes_stdout_ends_the_command_quietly(tmp_path):
    from kvmemory.store.local import LocalStore

    LocalStore(tmp_path / "store").close()
    read, write = os.pipe()
    os.close(read)  # `| head -1` that has already exited: every write gets EPIPE
    try:
        p = kvm("list", "--json", "--store", str(tmp_path / "store"), stdout=write)
    finally:
        os.close(write)
    assert p.stderr.decode() == ""  # no BrokenPipeError traceback, no "Exception ignored"
    assert p.returncode == 141  # what a shell reports for a tool ended by SIGPIPE


# ---------------------------------------------------------------------- remember --jsonl: each line's fate
def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_refused_lines_make_the_exit_status_3_and_are_listed(tiny_model, tmp_path):
    lines = _jsonl(tmp_path / "in.jsonl", [
        json.dumps(dict(zip(("problem", "solution", "answer"), EGGS))),
        "not json",
        json.dumps({"problem": PAGES[0], "solution": PAGES[1], "answer": "999"}),  # the verifier refuses it
        "",
        json.dumps({"problem": PAGES[0], "soluton": PAGES[1]}),  # a typo: an unknown field, not a missing one
        json.dumps(dict(zip(("problem", "solution", "answer"), PAGES))),
        json.dumps({"problem": "", "solution": "x"}),
    ])
    code, out, _ = run_main("remember", "--jsonl", str(lines), "--model", tiny_model, "--store",
                            str(tmp_path / "store"), "--json")
    assert code == 3
    report = json.loads(out)
    fates = {f["line"]: f for f in report["lines"]}
    assert sorted(fates) == [1, 2, 3, 5, 6, 7]
    assert [fates[n]["status"] for n in (1, 6)] == ["remembered"] * 2
    assert fates[1]["id"] == report["remembered"][0]["id"] and fates[6]["id"] == report["remembered"][1]["id"]
    assert {n: fates[n]["error"] for n in (2, 3, 5, 7)} == {2: "InvalidInput", 3: "VerificationFailed",
                                                            5: "InvalidInput", 7: "InvalidInput"}
    assert "not JSON" in fates[2]["message"] and "'soluton'" in fates[5]["message"]
    assert "problem is empty" in fates[7]["message"]
    assert [r["line"] for r in report["refused"]] == [2, 3, 5, 7]
    assert report["counts"] == {"lines": 6, "remembered": 2, "refused": 4}


def test_jsonl_every_line_remembered_exits_0(tiny_model, tmp_path):
    lines = _jsonl(tmp_path / "in.jsonl", [json.dumps(dict(zip(("problem", "solution", "answer"), t)))
                                           for t in (EGGS, PAGES)])
    code, out, _ = run_main("remember", "--jsonl", str(lines), "--model", tiny_model, "--store",
                            str(tmp_path / "store"), "--json")
    assert code == 0 and json.loads(out)["counts"] == {"lines": 2, "remembered": 2, "refused": 0}


def test_jsonl_whose_every_line_is_bad_is_refused_before_the_model_loads(tmp_path):
    lines = _jsonl(tmp_path / "in.jsonl", ["[1, 2]", json.dumps({"problem": "p?", "solution": ""}),
                                           json.dumps({"problem": "p\udcff?", "solution": "s"})])
    p = kvm("remember", "--jsonl", str(lines), "--model", NO_MODEL, "--store", str(tmp_path / "store"), "--json")
    assert p.returncode == 3, p.stderr
    report = json.loads(p.stdout)
    assert [(f["line"], f["error"]) for f in report["lines"]] == [(1, "InvalidInput"), (2, "InvalidInput"),
                                                                  (3, "InvalidInput")]
    assert "lone surrogate" in report["lines"][2]["message"]


def test_jsonl_lines_refused_when_redis_goes_away_exit_3(tiny_model, tmp_path, monkeypatch):
    """The issue's case: Redis killed after the first of four lines; the three refused lines (StoreUnavailable)
    made the command exit 0."""
    from redis_server import RedisServer

    from kvmemory.store.redis_store import RedisStore

    key = "ab" * 32
    problems = [(f"A box holds {n} eggs and {n + 1} more are added. How many eggs?",
                 f"{n} + {n + 1} = {2 * n + 1}. The answer is {2 * n + 1}.", str(2 * n + 1)) for n in (3, 5, 7, 9)]
    lines = _jsonl(tmp_path / "in.jsonl", [json.dumps(dict(zip(("problem", "solution", "answer"), t)))
                                           for t in problems])
    with RedisServer() as srv:
        # The lines are one batch (KVMemory.remember_many); a Redis store commits its entries one by one
        real = RedisStore.commit_entry

        def commit_then_kill(self, *a, **kw):
            real(self, *a, **kw)
            srv.stop()  # Redis dies after the first entry is committed

        monkeypatch.setattr(RedisStore, "commit_entry", commit_then_kill)
        code, out, _ = run_main("remember", "--jsonl", str(lines), "--model", tiny_model, "--store",
                                f"{srv.url}?store=t40&tier={tmp_path / 'tier'}", "--signing-key", key, "--json")
    report = json.loads(out)
    assert code == 3
    assert [f["status"] for f in report["lines"]] == ["remembered", "refused", "refused", "refused"]
    assert {f["error"] for f in report["lines"][1:]} == {"StoreUnavailable"}


# ---------------------------------------------------------------------- read-only stores
@pytest.fixture
def read_only(tmp_path):
    """Make a folder read-only for this process, as an operator would: a read-only bind mount when
    running as root (root ignores chmod), else chmod -R a-w. Returns the read-only path."""
    made: list = []

    def make(folder: Path) -> Path:
        if os.geteuid() == 0:
            ro = tmp_path / "ro"
            ro.mkdir()
            for cmd in (["mount", "--bind", str(folder), str(ro)], ["mount", "-o", "remount,bind,ro", str(ro)]):
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)}: {r.stderr}")  # root that cannot mount: look at it
                made.append(("umount", ro))
            return ro
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
        made.append(("chmod", folder))
        return folder

    yield make
    for kind, path in reversed(made):
        if kind == "umount":
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        else:
            subprocess.run(["chmod", "-R", "u+w", str(path)], capture_output=True)


def test_reading_commands_work_on_a_read_only_store(tiny_model, tmp_path, read_only):
    store = tmp_path / "store"
    p = kvm("remember", "--problem", EGGS[0], "--solution", EGGS[1], "--answer", EGGS[2], "--model", tiny_model,
            "--store", str(store), "--json")
    assert p.returncode == 0, p.stderr
    eid = json.loads(p.stdout)["remembered"][0]["id"]
    ro = read_only(store)
    with pytest.raises(OSError):
        (ro / "probe").write_text("x")  # really read-only for this process
    before = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    q = "Tom owns 3 boxes of 12 eggs; 5 break. How many remain?"
    for argv in (["list", "--json"], ["stats", "--json"], ["export", "--out", str(tmp_path / "b.kvmb"), "--json"],
                 ["recall", q, "--model", tiny_model, "--json"],
                 ["ask", q, "--answer-prefix", "The answer is", "--choices", "numbers", "--model", tiny_model,
                  "--json"],
                 ["ask", "How many boxes?", "--entry", eid, "--max-tokens", "4", "--model", tiny_model, "--json"],
                 ["verify", "--all", "--model", tiny_model, "--json"]):
        code, out, err = run_main(*argv, "--store", str(ro))
        assert code == 0, (argv, code, out, err)
        assert "Traceback" not in err
    code, out, _ = run_main("recall", q, "--model", tiny_model, "--json", "--store", str(ro))
    assert [h["id"] for h in json.loads(out)["hits"]] == [eid]
    code, out, _ = run_main("verify", "--all", "--model", tiny_model, "--json", "--store", str(ro))
    assert json.loads(out)["bit_identical"] == 1
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == before  # nothing written


def test_writing_commands_on_a_read_only_store_refuse_before_the_model_loads(tiny_model, tmp_path, read_only):
    store = tmp_path / "store"
    assert kvm("remember", "--problem", EGGS[0], "--solution", EGGS[1], "--answer", EGGS[2], "--model", tiny_model,
               "--store", str(store)).returncode == 0
    ro = read_only(store)
    lines = _jsonl(tmp_path / "in.jsonl", [json.dumps(dict(zip(("problem", "solution", "answer"), PAGES)))])
    for argv in (["remember", "--problem", PAGES[0], "--solution", PAGES[1], "--answer", PAGES[2]],
                 ["remember", "--jsonl", str(lines)], ["forget", "--all-in-namespace"], ["reindex"]):
        p = kvm(*argv, "--model", NO_MODEL, "--store", str(ro), "--json")
        assert p.returncode == 2, (argv, p.stderr)
        err = json.loads(p.stdout)
        assert err["error"] == "StoreReadOnly" and "read-only" in err["message"], (argv, err)


def test_a_read_only_view_of_a_store_in_use_reads_without_writing(tiny_model, tmp_path, read_only):
    """A writer elsewhere holds the store open (its WAL and -shm files exist) while a reader sees the
    folder read-only: the reader's router lock must be taken without writing (it crashed with an
    OSError on router/.lock)."""
    from kvmemory.store.local import LocalStore

    store = tmp_path / "store"
    p = kvm("remember", "--problem", EGGS[0], "--solution", EGGS[1], "--answer", EGGS[2], "--model", tiny_model,
            "--store", str(store), "--json")
    assert p.returncode == 0, p.stderr
    eid = json.loads(p.stdout)["remembered"][0]["id"]
    writer = LocalStore(store)  # the live writer: WAL mode keeps -wal and -shm beside the catalogue
    try:
        assert writer.entry_ids() == [eid]
        assert (store / "catalogue.sqlite-shm").exists()
        ro = read_only(store)
        q = "Tom owns 3 boxes of 12 eggs; 5 break. How many remain?"
        p = kvm("recall", q, "--model", tiny_model, "--store", str(ro), "--json")
        assert p.returncode == 0, p.stderr
        assert [h["id"] for h in json.loads(p.stdout)["hits"]] == [eid]
        p = kvm("ask", "How many boxes?", "--entry", eid, "--max-tokens", "2", "--model", tiny_model, "--store",
                str(ro), "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["tokens_grafted"] > 0
    finally:
        writer.close()


def test_export_with_entries_left_out_exits_3(tmp_path):
    """A signed store holding a forged row: export writes the bundle without it, and says so with exit 3
    (it exited 0, so a backup script could not tell that the bundle lacks an entry)."""
    from redis_server import synth_entry

    from kvmemory.store.signing import SignedLocalStore

    key = "cd" * 32
    st = SignedLocalStore(tmp_path / "store", signer=key)
    good, gb = synth_entry(1)
    forged, fb = synth_entry(2)
    st.commit_entry(good, gb)
    st.commit_entry(forged, fb)
    st.put_profile(good.profile_id, {"synthetic": True})
    st._db().execute("UPDATE entries SET answer='42' WHERE id=?", (forged.id,))  # a writer without the key
    st.close()
    p = kvm("export", "--store", str(tmp_path / "store"), "--signing-key", key, "--out", str(tmp_path / "b.kvmb"),
            "--json")
    assert p.returncode == 3, p.stderr
    report = json.loads(p.stdout)
    assert report["left_out"] == [forged.id] and report["entry_ids"] == [good.id]


def test_a_read_only_catalogue_whose_wal_cannot_be_read_is_refused_by_name(tmp_path, read_only):
    """A copy taken while a writer had commits in SQLite's WAL (and without its -shm): reading it needs
    a write beside it, so a read-only folder is refused, saying why; it is never read without those
    commits."""
    from redis_server import synth_entry

    from kvmemory.store.local import LocalStore

    live = LocalStore(tmp_path / "live")
    live.commit_entry(*synth_entry(1))
    assert (tmp_path / "live" / "catalogue.sqlite-wal").stat().st_size > 0  # the commit is in the WAL
    shutil.copytree(tmp_path / "live", tmp_path / "copy", ignore=shutil.ignore_patterns("*-shm"))
    live.close()
    ro = read_only(tmp_path / "copy")
    p = kvm("list", "--json", "--store", str(ro))
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)
    assert err["error"] == "StoreReadOnly" and "catalogue.sqlite-wal" in err["message"], err
