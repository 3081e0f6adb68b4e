"""What kvmemory's native CPU kernel libraries are, and how each one is compiled (at install time).

Every CPU kernel is a plain C ABI shared library (no torch headers, no Python), built by `setup.py`'s
build step with g++ into the package (`kvmemory/kernels/lib/`), once per vector ISA it has a build
for, so that an installed wheel needs no compiler and no cache, and nothing is built at run time.
`native.py` picks the build the CPU runs. This module is stdlib only: setup.py loads it by path before
kvmemory (or torch) can be imported.

Each build's identity (its sources' and headers' SHA-256, the flags, the compiler and its version,
the ISA, the library's own SHA-256) goes into `lib/manifest.json`, written next to the libraries by
the same build step; `native.build_info` returns it and the loader checks the library against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_DIR = "lib"  # under kvmemory/kernels/
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1

# Every build: -O3, position-independent, a shared library. -static-libstdc++ / -static-libgcc: the
# wheel then needs no particular libstdc++ on the user's machine, and --exclude-libs keeps their
# symbols private (neither exported nor bound to another libstdc++ in the process), as
# -fvisibility=hidden keeps the kernels' own (only their `extern "C"` entry points are exported).
# libgomp stays shared on purpose: torch's own, already loaded (one OpenMP runtime, one pool of threads).
COMMON = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-static-libstdc++", "-static-libgcc",
          "-Wl,--exclude-libs,ALL")
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma")
AVX2 = ("-mavx2", "-mfma", "-DKVM_AVX2")
# No FMA the compiler chooses may fuse a product into a sum: RoPE's `x * cos + rotated * sin` and the norms
# (torch rounds each product). The kernels' explicit FMAs stay (the Q4_1 expansion's `fma(q, d, m)` is exact
# there: quantized_linear.cpp says why).
NO_CONTRACT = ("-ffp-contract=off",)


@dataclass(frozen=True, slots=True)
class Build:
    """One library: kernel `kernel`'s build for `variant`, from csrc/`source` and its `headers`."""

    kernel: str  # "fewq", "qlinear", "decode", "sha256"
    variant: str  # "avx512", "avx2", "sha-ni"
    isa: str  # what the CPU must run: torch's capability name ("AVX512", "AVX2") or "SHA-NI"
    source: str
    headers: tuple[str, ...]
    flags: tuple[str, ...]

    @property
    def filename(self) -> str:
        return f"libkvm_{self.kernel}_{self.variant.replace('-', '')}.so"

    @property
    def extension_name(self) -> str:
        """Its name as a setuptools extension (setup.py)."""
        return f"kvmemory.kernels.{LIB_DIR}.{self.filename.removesuffix('.so')}"

    def inputs(self) -> list[str]:
        return [self.source, *self.headers]


_ATTENTION = ("few_query_attention.cpp", ("bfloat16.h", "parallel.h", "simd.h"))
_QLINEAR = ("quantized_linear.cpp", ("parallel.h", "simd.h", "q8_dot.h"))
_SHA256 = ("sha256_lanes.cpp", ())
_DECODE = ("decode_ops.cpp", ("bfloat16.h", "parallel.h"))

BUILDS: tuple[Build, ...] = (
    Build("fewq", "avx512", "AVX512", *_ATTENTION, COMMON + AVX512 + ("-fopenmp",)),
    Build("fewq", "avx2", "AVX2", *_ATTENTION, COMMON + AVX2 + ("-fopenmp",)),
    Build("qlinear", "avx512", "AVX512", *_QLINEAR, COMMON + AVX512 + NO_CONTRACT + ("-fopenmp",)),
    Build("qlinear", "avx2", "AVX2", *_QLINEAR, COMMON + AVX2 + NO_CONTRACT + ("-fopenmp",)),
    Build("decode", "avx512", "AVX512", *_DECODE, COMMON + AVX512 + NO_CONTRACT + ("-fopenmp",)),
    Build("decode", "avx2", "AVX2", *_DECODE, COMMON + AVX2 + NO_CONTRACT + ("-fopenmp",)),
    Build("sha256", "avx512", "AVX512", *_SHA256, COMMON + ("-fno-exceptions", "-mavx512f", "-mavx512bw")),
    Build("sha256", "sha-ni", "SHA-NI", *_SHA256,
          COMMON + ("-fno-exceptions", "-msha", "-msse4.1", "-mssse3", "-DKVM_SHA_NI")),
)


def builds(kernel: str) -> list[Build]:
    return [b for b in BUILDS if b.kernel == kernel]


def find(kernel: str, variant: str) -> Build:
    for b in BUILDS:
        if b.kernel == kernel and b.variant == variant:
            return b
    raise KeyError(f"no build {variant!r} of kernel {kernel!r}")


def source_digests(build: Build, csrc: Path | None = None) -> dict[str, str]:
    """SHA-256 of each file the build compiles (the source and every header it includes), from csrc/
    (CSRC, read when called)."""
    csrc = Path(csrc) if csrc is not None else CSRC
    return {name: hashlib.sha256((csrc / name).read_bytes()).hexdigest() for name in build.inputs()}


def source_digest(digests: dict[str, str]) -> str:
    """One digest over the named files' digests: a change to any source or header is a new build."""
    return hashlib.sha256("".join(f"{n}\0{d}\n" for n, d in sorted(digests.items())).encode()).hexdigest()


def compiler() -> str:
    """The C++ compiler the build step runs: $CXX, else g++ (else c++) on PATH."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("building kvmemory's CPU kernels needs a C++ compiler (g++) on PATH, or CXX set")
    return cxx


def compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip() if out else "unknown"


def compile_library(build: Build, out_dir: Path, cxx: str | None = None, csrc: Path | None = None) -> dict:
    """Compile `build` into out_dir/<its filename> (through a temporary name and an atomic rename, so no
    reader ever sees half a library); returns its manifest entry. Raises CalledProcessError with the
    compiler's output when it fails."""
    cxx = cxx or compiler()
    csrc = Path(csrc) if csrc is not None else CSRC
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    digests = source_digests(build, csrc)
    fd, tmp = tempfile.mkstemp(prefix=f".{build.filename}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *build.flags, str(csrc / build.source), "-o", tmp]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        data = Path(tmp).read_bytes()
        os.chmod(tmp, 0o755)
        os.replace(tmp, out_dir / build.filename)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {
        "kernel": build.kernel,
        "variant": build.variant,
        "isa": build.isa,
        "file": build.filename,
        "sources": digests,
        "source_digest": source_digest(digests),
        "flags": list(build.flags),
        "compiler": os.path.basename(cxx),
        "compiler_version": compiler_version(cxx),
        "library_sha256": hashlib.sha256(data).hexdigest(),
    }


def write_manifest(out_dir: Path, entries: list[dict]) -> Path:
    """lib/manifest.json: {"format": 1, "libraries": {filename: entry}} (atomically replaced)."""
    path = Path(out_dir) / MANIFEST
    body = {"format": MANIFEST_FORMAT, "libraries": {e["file"]: e for e in sorted(entries, key=lambda e: e["file"])}}
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def build_all(out_dir: Path, cxx: str | None = None, jobs: int | None = None) -> list[dict]:
    """Every build into out_dir, `jobs` compilers at a time, then the manifest. A build that fails
    fails the whole step (an install with a kernel silently missing would run another profile)."""
    from concurrent.futures import ThreadPoolExecutor

    cxx = cxx or compiler()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        entries = list(pool.map(lambda b: compile_library(b, out_dir, cxx), BUILDS))
    write_manifest(out_dir, entries)
    return entries
