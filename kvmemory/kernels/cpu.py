"""What this CPU is and runs: its /proc/cpuinfo fields and the vector ISA torch's kernels use on it.

The one reader of /proc/cpuinfo (the profile's device name, the kernels' choice of build in native.py,
the benches' machine report) and of torch's CPU capability, which picks the kernels' builds: AVX-512 or
AVX2 (`ATEN_CPU_CAPABILITY=avx2` lowers torch's and kvmemory's alike, and the profile records it).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "cpu family", "flags" ...); empty
    where there is none."""
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
