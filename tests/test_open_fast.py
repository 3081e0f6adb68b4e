"""Opening an engine on a model read from files identifies it by its files' SHA-256, remembered across
processes (models/file_hashes.py), instead of hashing every weight in memory at each open.

A tiny random Llama saved with save_pretrained stands for any Hugging Face folder. Checked here: the
profile names the files (`files:` ...) and a second open (in this process or another) reads no weight
byte to identify them; a weights file changed in place (same size, new mtime; or its old mtime put back)
is a new profile; a damaged cache file is ignored whole and written again; two processes writing the
cache at once leave a valid file holding both's digests; a model built in memory, a LoadedModel handed to
Engine(...), or a folder missing weights (filled at random by transformers) keep the in-memory hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmemory.engine import profile as profile_mod
from kvmemory.engine.engine import Engine
from kvmemory.models import file_hashes
from kvmemory.models.loading import FILES_PREFIX, files_model_sha256, load_model
from kvmemory.store.local import LocalStore

from tiny_models import tiny_engine, tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A 1-layer random Llama with SmolLM2's tokenizer, saved as a Hugging Face folder."""
    from tiny_models import save_tiny_llama

    return Path(save_tiny_llama(tmp_path_factory.mktemp("open-fast")))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of this test's own for the file digests (and this process's memo emptied)."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(file_hashes, "cache_dir", lambda: folder)
    file_hashes.forget_memo()
    yield folder
    file_hashes.forget_memo()


@pytest.fixture
def counted(monkeypatch) -> dict:
    """Counts of what identifying a model costs: files read and hashed, weight sets hashed in memory."""
    n = {"files": 0, "weights": 0}
    read, weights = file_hashes.hash_file, profile_mod.weights_sha256

    def hash_file(path):
        n["files"] += 1
        return read(path)

    def weights_sha256(model):
        n["weights"] += 1
        return weights(model)

    monkeypatch.setattr(file_hashes, "hash_file", hash_file)
    monkeypatch.setattr(profile_mod, "weights_sha256", weights_sha256)
    return n


def _listing(folder: Path) -> dict[str, str]:
    """What the profile should name, computed here with hashlib alone."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())
            if f.name == "config.json" or f.suffix == ".safetensors"}


def test_the_profile_names_the_files_and_a_second_open_reads_no_weight(tiny_folder, cache, counted, tmp_path):
    first = Engine.open(str(tiny_folder), tmp_path / "s")
    want = _listing(tiny_folder)
    assert set(want) == {"config.json", "model.safetensors"}
    assert first.profile.model_sha256 == files_model_sha256(want)
    assert first.profile.model_sha256.startswith(FILES_PREFIX) and first.loaded.weights_files == want
    assert counted == {"files": 2, "weights": 0}  # each file hashed once, no weight hashed in memory

    second = Engine.open(str(tiny_folder), tmp_path / "s")  # this process: its memo
    file_hashes.forget_memo()
    third = Engine.open(str(tiny_folder), tmp_path / "s")  # as a new process would: the cache file
    assert counted == {"files": 2, "weights": 0}
    assert first.profile_id == second.profile_id == third.profile_id
    # The files stand for the same weights an in-memory hash covers: same bytes, same profile otherwise.
    assert profile_mod.weights_sha256(third.model) == profile_mod.weights_sha256(first.model)


def test_another_process_reads_the_digests_from_the_cache_file(tiny_folder, cache):
    code = textwrap.dedent(f"""
        import json, sys
        from kvmemory.models import file_hashes
        file_hashes.cache_dir = lambda: __import__("pathlib").Path({str(cache)!r})
        reads = []
        real = file_hashes.hash_file
        file_hashes.hash_file = lambda p: reads.append(str(p)) or real(p)
        print(json.dumps([file_hashes.sha256_of({str(tiny_folder / "model.safetensors")!r}), reads]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      env=env, timeout=300).stdout) for _ in range(2)]
    want = hashlib.sha256((tiny_folder / "model.safetensors").read_bytes()).hexdigest()
    assert runs[0] == [want, [str((tiny_folder / "model.safetensors").resolve())]]  # hashed once ...
    assert runs[1] == [want, []]  # ... then read from the cache file by the next process


def test_a_weights_file_changed_in_place_is_a_new_profile(tiny_folder, cache, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    before = Engine.open(str(folder), tmp_path / "s")
    weights = folder / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: same size, another weight
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a new mtime, as any write gives
    changed = Engine.open(str(folder), tmp_path / "s")
    assert weights.stat().st_size == st.st_size
    assert changed.profile.model_sha256 == files_model_sha256(_listing(folder)) != before.profile.model_sha256
    assert changed.profile_id != before.profile_id
    assert changed.profile.diff(before.profile).keys() == {"model_sha256"}

    # Changed again and its old mtime put back (as `touch -d` or `cp -p` can): the ctime still tells.
    data[-1] ^= 0x03
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    again = Engine.open(str(folder), tmp_path / "s")
    assert again.profile.model_sha256 == files_model_sha256(_listing(folder))
    assert again.profile_id not in (before.profile_id, changed.profile_id)


@pytest.mark.parametrize("damage", ["not json", "truncated", "checksum", "bad entry", "other format"])
def test_a_damaged_cache_file_is_ignored_whole_and_written_again(tiny_folder, cache, counted, damage):
    f = tiny_folder / "model.safetensors"
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert file_hashes.sha256_of(f) == want and counted["files"] == 1
    path = file_hashes.cache_path()
    doc = json.loads(path.read_text())
    assert file_hashes._parse(path.read_text()) == {file_hashes.file_key(f): want}
    wrong = "0" * 64
    if damage == "not json":
        path.write_bytes(b"\x00garbage{")
    elif damage == "truncated":
        path.write_text(path.read_text()[:-40])
    elif damage == "checksum":  # a digest changed, the checksum left: the file is not trusted in part
        doc["entries"][0][6] = wrong
        path.write_text(json.dumps(doc))
    elif damage == "bad entry":  # one malformed entry with a checksum made for it: still refused whole
        doc["entries"].append(["/x", -1, 0, 0, 0, 0, wrong])
        doc["sha256"] = file_hashes._checksum(doc["entries"])
        path.write_text(json.dumps(doc))
    else:
        doc["version"] = 99
        path.write_text(json.dumps(doc))
    file_hashes.forget_memo()
    assert file_hashes.sha256_of(f) == want and counted["files"] == 2  # hashed again, not read from the damage
    assert file_hashes._parse(path.read_text()) == {file_hashes.file_key(f): want}  # and written again, valid


def test_two_processes_writing_the_cache_at_once_leave_a_valid_file(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    for i in range(60):
        (files / f"f{i:02d}.bin").write_bytes(os.urandom(1000 + i))
    folder = tmp_path / "cache"
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        from kvmemory.models import file_hashes
        for p in sorted(Path(sys.argv[1]).iterdir())[int(sys.argv[2])::2]:
            file_hashes.sha256_of(p)
    """)
    env = {**os.environ, "KVMEMORY_CACHE": str(folder),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(files), str(k)], env=env) for k in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    entries = file_hashes._parse((folder / file_hashes.FILE_NAME).read_text())
    assert entries is not None  # valid: parsed whole, checksum right
    want = {file_hashes.file_key(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files.iterdir()}
    assert entries == want  # every digest of both writers: the lock serialised the read-merge-writes
    assert not [p for p in folder.iterdir() if p.name.startswith(file_hashes._TMP_PREFIX)]


def test_models_without_files_keep_the_in_memory_hash(tiny_folder, cache, tmp_path):
    built = tiny_engine("llama", tmp_path / "a")  # from a config, in memory
    assert built.profile.model_sha256 == profile_mod.weights_sha256(built.model)
    assert len(built.profile.model_sha256) == 64 and not built.profile.model_sha256.startswith(FILES_PREFIX)
    loaded = load_model(str(tiny_folder))
    assert loaded.weights_files == _listing(tiny_folder)
    with __import__("torch").no_grad():
        loaded.model.model.norm.weight.add_(1.0)  # changed after load_model: the files no longer say it
    handed = Engine(loaded, LocalStore(tmp_path / "b"))  # a LoadedModel handed over: its weights are hashed
    assert handed.profile.model_sha256 == profile_mod.weights_sha256(loaded.model)
    assert handed.profile.model_sha256 != files_model_sha256(loaded.weights_files)


def test_a_folder_missing_weights_is_not_identified_by_its_files(tiny_folder, cache, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]  # transformers fills it at load: the files do not determine the model
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    eng = Engine.open(str(folder), tmp_path / "s")
    assert eng.loaded.weights_files is None
    assert eng.profile.model_sha256 == profile_mod.weights_sha256(eng.model)
    assert "lacks 1 weights" in caplog.text


def test_the_checker_compares_the_profile_it_can(tiny_folder):
    """examples/check_attestation.py, without kvmemory: a files: profile of a Hugging Face folder is the
    attestation's model SHA-256; the embedded model's files: profile is not claimed either way."""
    spec = importlib.util.spec_from_file_location("check_attestation", ROOT / "examples" / "check_attestation.py")
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    listing = _listing(tiny_folder)
    digest = files_model_sha256(listing).removeprefix(FILES_PREFIX)
    folder_info = {"format": "hf-folder", "files": listing, "sha256": digest}
    assert checker.weights_match_profile({"model_sha256": FILES_PREFIX + digest}, folder_info, None) is True
    assert checker.weights_match_profile({"model_sha256": FILES_PREFIX + "0" * 64}, folder_info, None) is False
    assert checker.weights_match_profile({"model_sha256": FILES_PREFIX + digest}, {"format": "gguf"}, None) is None
    model = tiny_model("llama", pack=False)  # an in-memory profile: the checker hashes the weights it loaded
    mine = profile_mod.weights_sha256(model)
    assert checker.weights_sha256(model) == mine
    assert checker.weights_match_profile({"model_sha256": mine}, {"format": "gguf"}, model) is True
    assert checker.weights_match_profile({"model_sha256": "0" * 64}, folder_info, model) is False
