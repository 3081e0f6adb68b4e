"""Command line of kvmemory_cuda_graft: `python -m kvmemory_cuda_graft build [--arch-list L] [--out-dir D] [--force]`
compiles libkvgraft.so; `python -m kvmemory_cuda_graft info` prints where it is and whether it can run here."""

from __future__ import annotations

import argparse
import json
import sys

from . import BuildError, build, find_nvcc, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmemory_cuda_graft")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile libkvgraft.so with nvcc")
    b.add_argument("--arch-list", default=None, help="e.g. '8.0;9.0+PTX' (9.0+PTX always included)")
    b.add_argument("--out-dir", default=None, help="write <dir>/libkvgraft.so instead of the cache")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    i = sub.add_parser("info", help="report the library and whether it can run here")
    i.add_argument("--no-build", action="store_true", help="do not build when missing")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        try:
            path = build(args.arch_list, out_dir=args.out_dir, force=args.force, verbose=True)
        except BuildError as exc:
            print(f"kvmemory_cuda_graft: {exc}", file=sys.stderr)
            return 1
        print(path)
        return 0
    st = status(build_if_missing=not args.no_build)
    print(json.dumps({"nvcc": find_nvcc(), "available": st.available, "reason": st.reason,
                      "library": st.library, "arch_list": st.arch_list,
                      "runtime_version": st.runtime_version, "driver_version": st.driver_version},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
