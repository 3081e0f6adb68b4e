"""`python -m kvmemory.bench.linears`: the embedded model's 211 linears timed for 1, 16 and 64 rows (a
decode step, a graft's tail, a grid chunk) with its GGUF blocks (models/gguf_linear.py), with
oneDNN-packed float32 weights (models/packed_linear.py) and with torch's own GEMM, side by side."""

from __future__ import annotations

import time

import torch

from kvmemory.kernels import cpu, quantized_linear
from kvmemory.models import gguf_linear, packed_linear
from kvmemory.models.loading import embedded_gguf_path, load_model


def _timed(layers: dict, rows: int, repeats: int = 7) -> float:
    xs = {n: torch.randn(rows, m.in_features) for n, m in layers.items()}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for n, m in layers.items():
                m(xs[n])
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    if quantized_linear.load() is None:
        raise SystemExit(f"unavailable: {quantized_linear.why_unavailable()}")
    loaded = load_model(linears="plain")
    plain = {n: m for n, m in loaded.model.named_modules() if type(m) is torch.nn.Linear}
    packed = {n: packed_linear.PackedLinear.from_linear(m) for n, m in plain.items()} if packed_linear.AVAILABLE else {}
    gguf_linear.gguf_linears(loaded.model, embedded_gguf_path())
    blocks = {n: m for n, m in loaded.model.named_modules() if isinstance(m, gguf_linear.GGUFLinear)}
    block_mb = sum(t.numel() * t.element_size() for m in blocks.values() for t in (m.q, m.d, m.m)) / 1e6
    print(f"{len(blocks)} linears, {block_mb:.0f} MB of blocks vs "
          f"{sum(m.weight.numel() * 4 for m in blocks.values()) / 1e6:.0f} MB float32; "
          f"{torch.get_num_threads()} threads, {cpu.isa()}, the kernel's {quantized_linear.build_info()['variant']} build")
    for rows in (1, 16, 64):
        ours = _timed(blocks, rows)
        line = f"{rows:>3} rows: GGUF blocks {ours * 1e3:7.1f} ms"
        for name, layers in (("oneDNN packed", packed), ("torch", plain)):
            if layers:
                t = _timed(layers, rows)
                line += f", {name} {t * 1e3:7.1f} ms ({t / ours:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
