"""Builds libkvgraft.so from csrc/kvgraft.cu with nvcc (standard library only, no torch).

The library is plain CUDA C++ with C entry points, so building it needs nothing but `nvcc` and a
host C++ compiler: no torch CUDA headers. The CUDA runtime is linked statically (`-cudart static`),
so the .so depends on libc/libstdc++ only and loads on machines without CUDA at all (its calls then
report that no driver is present).

Built libraries live in a cache folder, one sub-folder per build key (SHA-256 of the source, the
nvcc version and the gencode flags), so a changed source or arch list never loads a stale binary.
Writes go to a temporary name first and are renamed into place, so concurrent builders are safe.
This module is also loaded by path from setup.py (install-time build), hence no package imports.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

LIB_NAME = "libkvgraft.so"
SOURCE = Path(__file__).resolve().parent / "csrc" / "kvgraft.cu"
# The floor every build includes: SASS for Hopper (H100/H200) plus compute_90 PTX, which the driver
# can JIT for newer architectures.
BASE_ARCH_LIST = "9.0+PTX"

_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")
# The architecture names TORCH_CUDA_ARCH_LIST accepts (as torch.utils.cpp_extension expands them).
_NAMED = {"turing": "7.5+PTX", "ampere": "8.0;8.6+PTX", "ada": "8.9+PTX", "hopper": "9.0+PTX",
          "blackwell": "10.0;12.0+PTX"}


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message carries its output."""


def find_nvcc() -> str | None:
    """Path of nvcc: $KVMEMORY_CUDA_GRAFT_NVCC, $CUDACXX, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin (first found)."""
    candidates: list[str | None] = [os.environ.get("KVMEMORY_CUDA_GRAFT_NVCC"), os.environ.get("CUDACXX")]
    candidates.append(shutil.which("nvcc"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def parse_arch_list(arch_list: str) -> list[tuple[str, bool]]:
    """Parses a TORCH_CUDA_ARCH_LIST-style string ("8.0;9.0+PTX", "9.0a 10.0") into
    [(digits+suffix, with_ptx)], e.g. [("80", False), ("90", True)]. Unknown entries raise."""
    out: list[tuple[str, bool]] = []
    for raw in re.split(r"[;,\s]+", arch_list.strip()):
        if not raw:
            continue
        named = _NAMED.get(raw.lower().removesuffix("+ptx"))
        if named is not None:
            out += parse_arch_list(named)
            continue
        m = _ARCH_RE.match(raw)
        if not m:
            raise BuildError(
                f"cannot parse CUDA arch {raw!r} in {arch_list!r}; use numbers like '8.0;9.0+PTX'"
            )
        out.append((f"{m.group(1)}{m.group(2)}{m.group(3)}", bool(m.group(4))))
    return out


def default_arch_list() -> str:
    """$KVMEMORY_CUDA_GRAFT_ARCH_LIST, else $TORCH_CUDA_ARCH_LIST, always joined with the 9.0+PTX floor."""
    env = os.environ.get("KVMEMORY_CUDA_GRAFT_ARCH_LIST") or os.environ.get("TORCH_CUDA_ARCH_LIST") or ""
    return merge_arch_lists(env, BASE_ARCH_LIST)


def merge_arch_lists(*lists: str) -> str:
    """Union of arch lists in a canonical order (so equal sets give equal build keys)."""
    archs: dict[str, bool] = {}
    for lst in lists:
        for arch, ptx in parse_arch_list(lst or ""):
            archs[arch] = archs.get(arch, False) or ptx

    def key(a: str) -> tuple[int, str]:
        digits = re.match(r"\d+", a).group(0)  # type: ignore[union-attr]
        return int(digits), a

    parts = []
    for a in sorted(archs, key=key):
        m = re.match(r"(\d+)(\d)([af]?)$", a)
        assert m is not None
        parts.append(f"{m.group(1)}.{m.group(2)}{m.group(3)}" + ("+PTX" if archs[a] else ""))
    return ";".join(parts)


def gencode_flags(arch_list: str) -> list[str]:
    """nvcc -gencode flags: SASS for each arch, plus PTX (compute_XY) where '+PTX' is asked."""
    flags: list[str] = []
    for arch, ptx in parse_arch_list(arch_list):
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        if ptx:
            virt = arch.rstrip("af")  # PTX of the family-less virtual arch stays forward compatible
            flags += ["-gencode", f"arch=compute_{virt},code=compute_{virt}"]
    return flags


def nvcc_command(nvcc: str, source: Path, output: Path, arch_list: str) -> list[str]:
    return [
        nvcc, "-O3", "-std=c++17", "-shared", "-cudart", "static",
        "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
        *gencode_flags(arch_list),
        "-o", str(output), str(source),
    ]


def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"cannot run {nvcc} --version: {exc}") from exc
    if out.returncode != 0:
        raise BuildError(f"{nvcc} --version failed: {out.stderr.strip()}")
    return out.stdout.strip()


def cache_root() -> Path:
    """$KVMEMORY_CUDA_GRAFT_CACHE, else $XDG_CACHE_HOME/kvmemory-cuda-graft, else ~/.cache/kvmemory-cuda-graft."""
    env = os.environ.get("KVMEMORY_CUDA_GRAFT_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvmemory-cuda-graft"


def build_key(source_bytes: bytes, nvcc_ver: str, arch_list: str) -> str:
    h = hashlib.sha256()
    for part in (source_bytes, nvcc_ver.encode(), arch_list.encode(), b"cudart-static;O3;c++17"):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:20]


def cached_libraries(root: Path | None = None) -> list[Path]:
    """Every built library under the cache, newest first (used when nvcc is absent)."""
    root = root or cache_root()
    libs = [p for p in root.glob(f"*/{LIB_NAME}") if p.is_file()]
    return sorted(libs, key=lambda p: p.stat().st_mtime, reverse=True)


def expected_path(arch_list: str | None = None, nvcc: str | None = None,
                  root: Path | None = None) -> Path | None:
    """Where a build with these settings lives (None when nvcc is unavailable)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        return None
    arch_list = merge_arch_lists(arch_list or default_arch_list())
    key = build_key(SOURCE.read_bytes(), nvcc_version(nvcc), arch_list)
    return (root or cache_root()) / key / LIB_NAME


def build(arch_list: str | None = None, out_dir: str | os.PathLike[str] | None = None,
          nvcc: str | None = None, force: bool = False, verbose: bool = False) -> Path:
    """Compiles libkvgraft.so and returns its path.

    arch_list: TORCH_CUDA_ARCH_LIST-style (default: `default_arch_list()`; 9.0+PTX always included).
    out_dir: write `<out_dir>/libkvgraft.so` instead of the keyed cache location.
    force: rebuild even when the keyed library already exists.
    Raises BuildError when nvcc is missing or fails (with nvcc's output).
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError(
            "nvcc not found (looked at $KVMEMORY_CUDA_GRAFT_NVCC, $CUDACXX, PATH, $CUDA_HOME/bin, "
            "/usr/local/cuda/bin); install the CUDA toolkit or set KVMEMORY_CUDA_GRAFT_NVCC"
        )
    arch_list = merge_arch_lists(arch_list or default_arch_list(), BASE_ARCH_LIST)
    source_bytes = SOURCE.read_bytes()
    if out_dir is not None:
        target = Path(out_dir) / LIB_NAME
    else:
        target = cache_root() / build_key(source_bytes, nvcc_version(nvcc), arch_list) / LIB_NAME
        if target.is_file() and not force:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".libkvgraft-", suffix=".so", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = nvcc_command(nvcc, SOURCE, tmp, arch_list)
    if verbose:
        print("kvmemory_cuda_graft: " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"could not run nvcc: {exc}") from exc
    if proc.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(
            f"nvcc failed (exit {proc.returncode}) building {SOURCE} for {arch_list}:\n"
            f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        )
    os.replace(tmp, target)  # atomic: a concurrent loader sees the old file or the whole new one
    # Record how it was built next to it (plain text, informative only).
    try:
        (target.parent / "BUILD_INFO.txt").write_text(
            f"arch_list={arch_list}\nnvcc={nvcc}\ncommand={' '.join(cmd)}\n"
        )
    except OSError:
        pass
    return target
