#!/usr/bin/env bash
# The GGUF figures of BENCHMARKS.md "Your own GGUF file": kvmemory from the file's blocks vs llama.cpp,
# same file, same threads (2), on a quiet machine. Needs the optional wheels (KVMEMORY_SECOND_MODEL=1
# KVMEMORY_QWEN15=1 ./scripts/setup.sh) and llama-cpp-python (../shared/llamacpp.md for the build flags).
set -euo pipefail
cd "$(dirname "$0")/../.."
K=.venv/bin/kvmemory
OUT=benchmarks/i46
$K bench gguf --model embedded:qwen2.5-coder-1.5b-instruct --lengths 512 --repeats 3 --json > $OUT/qwen15-512.json
$K bench gguf --model embedded:qwen2.5-coder-1.5b-instruct --lengths 512,2048 --repeats 3 --json > $OUT/qwen15-512-2048.json
$K bench gguf --model embedded:qwen2.5-coder-0.5b-instruct --lengths 512 --repeats 3 --json > $OUT/qwen05-512.json
$K bench gguf --model "$(.venv/bin/python -c 'from kvmemory.models.loading import embedded_gguf_path; print(embedded_gguf_path())')" \
    --lengths 512 --repeats 3 --json > $OUT/smollm2-512.json
$K bench gguf --model embedded:qwen2.5-coder-1.5b-instruct --lengths 8192 --repeats 1 --json > $OUT/qwen15-8192.json
$K bench gguf --synthetic llama-3.1-8b --lengths 256 --repeats 1 --json > $OUT/llama8b-synthetic-256.json
