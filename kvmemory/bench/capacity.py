"""`kvmemory bench capacity`: graft latency and resident memory stay flat as the store grows.

A tiny random-init Llama (built from a config, so the disk use stays modest) computes real KV for
many distinct token sequences. A probe prompt's chain is stored first; its graft latency (median over
several queries) and the process's resident memory around a query are measured with the store at
about 10 k tokens, then again after filling it to the target (3 M tokens by default).

Before each measurement the fill's dirty pages are written back (`os.sync`): the question is whether
a query slows down with the size of the store, not whether it slows down while the kernel is still
writing out the hundreds of MB just filled in (that happens on the same cores).
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time

import psutil
import torch
from tqdm import tqdm


def _tiny_engine(store_path: str, chunk: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmemory.engine.engine import Engine
    from kvmemory.models.loading import LoadedModel

    class _Tok:  # the engine speaks token ids here; a tokenizer is only fingerprinted
        chat_template = None
        special_tokens_map: dict = {}

        def get_vocab(self):
            return {str(i): i for i in range(1024)}

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    from kvmemory.store.local import LocalStore

    # One thread: a model this small gains nothing from more, and the run stays steady on a busy machine.
    return Engine(LoadedModel(model, _Tok(), "tiny-llama", "tiny-llama"), LocalStore(store_path), chunk=chunk,
                  threads=1)


def _measure(eng, probe: list[int], queries: int) -> dict:
    proc = psutil.Process()
    times = []
    gc.collect()
    os.sync()  # the fill's writeback is not the store's size (module docstring)
    eng.forward(probe, max_new_tokens=1, stop_token_ids=())  # warm: first-call allocations are not latency
    rss0 = proc.memory_info().rss
    peak = rss0
    for _ in range(queries):
        t = time.perf_counter()
        _, rep = eng.forward(probe, max_new_tokens=1, stop_token_ids=())
        times.append(time.perf_counter() - t)
        peak = max(peak, proc.memory_info().rss)
    times.sort()
    return {"graft_p50_s": statistics.median(times), "graft_p90_s": times[int(0.9 * (len(times) - 1))],
            "tokens_grafted": rep.tokens_grafted, "rss_mb": rss0 / 2**20, "rss_growth_during_queries_mb": (peak - rss0) / 2**20,
            "store_tokens": eng.store.stats().tokens_stored, "store_bytes": eng.store.stats().bytes}


SMALL_STORE_TOKENS = 10_000  # the store every larger one is compared with


def run_capacity_bench(target_tokens: int = 3_000_000, seq_tokens: int = 4096, probe_tokens: int = 1024,
                       queries: int = 50, chunk: int = 64, progress: bool = True, folder: str | None = None,
                       checkpoints: tuple[int, ...] = (100_000, 1_000_000)) -> dict:
    """Measure at a 10 k-token store, at each checkpoint below the target, and at the target."""
    from kvmemory.errors import InvalidInput

    if target_tokens <= SMALL_STORE_TOKENS:
        raise InvalidInput(f"the target store must hold more than the {SMALL_STORE_TOKENS:,} tokens it is compared "
                           f"with, got {target_tokens:,}")
    tmp = tempfile.TemporaryDirectory(prefix="kvmemory-bench-capacity-", dir=folder)
    try:
        eng = _tiny_engine(f"{tmp.name}/store", chunk)
        g = torch.Generator().manual_seed(1)
        probe = torch.randint(0, 1024, (probe_tokens + 16,), generator=g).tolist()
        eng.store_prefix(probe[:probe_tokens], pinned=False)
        seq = 0

        def fill(until: int, desc: str) -> None:
            nonlocal seq
            have = eng.store.stats().tokens_stored
            with tqdm(total=until, initial=have, desc=desc, unit="tok", disable=not progress) as bar:
                while have < until:
                    ids = torch.randint(0, 1024, (seq_tokens,), generator=torch.Generator().manual_seed(1000 + seq)).tolist()
                    seq += 1
                    eng.store_prefix(ids, pinned=False)
                    now = eng.store.stats().tokens_stored
                    bar.update(now - have)
                    have = now

        points = []
        t0 = time.perf_counter()
        for size in [SMALL_STORE_TOKENS, *sorted(c for c in checkpoints if SMALL_STORE_TOKENS < c < target_tokens),
                     target_tokens]:
            fill(size, f"fill to {size:,}")
            points.append({"target": size, **_measure(eng, probe, queries)})
        fill_s = time.perf_counter() - t0
        small, large = points[0], points[-1]
        from kvmemory.bench.graft import machine_info

        return {"target_tokens": target_tokens, "fill_seconds": fill_s, "probe_tokens": probe_tokens,
                "queries": queries, "machine": machine_info(), "points": points, "small": small, "large": large,
                "latency_ratio_large_over_small": large["graft_p50_s"] / small["graft_p50_s"],
                "rss_growth_large_mb": large["rss_growth_during_queries_mb"],
                "rss_growth_small_mb": small["rss_growth_during_queries_mb"]}
    finally:
        tmp.cleanup()


def format_table(r: dict) -> str:
    out = ["| store tokens | store size | graft p50 ms | graft p90 ms | tokens grafted | process RSS MB | "
           "RSS growth over the queries MB |", "|---|---|---|---|---|---|---|"]
    for x in r["points"]:
        out.append(f"| {x['store_tokens']:,} | {x['store_bytes'] / 2**20:.0f} MiB | {x['graft_p50_s'] * 1e3:.2f} | "
                   f"{x['graft_p90_s'] * 1e3:.2f} | {x['tokens_grafted']} | {x['rss_mb']:.0f} | "
                   f"{x['rss_growth_during_queries_mb']:.1f} |")
    out.append("")
    out.append(f"graft latency at {r['large']['store_tokens']:,} tokens / at {r['small']['store_tokens']:,}: "
               f"{r['latency_ratio_large_over_small']:.2f}x")
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x["store_tokens"] for x in r["points"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [x["graft_p50_s"] * 1e3 for x in r["points"]], "D-", label="graft p50 (ms)")
    ax.plot(xs, [x["graft_p90_s"] * 1e3 for x in r["points"]], "o--", label="graft p90 (ms)")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens in the store")
    ax.set_ylabel(f"graft of a {r['probe_tokens']}-token prefix (ms)")
    ax2 = ax.twinx()
    ax2.plot(xs, [x["rss_mb"] for x in r["points"]], "s:", color="gray", label="process RSS (MB)")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("process RSS (MB)")
    ax.set_title("Graft latency and memory against store size (tiny model)", fontsize=9)
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
