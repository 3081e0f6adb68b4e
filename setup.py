"""kvmemory's build step: compiles every native CPU kernel build into the package at install time.

pyproject.toml holds the metadata; this file only adds the kernels. Each build listed in
kvmemory/kernels/build.py (few-query attention and GGUF-block linears for AVX-512 and AVX2, multi-lane
SHA-256 for AVX-512 and SHA-NI) is compiled with g++ into kvmemory/kernels/lib/ next to a manifest of
their build identities, for `pip wheel .` (into the wheel, which is then a py3-none-linux_x86_64
platform wheel: plain C libraries, no Python ABI) and for `pip install -e .` (in place). Nothing is
compiled at run time; kvmemory/kernels/native.py picks the build the CPU runs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _kernel_builds():
    """kvmemory/kernels/build.py, loaded by path: kvmemory itself (and torch) cannot be imported yet."""
    spec = importlib.util.spec_from_file_location("_kvmemory_kernel_build", ROOT / "kvmemory" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


kb = _kernel_builds()


class BuildKernels(build_ext):
    """Compiles the kernels with build.py's own flags (not distutils' compiler settings), all at once."""

    def get_ext_filename(self, fullname: str) -> str:
        # plain `libkvm_*.so`: C libraries opened by ctypes, not Python extension modules
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extensions(self) -> None:
        by_name = {b.extension_name: b for b in kb.BUILDS}
        out_dirs = {Path(self.get_ext_fullpath(e.name)).parent for e in self.extensions}
        assert len(out_dirs) == 1, out_dirs
        out_dir = out_dirs.pop()
        cxx = kb.compiler()
        from concurrent.futures import ThreadPoolExecutor

        jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 0 else (os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            entries = list(pool.map(lambda e: self._compile(by_name[e.name], out_dir, cxx), self.extensions))
        kb.write_manifest(out_dir, entries)

    def _compile(self, build, out_dir: Path, cxx: str) -> dict:
        import subprocess

        print(f"kvmemory: compiling {build.filename} ({' '.join(build.flags)})")
        try:
            return kb.compile_library(build, out_dir, cxx)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"compiling {build.filename} failed:\n{exc.stderr}") from exc

    def _manifest(self, inplace: bool) -> str:
        any_ext = self.get_ext_fullname(self.extensions[0].name)
        old, self.inplace = self.inplace, inplace
        try:
            return str(Path(self.get_ext_fullpath(any_ext)).parent / kb.MANIFEST)
        finally:
            self.inplace = old

    def copy_extensions_to_source(self) -> None:
        """The in-place copies (`pip install -e .`), each replaced atomically and only where it differs:
        a running kvmemory process has these libraries mapped, and a file rewritten in place under it
        would crash it (the builds are reproducible, so an unchanged source leaves the file as it was)."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            _replace_if_changed(regular_file, inplace_file)
        _replace_if_changed(self._manifest(False), self._manifest(True))

    def get_outputs(self) -> list[str]:
        outputs = super().get_outputs()
        return outputs if self.inplace else sorted(outputs + [self._manifest(False)])

    def get_output_mapping(self) -> dict[str, str]:
        mapping = super().get_output_mapping()
        if self.inplace:
            mapping[self._manifest(False)] = self._manifest(True)
        return mapping


def _replace_if_changed(src: str, dst: str) -> None:
    if os.path.exists(dst) and Path(src).read_bytes() == Path(dst).read_bytes():
        return
    tmp = f"{dst}.tmp-{os.getpid()}"
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the wheel holds native code, but no Python extension module (ctypes)."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    ext_modules=[Extension(b.extension_name, sources=[f"kvmemory/kernels/csrc/{b.source}"]) for b in kb.BUILDS],
    cmdclass={"build_ext": BuildKernels, "bdist_wheel": PlatformWheel},
)
