"""A process killed during the first load blocks and corrupts nothing kvmemory caches.

The first load of the embedded model converts its GGUF file into the cache folder (about half a
minute) and writes the GGUF panels next to it. A process SIGKILLed in the middle of that leaves a lock
file (an flock, which the kernel released when it died) and a temporary folder: the next process must
neither wait on the one nor use the other, must load correctly (the same logits, byte for byte, as a
load from an untouched cache), and must clear the leftovers. No kernel is built at run time, so there is
no build to kill: the kernel libraries are the install's (tests/test_native.py).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmemory.models import cache_files, loading

# Loads the embedded model (the default linears) and prints the SHA-256 of a forward pass's logits bytes.
LOAD = """
import hashlib, torch
from kvmemory.models.loading import load_model
m = load_model()
with torch.inference_mode():
    logits = m.model(torch.tensor([[1, 504, 3458, 28, 1059, 314, 216, 1922, 46]])).logits
print("LOGITS", hashlib.sha256(logits.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
"""


def _env(cache: Path | None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if cache is not None:
        env["KVMEMORY_CACHE"] = str(cache)
    return env


def _load(cache: Path | None, timeout: int = 900) -> str:
    out = subprocess.run([sys.executable, "-c", LOAD], env=_env(cache), capture_output=True, text=True,
                         timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("LOGITS ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return lines[-1].split()[1]


@pytest.mark.slow
def test_a_first_load_killed_mid_conversion_does_not_block_the_next(tmp_path):
    cache = tmp_path / "cache"
    models = cache / "models"
    victim = subprocess.Popen([sys.executable, "-c", LOAD], env=_env(cache), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list(models.glob(".convert-*")):
            assert victim.poll() is None, f"the first load ended before converting: {victim.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no conversion started within 300 s"
            time.sleep(0.05)
        time.sleep(3)  # well inside the conversion (~30 s): transformers is dequantizing the GGUF
        assert victim.poll() is None, "the conversion finished before it could be killed"
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    # What the killed process left: a temporary folder, a lock file, no converted model.
    assert list(models.glob(".convert-*")) and (models / ".convert.lock").exists()
    assert not list(models.glob("*/config.json"))

    started = time.monotonic()
    got = _load(cache)
    assert time.monotonic() - started < 600
    assert not list(models.glob(".convert-*")), "the killed conversion's folder was not cleared"
    (target,) = [p for p in models.iterdir() if p.is_dir()]
    assert (target / "config.json").exists() and (target / loading.GGUF_PANELS).exists()
    # Loaded correctly: the same logits, byte for byte, as a load from the default cache (not killed).
    reference = _load(None)
    assert got == reference

    # A panels write killed midway leaves a temporary file: the next load that writes them removes it.
    leftover = target / f".{loading.GGUF_PANELS}.tmp-999999"
    leftover.write_bytes(b"half a file")
    (target / loading.GGUF_PANELS).unlink()
    assert _load(cache) == reference
    assert not leftover.exists() and (target / loading.GGUF_PANELS).exists()
    # Nothing rewritten once made: a further load leaves every cached file as it was.
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    assert _load(cache) == reference
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == before


def test_a_lock_held_by_a_killed_process_locks_nothing(tmp_path):
    """The lock the cache writers take is the kernel's flock: a holder SIGKILLed holding it releases it."""
    lock = tmp_path / ".convert.lock"
    code = ("import sys, time; from pathlib import Path; from kvmemory.models import cache_files\n"
            f"with cache_files.exclusive(Path({str(lock)!r}), 'test'):\n"
            "    print('HELD', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with open(lock) as fh:  # held: a second taker would wait
            with pytest.raises(BlockingIOError):
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.exists()
    started = time.monotonic()
    with cache_files.exclusive(lock, "test"):
        assert time.monotonic() - started < 5


def test_leftovers_are_removed_by_prefix_only(tmp_path):
    (tmp_path / ".convert-abc").mkdir()
    (tmp_path / ".convert-abc" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".convert.lock").touch()
    (tmp_path / "smollm2-135m-instruct-0123").mkdir()
    removed = cache_files.remove_leftovers(tmp_path, ".convert-")
    assert removed == [tmp_path / ".convert-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".convert.lock", "smollm2-135m-instruct-0123"]
