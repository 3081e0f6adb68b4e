"""Picks, checks and loads the native CPU kernel libraries built into the package (build.py).

One place decides which build of each kernel runs here, and says so: `load(kernel)` returns the
library (ctypes) or None with the reason, and the kernel's caller runs its fallback (attention: SDPA;
linears: oneDNN-packed; hashing: hashlib) after one warning that names the reason and the fallback.
The choice:

- "fewq" (few-query attention), "qlinear" (GGUF-block linears) and "decode" (a decode step's norms and
  RoPE): the AVX-512 build where torch's
  kernels run AVX-512, else the AVX2 build where they run AVX2, else none. It follows torch's own
  reading of the CPU (`cpu.isa()`), so `ATEN_CPU_CAPABILITY=avx2` lowers both alike, and the execution
  profile's `cpu_isa` names the build that ran.
- "sha256" (multi-lane SHA-256): "avx512" where torch runs AVX-512, else "sha-ni" on CPUs with the SHA
  extensions; `KVMEMORY_SHA256_LANES=avx512|sha-ni|off` asks for one (refused where it cannot run).

Before a library is loaded it is checked against the build step's manifest (lib/manifest.json): the
file's SHA-256 must be the one built, and in a source checkout (an editable install) the sources must
still be the ones it was built from, else it is refused as stale (`pip install -e .` rebuilds it).
torch is imported before any library is opened, so the kernels' libgomp.so.1 is torch's own.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch  # noqa: F401  (first: a kernel library's libgomp.so.1 must resolve to torch's, already loaded)

from kvmemory.kernels import build as _build
from kvmemory.kernels.cpu import cpu_info, isa

log = logging.getLogger(__name__)

LIB_DIR = Path(__file__).resolve().parent / _build.LIB_DIR
# What the CPU must report (/proc/cpuinfo flags) to run a build's instructions at all.
_NEEDS = {
    "AVX512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"},
    "AVX2": {"avx2", "fma"},
    "SHA-NI": {"sha_ni", "sse4_1", "ssse3"},
}
# Each kernel's title (for messages) and the calling convention its Python side speaks.
TITLES = {"fewq": "few-query attention kernel", "qlinear": "GGUF-block linear kernel",
          "decode": "decode-step norm / RoPE kernel", "sha256": "multi-lane SHA-256"}
ABI = {"fewq": 2, "qlinear": 4, "decode": 9, "sha256": 1}
# What runs where a kernel does not (each caller's fallback; the execution profile records which ran).
FALLBACKS = {"fewq": "attention runs on SDPA (kvmemory_sdpa)",
             "qlinear": "linears run on oneDNN-packed float32 weights (onednn-packed)",
             "decode": "a decode step's norms and RoPE run as torch ops (the same bits, slower)",
             "sha256": "blocks are hashed by hashlib"}

_warned: set[str] = set()
_lock = threading.Lock()
_KERNELS: list["Kernel"] = []
_UNCHOSEN = object()  # every wrapper's Kernel, so that clear() resets them too


def checkout_root() -> Path | None:
    """The source checkout this package is imported from (an editable install), or None (a wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "setup.py").is_file() and (root / "pyproject.toml").is_file() else None


def runs(isa_name: str) -> bool:
    """Whether this CPU runs a build's instructions (AVX-512 builds also run AVX2 code, and so on)."""
    flags = set(cpu_info().get("flags", "").split())
    return _NEEDS[isa_name] <= flags


def choose(kernel: str) -> tuple[str | None, str | None]:
    """(variant, None): the build of `kernel` for this CPU; or (None, why) where none runs here."""
    if kernel == "sha256":
        return _choose_sha256()
    cap = isa()
    for b in _build.builds(kernel):
        if b.isa == cap:
            return b.variant, None
    return None, f"the CPU runs neither AVX-512 nor AVX2 (torch reports {cap})"


def _choose_sha256() -> tuple[str | None, str | None]:
    here = {"avx512": isa() == "AVX512", "sha-ni": runs("SHA-NI")}
    wanted = os.environ.get("KVMEMORY_SHA256_LANES", "").strip().lower()
    if wanted == "off":
        return None, "turned off by KVMEMORY_SHA256_LANES=off"
    if wanted:
        if wanted not in here:
            return None, f"KVMEMORY_SHA256_LANES={wanted!r} is none of avx512, sha-ni, off"
        if not here[wanted]:
            return None, f"KVMEMORY_SHA256_LANES asks for the {wanted} build, which this CPU cannot run"
        return wanted, None
    found = next((v for v, ok in here.items() if ok), None)
    if found is None:
        return None, f"the CPU runs neither AVX-512 nor the SHA extensions (torch reports {isa()})"
    return found, None


@functools.cache
def manifest() -> dict:
    """The build step's record of every library it built ({} where there is none)."""
    try:
        data = json.loads((LIB_DIR / _build.MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data.get("libraries", {}) if data.get("format") == _build.MANIFEST_FORMAT else {}


def _how_to_build() -> str:
    root = checkout_root()
    if root is not None:
        return f"build them with `pip install -e {root}` (its build step compiles every CPU kernel)"
    return "reinstall kvmemory from its linux x86-64 wheel, or from source with a C++ compiler (g++) present"


def _check(b: _build.Build, path: Path) -> str | None:
    """Why the library at `path` must not be loaded, or None."""
    entry = manifest().get(b.filename)
    if not path.is_file():
        return f"{path} is missing: {_how_to_build()}"
    if entry is None:
        return f"{path} has no record in {LIB_DIR / _build.MANIFEST}: {_how_to_build()}"
    if hashlib.sha256(path.read_bytes()).hexdigest() != entry.get("library_sha256"):
        return f"{path} is not the library the build step recorded (changed since): {_how_to_build()}"
    if checkout_root() is not None and _build.CSRC.is_dir():
        try:
            now = _build.source_digest(_build.source_digests(b))
        except OSError as exc:
            return f"cannot read the kernel's sources ({exc})"
        if now != entry.get("source_digest"):
            return (f"{path.name} was built from other sources than this checkout's csrc/ (edited since): "
                    f"{_how_to_build()}")
    return None


@functools.cache
def _open(kernel: str, variant: str) -> tuple[ctypes.CDLL | None, str | None]:
    b = _build.find(kernel, variant)
    if not runs(b.isa):
        return None, f"this CPU cannot run the {variant} build ({b.isa})"
    path = LIB_DIR / b.filename
    why = _check(b, path)
    if why is not None:
        return None, why
    try:
        lib = ctypes.CDLL(str(path))
        abi = getattr(lib, f"kvm_{kernel}_abi_version")
        abi.restype, abi.argtypes = ctypes.c_int, []
        got = abi()
    except (OSError, AttributeError) as exc:
        return None, f"loading {path} failed: {exc}"
    if got != ABI[kernel]:
        return None, f"{path} speaks calling convention {got}, this kvmemory {ABI[kernel]}: {_how_to_build()}"
    return lib, None


def load(kernel: str, variant: str | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None), or (None, why) where it cannot run here. `variant` asks for another build than
    the CPU's own (tests and benches: the AVX2 build also runs on an AVX-512 CPU)."""
    if variant is None:
        variant, why = choose(kernel)
        if variant is None:
            return None, why
    with _lock:
        return _open(kernel, variant)


def build_info(kernel: str, variant: str | None = None) -> dict | None:
    """The identity of the build that runs (or of `variant`): the manifest's record (sources' and
    headers' SHA-256, flags, compiler and version, ISA, the library's SHA-256) and its path; None
    where no build of `kernel` runs here."""
    if variant is None:
        variant, _ = choose(kernel)
        if variant is None:
            return None
    lib, _ = load(kernel, variant)
    if lib is None:
        return None
    b = _build.find(kernel, variant)
    return dict(manifest()[b.filename], path=str(LIB_DIR / b.filename))


def warn_fallback(kernel: str, why: str) -> None:
    """Once per process and kernel: say that `kernel` does not run, why, and what runs instead."""
    with _lock:
        if kernel in _warned:
            return
        _warned.add(kernel)
    level = logging.INFO if why.startswith("turned off by") else logging.WARNING
    log.log(level, "kvmemory: the %s is unavailable (%s); %s instead", TITLES[kernel], why, FALLBACKS[kernel])


class Kernel:
    """One native kernel as its Python wrapper sees it: the build chosen for this CPU, loaded and its
    entry points declared once (`declare(lib)` sets their ctypes signatures), or why none runs.

        ATTENTION = native.Kernel("fewq", _declare)
        lib = ATTENTION.load()            # None where it cannot run here (logged once, with the fallback)
        ATTENTION.why_unavailable(), ATTENTION.build_info(), ATTENTION.load_variant("avx2")
    """

    def __init__(self, kernel: str, declare: Callable[[ctypes.CDLL], None]):
        self.kernel = kernel
        self._declare = declare
        self._lock = threading.Lock()
        self._loaded = False
        self._lib: ctypes.CDLL | None = None
        self._why: str | None = None
        self._variant: object = _UNCHOSEN
        _KERNELS.append(self)

    def variant(self) -> str | None:
        """The build this CPU runs ("avx512", "avx2", "sha-ni"), or None (chosen once)."""
        if self._variant is _UNCHOSEN:
            self._variant = choose(self.kernel)[0]
        return self._variant

    def load(self) -> ctypes.CDLL | None:
        """The library of this CPU's build, or None where none runs here (see `why_unavailable`)."""
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    lib, self._why = load(self.kernel)
                    if lib is None:
                        warn_fallback(self.kernel, self._why)
                    else:
                        self._declare(lib)
                    self._lib, self._loaded = lib, True
        return self._lib

    def load_variant(self, variant: str) -> ctypes.CDLL | None:
        """Another build than the CPU's own (tests and benches: the AVX2 build also runs on an
        AVX-512 CPU); None where it cannot run here."""
        lib, _ = load(self.kernel, variant)
        if lib is not None:
            self._declare(lib)
        return lib

    def why_unavailable(self) -> str | None:
        self.load()
        return self._why

    def build_info(self) -> dict | None:
        """The identity of the build that runs here (`build_info`), or None."""
        return build_info(self.kernel) if self.load() is not None else None

    def forget(self) -> None:
        """Choose and load again on next use (tests: after changing the environment)."""
        with self._lock:
            self._loaded, self._lib, self._why, self._variant = False, None, None, _UNCHOSEN


def status(kernel: str) -> dict:
    """Per kernel, what `kvmemory kernels` reports: available, the build chosen and why, the library's
    path and build identity, or why not."""
    variant, why = choose(kernel)
    out = {"kernel": kernel, "title": TITLES[kernel], "available": False, "variant": variant, "cpu_isa": isa(),
           "builds": [b.variant for b in _build.builds(kernel)], "library": None, "build_info": None, "why_not": why,
           "fallback": None}
    if variant is not None:
        lib, why = load(kernel, variant)
        out["why_not"] = why
        if lib is not None:
            info = build_info(kernel, variant)
            out.update(available=True, library=info["path"], build_info=info)
    if not out["available"]:
        out["fallback"] = FALLBACKS[kernel]
    return out


def clear() -> None:
    """Forget every choice and library handle (tests: after changing the environment)."""
    manifest.cache_clear()
    _open.cache_clear()
    _warned.clear()
    for k in _KERNELS:
        k.forget()
