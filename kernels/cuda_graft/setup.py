"""Install hook of kvmemory_cuda_graft: compiles libkvgraft.so into the kvmemory_cuda_graft cache when nvcc is present.

Best effort by design: a missing nvcc or a failing compile never fails the install (the library is
then built lazily by `kvmemory_cuda_graft.load()` or `python -m kvmemory_cuda_graft build`). Set KVMEMORY_CUDA_GRAFT_SKIP_BUILD=1 to skip
it. The builder is loaded by path so this works before the package is importable.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def _try_build() -> None:
    if os.environ.get("KVMEMORY_CUDA_GRAFT_SKIP_BUILD") == "1":
        return
    here = Path(__file__).resolve().parent
    try:
        spec = importlib.util.spec_from_file_location("_kvmemory_cuda_graft_build", here / "kvmemory_cuda_graft" / "_build.py")
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        if mod.find_nvcc() is None:
            print("kvmemory_cuda_graft: nvcc not found; the kernel will be built on first use", file=sys.stderr)
            return
        print(f"kvmemory_cuda_graft: built {mod.build()}", file=sys.stderr)
    except Exception as exc:  # never fail the install over the optional kernel
        print(f"kvmemory_cuda_graft: install-time build skipped ({exc}); it will be built on first use",
              file=sys.stderr)


class BuildPyWithKernel(build_py):
    def run(self) -> None:
        _try_build()
        super().run()


setup(cmdclass={"build_py": BuildPyWithKernel})
