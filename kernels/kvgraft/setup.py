"""Install hook of kvgraft: compiles libkvgraft.so into the kvgraft cache when nvcc is present.

Best effort by design: a missing nvcc or a failing compile never fails the install (the library is
then built lazily by `kvgraft.load()` or `python -m kvgraft build`). Set KVGRAFT_SKIP_BUILD=1 to skip
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
    if os.environ.get("KVGRAFT_SKIP_BUILD") == "1":
        return
    here = Path(__file__).resolve().parent
    try:
        spec = importlib.util.spec_from_file_location("_kvgraft_build", here / "kvgraft" / "_build.py")
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        if mod.find_nvcc() is None:
            print("kvgraft: nvcc not found; the kernel will be built on first use", file=sys.stderr)
            return
        print(f"kvgraft: built {mod.build()}", file=sys.stderr)
    except Exception as exc:  # never fail the install over the optional kernel
        print(f"kvgraft: install-time build skipped ({exc}); it will be built on first use",
              file=sys.stderr)


class BuildPyWithKernel(build_py):
    def run(self) -> None:
        _try_build()
        super().run()


setup(cmdclass={"build_py": BuildPyWithKernel})
