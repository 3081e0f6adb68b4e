"""The execution profile identifies the code that computed the blocks (engine/profile.py).

A native kernel rebuilt from other sources, with other flags or by another compiler, or an edit to
kvmemory's compute-path Python files, is a new `profile_id`; blocks made before are then refused by a
`ProfileMismatch` that names the field ("kernels.fewq.flags", ...), not grafted. The kernels here are
really recompiled (kernels/build.py, g++) into a copy of the package's library folder, and the loader
(kernels/native.py) is pointed at it, as an install built that way would be.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvmemory.errors import ProfileMismatch
from kvmemory.engine import profile as profile_mod
from kvmemory.engine.graft import plan_chain
from kvmemory.engine.profile import ExecutionProfile
from kvmemory.kernels import build, native
from kvmemory.kernels import decode_ops, few_query_attention
from kvmemory.models import attention

from tiny_models import tiny_engine

FEWQ_VARIANT = native.choose("fewq")[0]
needs_fewq = pytest.mark.skipif(FEWQ_VARIANT is None, reason="the few-query kernel has no build for this CPU "
                                "(neither AVX-512 nor AVX2): there is no kernel identity to change")


def _rebuild_fewq(lib: Path, *, extra_flags=(), csrc: Path = build.CSRC) -> dict:
    """Recompile this CPU's build of the few-query kernel into `lib` and record it in the manifest."""
    b = build.find("fewq", FEWQ_VARIANT)
    b = build.Build(b.kernel, b.variant, b.isa, b.source, b.headers, b.flags + tuple(extra_flags))
    entry = build.compile_library(b, lib, csrc=csrc)
    data = json.loads((lib / build.MANIFEST).read_text())
    data["libraries"][entry["file"]] = entry
    (lib / build.MANIFEST).write_text(json.dumps(data))
    native.clear()
    return entry


def _blocks_of(eng, ids):
    eng.store_prefix(ids[:48])
    return plan_chain(eng.store, eng.profile_id, ids, eng.chunk)


def _refused(eng, ids, rows) -> ProfileMismatch:
    with pytest.raises(ProfileMismatch) as err:
        eng.forward(ids, rows=rows, max_new_tokens=1)
    return err.value


IDS = [(i * 7 + 3) % 500 for i in range(60)]


@needs_fewq
def test_the_profile_names_the_kernel_builds_that_ran(tmp_path):
    eng = tiny_engine("llama", tmp_path / "store", chunk=16)
    p = eng.profile
    assert p.attn_implementation == attention.FEWQ
    info = few_query_attention.KERNEL_LIB.build_info()
    assert p.kernels["fewq"]["source_digest"] == info["source_digest"]
    assert p.kernels["fewq"]["flags"] == info["flags"] and p.kernels["fewq"]["variant"] == FEWQ_VARIANT
    assert p.kernels["fewq"]["compiler_version"] == info["compiler_version"]
    assert "qlinear" not in p.kernels  # this model computes its linears with oneDNN, not the GGUF kernel
    decode = decode_ops.build_info()  # the lean llama step's norms / RoPE (built with the others)
    assert decode is not None and p.kernels["decode"]["source_digest"] == decode["source_digest"]
    assert p.code_sha256 == profile_mod.code_sha256() and len(p.code_sha256) == 64
    assert any("MKL" in lib or "OpenMP" in lib for lib in p.math_libraries["libraries"])
    assert p.accelerator == {}  # the CPU


@needs_fewq
def test_a_kernel_rebuilt_with_other_flags_is_a_new_profile_and_old_blocks_are_refused(tmp_path, lib_copy):
    before = tiny_engine("llama", tmp_path / "store", chunk=16)
    rows = _blocks_of(before, IDS)
    assert rows, "the prefix's blocks were stored"
    _rebuild_fewq(lib_copy, extra_flags=("-DKVM_PROFILE_IDENTITY_TEST",))
    after = tiny_engine("llama", tmp_path / "store", chunk=16)
    assert after.profile_id != before.profile_id
    assert set(after.profile.diff(before.profile)) == {"kernels.fewq.flags"}
    err = _refused(after, IDS, rows)
    assert "kernels.fewq.flags" in err.fields and "kernels.fewq.flags" in str(err)
    assert plan_chain(after.store, after.profile_id, IDS, after.chunk) == []  # never found by the new profile


@needs_fewq
def test_a_kernel_rebuilt_from_edited_sources_is_a_new_profile(tmp_path, lib_copy, monkeypatch):
    before = tiny_engine("llama", tmp_path / "store", chunk=16)
    rows = _blocks_of(before, IDS)
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    with open(csrc / "simd.h", "a") as f:  # a header the kernel includes
        f.write("\n// edited after the blocks were made\n")
    monkeypatch.setattr(build, "CSRC", csrc)  # as a checkout whose sources were edited, then rebuilt
    _rebuild_fewq(lib_copy, csrc=csrc)
    after = tiny_engine("llama", tmp_path / "store", chunk=16)
    assert set(after.profile.diff(before.profile)) == {"kernels.fewq.sources.simd.h", "kernels.fewq.source_digest"}
    err = _refused(after, IDS, rows)
    assert "kernels.fewq.source_digest" in err.fields


@needs_fewq
def test_another_compiler_is_a_new_profile(tmp_path, lib_copy):
    before = tiny_engine("llama", tmp_path / "store", chunk=16)
    rows = _blocks_of(before, IDS)
    data = json.loads((lib_copy / build.MANIFEST).read_text())
    data["libraries"][build.find("fewq", FEWQ_VARIANT).filename]["compiler_version"] = "g++ (another) 99.1.0"
    (lib_copy / build.MANIFEST).write_text(json.dumps(data))
    native.clear()
    after = tiny_engine("llama", tmp_path / "store", chunk=16)
    assert set(after.profile.diff(before.profile)) == {"kernels.fewq.compiler_version"}
    assert "kernels.fewq.compiler_version" in _refused(after, IDS, rows).fields


def test_an_edit_to_the_compute_path_is_a_new_code_digest(tmp_path):
    pkg = Path(profile_mod.__file__).resolve().parents[1]
    copy = tmp_path / "kvmemory"
    for rel in profile_mod.COMPUTE_PATH:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pkg / rel, copy / rel)
    assert profile_mod.code_sha256(copy) == profile_mod.code_sha256()
    with open(copy / "engine" / "runner.py", "a") as f:
        f.write("\n")
    assert profile_mod.code_sha256(copy) != profile_mod.code_sha256()


def test_a_profile_stored_before_the_identity_fields_is_refused_naming_them(tmp_path):
    eng = tiny_engine("llama", tmp_path / "store", chunk=16)
    old = eng.profile.to_dict()
    for k in ("kernels", "code_sha256", "math_libraries", "accelerator"):
        old.pop(k)
    stored = ExecutionProfile.from_dict(old)
    d = eng.profile.diff(stored)
    assert "code_sha256" in d and "math_libraries" in d
    assert ("kernels" in d) == bool(eng.profile.kernels)
    with pytest.raises(ProfileMismatch) as err:
        eng.profile.require_same(stored)
    assert "code_sha256" in str(err.value)
