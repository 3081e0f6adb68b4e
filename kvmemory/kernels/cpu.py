"""kvmemory's C++ CPU kernels (csrc/*.cpp): each built once per source, torch version and vector ISA.

Each kernel is C++ against torch's headers, compiled on first use with torch's own extension builder
(g++, ninja) into the user cache directory (~30-50 s once; `scripts/setup.sh` does it ahead of time).
One source, two builds: AVX-512, and AVX2 + FMA (`-DKVM_AVX2`) for CPUs without AVX-512; `isa()`,
torch's own reading of the CPU, picks one. `load` returns the module, or None with the reason, so each
caller chooses its fallback once and the execution profile records which code ran.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

# One source, one build per vector ISA torch reports for this CPU (the profile records that ISA).
BUILDS = {
    "AVX512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"],
    "AVX2": ["-O3", "-mavx2", "-mfma", "-DKVM_AVX2", "-fopenmp"],
}


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "cpu family", "flags" ...); empty
    where there is none. The one reader of that file: the profile's device name, the SHA-256 lanes'
    CPU check and the benches' machine report all come from here."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    break  # the end of the first processor
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def isa() -> str:
    """The vector ISA torch's kernels use on this CPU ("AVX512", "AVX2", "DEFAULT" ...)."""
    return torch.backends.cpu.get_cpu_capability()


def build_name(prefix: str, source: Path, extra_flags: list[str] = (), isa_name: str | None = None) -> str:
    isa_name = isa_name or isa()
    flags = " ".join(BUILDS.get(isa_name, []) + list(extra_flags))
    # The source and the headers it may include (csrc/*.h): a change to either is a new build.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + flags.encode() + torch.__version__.encode())
    return f"{prefix}_{isa_name.lower()}_{digest.hexdigest()[:12]}"


def build_dir(prefix: str, source: Path, extra_flags: list[str] = (), isa_name: str | None = None) -> Path:
    from kvmemory.paths import cache_dir

    return cache_dir() / "ext" / build_name(prefix, source, extra_flags, isa_name)


def load(prefix: str, source: Path, what: str, extra_flags: list[str] = (), isa_name: str | None = None):
    """(module, None) once built and loaded, or (None, why) where it cannot run here. `isa_name` asks
    for another build than the CPU's own (tests: the AVX2 build also runs on an AVX-512 CPU)."""
    if isa() not in BUILDS:
        return None, f"the CPU runs neither AVX-512 nor AVX2 (torch reports {isa()})"
    isa_name = isa_name or isa()
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        out = build_dir(prefix, source, extra_flags, isa_name)
        out.mkdir(parents=True, exist_ok=True)
        if not any(out.glob("*.so")):
            print(f"kvmemory: building the {what} into {out} (once, ~30 s)", file=sys.stderr)
        module = cpp_extension.load(build_name(prefix, source, extra_flags, isa_name), [str(source)],
                                    extra_cflags=BUILDS[isa_name] + list(extra_flags), extra_ldflags=["-fopenmp"],
                                    build_directory=str(out), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: the caller's fallback runs, and says so
        return None, f"building {source.name} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
    return module, None


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel (a dependency) puts it next to this
    Python, which is not on PATH when the venv is not activated (`.venv/bin/python -m pytest`)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # the build then fails and says so
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def compile_object(source: Path, isa_name: str, out: Path, extra_flags: list[str] = ()) -> tuple[bool, str]:
    """Compile `source` as the `isa_name` build into an object file only (never loaded: the CPU may not
    run it), so a change made on one kind of CPU cannot break the other build unseen. (ok, stderr)."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    flags = [f for f in BUILDS[isa_name] if f != "-O3"] + ["-O0"] + list(extra_flags)  # -O0: the same checks, faster
    includes = [f"-I{p}" for p in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]]
    cmd = ["g++", "-std=c++17", "-fPIC", "-c", "-w", *flags, "-DTORCH_EXTENSION_NAME=kvm_check", *includes,
           str(source), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return res.returncode == 0 and out.exists() and out.stat().st_size > 0, res.stderr[-4000:]
