"""The `kvmemory` command line, driven as a user would (subprocesses, --json, a temporary store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBLEM = "A farmer has 12 rows of 15 cabbages. Rabbits eat 23 cabbages. How many cabbages are left?"
SOLUTION = "Cabbages planted: 12 * 15 = 180.\nAfter the rabbits: 180 - 23 = 157.\nThe answer is 157."


def kvm(*args, store=None, check=True):
    env = dict(os.environ)
    if store is not None:
        env["KVMEMORY_STORE"] = str(store)
    p = subprocess.run([sys.executable, "-m", "kvmemory.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"kvmemory {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def filled_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("cli") / "store"
    lines = tmp_path_factory.mktemp("cli") / "more.jsonl"
    lines.write_text("\n".join(json.dumps(d) for d in [
        {"problem": "Ana reads 14 pages a day for 9 days. How many pages?", "solution": "14 * 9 = 126. The answer is 126.",
         "answer": "126"},
        {"problem": "A tank holds 450 litres and leaks 35 litres. How much is left?",
         "solution": "450 - 35 = 415. The answer is 415.", "answer": "415"},
    ]) + "\n")
    first = json.loads(kvm("remember", "--problem", PROBLEM, "--solution", SOLUTION, "--answer", "157", "--json",
                           store=store).stdout)
    more = json.loads(kvm("remember", "--jsonl", str(lines), "--json", store=store).stdout)
    return store, first, more


def test_remember_reports_json(filled_store):
    _, first, more = filled_store
    (e,) = first["remembered"]
    assert e["verified"] and e["bit_identical"] and e["tokens"] > 64 and e["blocks"] >= 1
    # the stored entry with its attestation (examples/check_attestation.py reads this output as is)
    att = e["entry"]["attestation"]
    assert e["entry"]["id"] == e["id"] and att["attestation_id"] == e["attestation_id"] and att["version"] == 2
    assert att["profile_id"] == e["entry"]["profile_id"] and att["profile"]["chunk"] == 64
    assert len(att["token_ids"]) == e["tokens"] and att["model"]["format"] == "gguf"
    assert len(more["remembered"]) == 2 and more["refused"] == []


def test_ask_follow_up_grafts(filled_store):
    store, first, _ = filled_store
    eid = first["remembered"][0]["id"]
    out = json.loads(kvm("ask", "--entry", eid, "How many cabbages were planted?", "--max-tokens", "16", "--json",
                         store=store).stdout)
    assert out["entries"] == [eid] and out["tokens_grafted"] > 0 and out["tokens_decoded"] > 0
    assert out["tokens_grafted"] + out["tokens_computed"] == out["tokens_total"]


def test_ask_routes_and_chooses_among_the_solution_numbers(filled_store):
    store, _, more = filled_store
    out = json.loads(kvm("ask", "Ana reads 14 pages every day for 9 days. How many pages does she read?",
                         "--answer-prefix", "The answer is", "--choices", "numbers", "--json", store=store).stdout)
    assert out["entries"] == [more["remembered"][0]["id"]] and out["choices"] == ["14", "9", "126"]
    assert out["text"] in {f"The answer is {c}." for c in out["choices"]} and out["tokens_scored"] > 0
    p = kvm("ask", "How many pages?", "--choices", "numbers", "--choice", "3", "--json", store=store, check=False)
    assert p.returncode == 2 and json.loads(p.stdout)["error"] == "InvalidInput"


def test_verify_all_json(filled_store):
    store, _, _ = filled_store
    out = json.loads(kvm("verify", "--all", "--json", store=store).stdout)
    assert out["checked"] == 3 and out["bit_identical"] == 3
    assert out["kl_max"] == 0.0 and out["argmax_agreement"] == 1.0 and out["attestation_match"] == 3


def test_stats_json(filled_store):
    store, _, _ = filled_store
    out = json.loads(kvm("stats", "--json", store=store).stdout)
    assert out["entries"] == 3 and out["blocks"] >= 3 and out["bytes"] > 0 and out["tokens_stored"] > 0
    assert out["dedup_ratio"] >= 1.0


def test_errors_are_typed_and_clean(filled_store, tmp_path):
    store, _, _ = filled_store
    p = kvm("ask", "--entry", "enope", "why?", "--json", store=store, check=False)
    assert p.returncode == 2 and json.loads(p.stdout)["error"] == "UnknownEntry"
    p = kvm("remember", "--problem", "", "--solution", "x", store=store, check=False)
    assert p.returncode == 2 and "InvalidInput" in p.stderr and "Traceback" not in p.stderr
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "FORMAT").write_text('{"format": 999}')
    p = kvm("stats", store=newer, check=False)
    assert p.returncode == 2 and "newer" in p.stderr


def test_demo_runs_and_verifies(tmp_path):
    p = kvm("demo", "--json")
    out = json.loads(p.stdout)
    assert out["verify"]["checked"] == 3 and out["verify"]["bit_identical"] == 3
    assert all(q["grafted"] > 0 for q in out["questions"])


def test_profile_switch_is_shown_and_contradictions_are_refused(tmp_path):
    help_text = kvm("remember", "--help").stdout
    assert "--profile {default,stock}" in help_text and "stock:" in help_text
    for extra, named in ((["--kv-dtype", "bfloat16"], "kv_dtype='bfloat16'"), (["--linears", "gguf"], "linears='gguf'")):
        p = kvm("recall", "anything", "--profile", "stock", *extra, "--json", store=tmp_path / "s", check=False)
        assert p.returncode == 2 and json.loads(p.stdout.splitlines()[0])["error"] == "InvalidInput", p.stderr
        assert named in p.stderr and "profile='stock'" in p.stderr and "Traceback" not in p.stderr
