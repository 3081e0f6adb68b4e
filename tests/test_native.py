"""The native kernels' loader (kvmemory/kernels/native.py): which build runs, why not, and what it is.

Every library is built into the package by the install's build step (setup.py, kernels/build.py);
at run time the loader picks the build the CPU runs, checks it against the build's manifest (the
library's own SHA-256; in a checkout, the sources it was built from), and refuses anything else with a
reason that says what to do; the callers' fallbacks then run after one warning. The libraries share
torch's OpenMP runtime rather than loading a second one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmemory.kernels import build, native

HERE = {k: native.choose(k)[0] for k in native.TITLES}



def _entry(lib: Path, filename: str) -> tuple[dict, dict]:
    data = json.loads((lib / build.MANIFEST).read_text())
    return data, data["libraries"][filename]


@pytest.mark.parametrize("kernel", sorted(native.TITLES))
def test_the_build_for_this_cpu_loads_and_says_what_it_is(kernel):
    if HERE[kernel] is None:
        pytest.skip(f"no build of {kernel} runs on this CPU: {native.choose(kernel)[1]}")
    lib, why = native.load(kernel)
    assert lib is not None, why
    info = native.build_info(kernel)
    b = build.find(kernel, HERE[kernel])
    assert info["variant"] == b.variant and info["isa"] == b.isa and info["flags"] == list(b.flags)
    assert info["source_digest"] == build.source_digest(build.source_digests(b))  # built from these sources
    assert info["library_sha256"] == hashlib.sha256(Path(info["path"]).read_bytes()).hexdigest()
    assert info["compiler_version"] and set(info["sources"]) == set(b.inputs())
    st = native.status(kernel)
    assert st["available"] and st["library"] == info["path"] and st["why_not"] is None and st["fallback"] is None


def test_every_include_is_in_its_builds_identity():
    """A header a source includes but its build does not list would change the library unseen by its
    source digest (and be missing from the sdist)."""
    import re

    for b in build.BUILDS:
        text = (build.CSRC / b.source).read_text()
        local = set(re.findall(r'#include "([^"]+)"', text))
        for h in b.headers:
            local |= set(re.findall(r'#include "([^"]+)"', (build.CSRC / h).read_text()))
        assert local <= set(b.headers), (b.filename, local - set(b.headers))


def test_a_missing_library_says_how_to_build(lib_copy):
    (lib_copy / build.find("fewq", "avx2").filename).unlink()
    lib, why = native.load("fewq", "avx2")
    assert lib is None and "is missing" in why and "pip install -e" in why


def test_a_library_changed_since_its_build_is_refused(lib_copy):
    if not native.runs("SHA-NI"):
        pytest.skip("this CPU cannot run the sha-ni build")
    path = lib_copy / build.find("sha256", "sha-ni").filename
    path.write_bytes(path.read_bytes() + b"\0")
    lib, why = native.load("sha256", "sha-ni")
    assert lib is None and "not the library the build step recorded" in why


def test_a_library_built_from_other_sources_is_refused_as_stale(lib_copy):
    if not native.runs("AVX2"):
        pytest.skip("this CPU cannot run the avx2 build")
    b = build.find("qlinear", "avx2")
    data, entry = _entry(lib_copy, b.filename)
    entry["source_digest"] = "0" * 64  # as if csrc/ had been edited after the build
    (lib_copy / build.MANIFEST).write_text(json.dumps(data))
    native.clear()
    lib, why = native.load("qlinear", "avx2")
    assert lib is None and "built from other sources" in why and "pip install -e" in why


def test_a_library_of_another_calling_convention_is_refused(lib_copy, tmp_path):
    if not native.runs("AVX2"):
        pytest.skip("this CPU cannot run the avx2 build")
    b = build.find("fewq", "avx2")
    src = tmp_path / "fake.cpp"
    src.write_text('extern "C" int kvm_fewq_abi_version() { return 99; }\n')
    subprocess.run(["g++", "-shared", "-fPIC", str(src), "-o", str(lib_copy / b.filename)], check=True)
    data, entry = _entry(lib_copy, b.filename)
    entry["library_sha256"] = hashlib.sha256((lib_copy / b.filename).read_bytes()).hexdigest()
    (lib_copy / build.MANIFEST).write_text(json.dumps(data))
    native.clear()
    lib, why = native.load("fewq", "avx2")
    assert lib is None and "calling convention 99" in why


def test_no_build_for_the_cpu_falls_back_with_one_warning_each():
    """Where torch runs neither AVX-512 nor AVX2 (ATEN_CPU_CAPABILITY=default stands in for such a
    CPU), each kernel says once why it does not run and what runs instead."""
    code = ("import logging; from kvmemory.kernels import few_query_attention as f, sha256_lanes as s\n"
            "from kvmemory.kernels import quantized_linear as g\n"
            "assert f.load() is None and f.load() is None and g.load() is None and g.load() is None\n"
            "print('OK', f.build_info(), g.build_info())\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "OK None None", out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("kvmemory: the ")]
    assert len(lines) == 2, out.stderr
    assert "few-query attention kernel is unavailable (the CPU runs neither AVX-512 nor AVX2" in lines[0]
    assert "attention runs on SDPA" in lines[0]
    assert "GGUF-block linear kernel is unavailable" in lines[1] and "oneDNN-packed" in lines[1]


def test_turning_the_sha256_lanes_off_is_not_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("KVMEMORY_SHA256_LANES", "off")
    assert native.choose("sha256") == (None, "turned off by KVMEMORY_SHA256_LANES=off")
    native._warned.discard("sha256")
    with caplog.at_level(logging.INFO, logger="kvmemory.kernels.native"):
        native.warn_fallback("sha256", native.choose("sha256")[1])
        native.warn_fallback("sha256", native.choose("sha256")[1])
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "hashlib" in caplog.records[0].getMessage()


@pytest.mark.skipif(HERE["fewq"] is None or HERE["qlinear"] is None, reason="no kernel build runs on this CPU")
def test_the_kernels_share_torchs_openmp_runtime():
    """The libraries link libgomp.so.1 and get torch's, already loaded: one OpenMP runtime and one pool
    of threads in the process, not two competing for the cores."""
    code = ("import torch\n"
            "from kvmemory.kernels import few_query_attention as f\nfrom kvmemory.kernels import quantized_linear as g\n"
            "assert f.load() is not None and g.load() is not None\n"
            "q = torch.randn(1, 9, 16, 64); k = torch.randn(1, 3, 600, 64)\n"
            "assert f.attend(q, k, k, None, 0.125, True) is not None\n"
            "import json; maps = {line.split()[-1] for line in open('/proc/self/maps') if 'libgomp' in line}\n"
            "print('MAPS', json.dumps(sorted(maps)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (maps,) = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("MAPS ")]
    import torch

    assert maps == [os.path.realpath(Path(torch.__file__).parent / "lib" / "libgomp.so.1")], maps


def test_the_kernels_command_reports_each_kernel(capsys):
    from kvmemory.cli import main

    assert main(["kernels", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["kernels"]) == set(native.TITLES)
    for kernel, st in report["kernels"].items():
        assert st["variant"] == HERE[kernel]
        assert st["available"] == (HERE[kernel] is not None), st["why_not"]
        assert (st["fallback"] is None) == st["available"]
    assert main(["kernels"]) == 0
    text = capsys.readouterr().out
    assert all(native.TITLES[k] in text for k in native.TITLES)
