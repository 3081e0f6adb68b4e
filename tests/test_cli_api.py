"""The command line's get / update / history (the Python API's `get`, `update`, `history`, with the
memory API's JSON), and progress on long commands: a bar on stderr under a terminal (even one that
reports no size, as a pty opened without one does), a note while the model loads, and --json output
on stdout that stays clean.

Driven as a user would: subprocesses, stderr on a pseudo-terminal (the `pty` module) where a
terminal is the point, a temporary store.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest

LINES = [{"problem": "Ana reads 14 pages a day for 9 days. How many pages does she read?",
          "solution": "14 * 9 = 126. The answer is 126.", "answer": "126", "meta": {"topic": "pages"}},
         {"problem": "A tank holds 450 litres and leaks 35 litres. How much water is left?",
          "solution": "450 - 35 = 415. The answer is 415.", "answer": "415"}]
VERSION_KEYS = {"version", "problem", "solution", "answer", "verified", "meta", "aliases", "chain", "attestation_id",
                "updated", "replaced"}


def kvm(*args, store, check=True):
    env = {**os.environ, "KVMEMORY_STORE": str(store)}
    p = subprocess.run([sys.executable, "-m", "kvmemory.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"kvmemory {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def on_terminal(*args, store) -> tuple[int, str, str]:
    """`kvmemory ARGS` with stderr (and stdin) on a fresh pseudo-terminal that reports no size (0 x 0,
    as `docker exec -t` and CI runners give) and stdout on a pipe: (exit status, stdout, stderr)."""
    master, slave = pty.openpty()
    env = {**os.environ, "KVMEMORY_STORE": str(store)}
    for name in ("TQDM_NCOLS", "TQDM_NROWS", "COLUMNS", "LINES"):
        env.pop(name, None)
    p = subprocess.Popen([sys.executable, "-m", "kvmemory.cli", *args], stdin=slave, stdout=subprocess.PIPE,
                         stderr=slave, env=env, close_fds=True)
    os.close(slave)
    err = b""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            err += data
        elif p.poll() is not None:
            break
    out = p.stdout.read().decode()
    p.wait(60)
    os.close(master)
    return p.returncode, out, err.decode(errors="replace")


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A store with the two lines remembered by `remember --jsonl --json` on a terminal, and what it printed."""
    tmp = tmp_path_factory.mktemp("cli-api")
    path = tmp / "lines.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in LINES))
    store = tmp / "store"
    code, out, err = on_terminal("remember", "--jsonl", str(path), "--json", store=store)
    assert code == 0, err
    return store, json.loads(out), err


def test_remember_jsonl_draws_a_bar_on_a_terminal_and_keeps_stdout_json(filled):
    _, report, err = filled
    assert report["counts"] == {"lines": 2, "remembered": 2, "refused": 0}  # stdout: the JSON alone
    assert "loading the model" in err and "model loaded in" in err
    assert "remember: 100%" in err and "2/2" in err  # the bar, drawn though the terminal reports no size


def test_verify_all_says_it_loads_then_draws_a_bar(filled):
    store, _, _ = filled
    code, out, err = on_terminal("verify", "--all", "--json", store=store)
    assert code == 0, err
    assert json.loads(out)["bit_identical"] == 2  # stdout: the JSON alone
    assert err.index("loading the model") < err.index("verify:")  # nothing is silent while the model loads
    assert "verify: 100%" in err and "2/2" in err


def test_fsck_draws_a_bar_over_the_blocks_it_hashes(filled):
    store, _, _ = filled
    code, out, err = on_terminal("fsck", "--json", store=store)
    assert code == 0, err
    blocks = json.loads(out)["blocks_checked"]  # stdout: the JSON alone
    assert blocks >= 2 and "fsck: blocks: 100%" in err and f"{blocks}/{blocks}" in err


def test_get_history_and_a_metadata_update_load_no_model(filled):
    store, report, _ = filled
    eid = report["remembered"][0]["id"]
    got = json.loads(kvm("get", eid, "--json", store=store).stdout)
    assert got["id"] == eid and got["version"] == 1 and got["metadata"] == {"topic": "pages"}
    assert got["problem"] == LINES[0]["problem"] and got["attestation"]["bit_identical"]

    p = kvm("update", eid, "--meta", "topic=reading", "--meta", "n=3", store=store)  # no --json: notes shown
    assert p.stdout.startswith("updated to version 2") and "topic" in p.stdout
    assert "loading the model" not in p.stderr  # metadata changes no KV: no model
    up = json.loads(kvm("get", eid, "--json", store=store).stdout)
    assert up["version"] == 2 and up["metadata"] == {"topic": "reading", "n": 3}
    assert up["attestation_id"] == got["attestation_id"]
    removed = json.loads(kvm("update", eid, "--meta", "n=null", "--json", store=store).stdout)
    assert removed["version"] == 3 and removed["metadata"] == {"topic": "reading"}

    hist = json.loads(kvm("history", eid, "--json", store=store).stdout)
    assert hist["id"] == eid and [v["version"] for v in hist["versions"]] == [1, 2, 3]
    assert all(set(v) == VERSION_KEYS for v in hist["versions"])  # EntryVersion.to_json, as over HTTP
    assert [v["meta"] for v in hist["versions"]] == [{"topic": "pages"}, {"topic": "reading", "n": 3},
                                                     {"topic": "reading"}]
    text = kvm("history", eid, store=store).stdout
    assert "3 version(s)" in text and "v3" in text


def test_bad_update_and_unknown_ids_exit_2(filled):
    store, report, _ = filled
    eid = report["remembered"][0]["id"]
    for argv, said in ((["get", "0123456789abcdef"], "UnknownEntry"), (["history", "0123456789abcdef"], "UnknownEntry"),
                       (["update", "0123456789abcdef", "--meta", "x=1"], "UnknownEntry"),
                       (["update", eid], "nothing to update"),
                       (["update", eid, "--answer", "126", "--no-answer"], "not both"),
                       (["update", eid, "--meta", "aliases=[1]"], "kvmemory's own"),
                       (["get", eid, "--namespace", "elsewhere"], "is in namespace 'default'")):
        p = kvm(*argv, store=store, check=False)  # no --json: a model loading would say so on stderr
        assert p.returncode == 2, (argv, p.stdout, p.stderr)
        assert said in p.stderr and "loading the model" not in p.stderr, (argv, p.stderr)
    p = kvm("update", "0123456789abcdef", "--meta", "x=1", "--json", store=store, check=False)
    assert p.returncode == 2 and json.loads(p.stdout.splitlines()[0])["error"] == "UnknownEntry"


def test_update_of_the_texts_verifies_and_proves_a_new_version(filled):
    store, report, _ = filled
    eid = report["remembered"][1]["id"]
    new = "The tank had 450 litres; 35 leaked out, so 450 - 35 = 415. The answer is 415."
    up = json.loads(kvm("update", eid, "--solution", new, "--alias", "How much water stays in the tank?", "--json",
                        store=store).stdout)
    assert up["version"] == 2 and up["solution"] == new and up["verified"] and up["attestation"]["bit_identical"]
    assert up["aliases"] == ["How much water stays in the tank?"]
    hist = json.loads(kvm("history", eid, "--json", store=store).stdout)
    assert [v["solution"] for v in hist["versions"]] == [LINES[1]["solution"], new]
    assert hist["versions"][0]["attestation_id"] != hist["versions"][1]["attestation_id"]
