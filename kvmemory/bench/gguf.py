"""`kvmemory bench gguf --model FILE.gguf`: a user's GGUF file computed from its blocks, against llama.cpp.

On the same file and the same threads, every side repeated (`repeats`, interleaved; medians and min-max):
- decode: tokens/s of greedy decoding after a short prompt (kvmemory's canonical runner; llama.cpp's eval);
- prefill: tokens/s of a prompt of L tokens from scratch (kvmemory's canonical recompute; llama.cpp's eval);
- time to first token with the first L tokens already computed: kvmemory's graft from the store (read,
  SHA-256-verify, copy, then the 16 new tokens) against llama.cpp's prefill from scratch and its state
  restore (`llama_state_load_file` of the L tokens, then the same 16 tokens); graft and restore are timed
  `TTFT_PER_ROUND` times per round, interleaved (so a single round at 8k still gives medians of 3);
- resident memory of the loaded model (the process's RSS after loading minus before), against the file's size;
- the decode floor: the bytes of weights a decode step reads (kvmemory's panels) over the machine's
  measured read bandwidth (the same threads), i.e. the fastest a step that streams them could be;
- fidelity against llama.cpp: both sides' logits for the same 128 tokens (KL, argmax agreement). They
  differ by design: llama.cpp quantizes activations to 8 bits for its dot products, kvmemory computes in
  float32 from the exact weights.
llama.cpp's sides are skipped, and say why, where llama-cpp-python is not installed.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvmemory.bench import llamacpp

DEFAULT_LENGTHS = (512, 2048)
NEW_TOKENS = 16  # the new tokens after a grafted or restored prefix
DECODE_TOKENS = 32
TTFT_PER_ROUND = 3  # graft / restore timings per round: a second each, where a round's prefills take minutes


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s of reading a buffer larger than the caches (torch's sum over it, `threads` threads), best of 3."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return nbytes / best


def _panel_bytes(model: torch.nn.Module) -> int:
    from kvmemory.models.gguf_linear import GGUFLinear

    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            for t in (m.q, m.d, m.m):
                if t.data_ptr() not in seen and t.numel():
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def _prompt(tokenizer, n: int) -> list[int]:
    text = ("A farmer counts the apples in every crate of the orchard, writes each count in a ledger and "
            "adds them up at the end of the day. ")
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(text)["input_ids"]
    return ids[:n]


def run_gguf_bench(model: str, *, lengths=DEFAULT_LENGTHS, repeats: int = 3, threads: int = 2,
                   llama: bool = True, progress: bool = False, linears: str = "auto") -> dict:
    from kvmemory.engine.engine import Engine
    from kvmemory.models import gguf_file
    from kvmemory.models.loading import gguf_of

    gf = gguf_of(model) or gguf_file.find(model)
    before = _rss()
    with tempfile.TemporaryDirectory(prefix="kvmemory-bench-gguf-") as tmp:
        t = time.perf_counter()
        eng = Engine.open(model, Path(tmp) / "store", threads=threads, max_positions=max(lengths) + 128,
                          linears=linears)
        load_s = time.perf_counter() - t
        resident = _rss() - before
        tok = eng.loaded.tokenizer
        panels = _panel_bytes(eng.model)
        bandwidth = read_bandwidth(threads)
        report = {"model": model, "file": str(gf.path) if gf else None, "file_bytes": gf.size if gf else None,
                  "threads": threads, "repeats": repeats, "load_s": load_s, "resident_bytes": resident,
                  "linear_impl": eng.profile.linear_impl,
                  "panel_bytes": panels, "read_bandwidth_bytes_s": bandwidth,
                  "decode_floor_tokens_s": bandwidth / panels if panels else None,
                  "cpu": _cpu_name(), "kvmemory": {}, "llamacpp": {}}
        why = llamacpp.available() if llama else "not asked for (--no-llamacpp)"
        llm = None
        if why is None and gf is not None and len(gf.parts) == 1:
            llm = llamacpp.open_llama(str(gf.path), n_ctx=max(lengths) + 128, threads=threads)
            report["llamacpp_build"] = llamacpp.build()
        elif why is None:
            why = "llama.cpp reads single files here (split set given)"
        report["llamacpp_skipped"] = None if llm is not None else why
        from tqdm import tqdm

        bar = tqdm(total=repeats * (1 + len(lengths)), desc="bench gguf", disable=not progress, unit="round")
        short = _prompt(tok, 32)
        k_dec, l_dec = [], []
        for _ in range(repeats):
            res = eng.recompute(short, max_new_tokens=DECODE_TOKENS + 1, keep_logits=False, logits="last")
            k_dec.append(DECODE_TOKENS / res.decode_seconds)
            if llm is not None:
                llm.reset()
                r = llamacpp.prefill_and_decode(llm, short, DECODE_TOKENS + 1, time.perf_counter())
                l_dec.append(DECODE_TOKENS / r["decode_s"])
            bar.update()
        report["kvmemory"]["decode_tokens_s"] = _stats(k_dec)
        if l_dec:
            report["llamacpp"]["decode_tokens_s"] = _stats(l_dec)
        for L in lengths:
            ids = _prompt(tok, L + NEW_TOKENS)
            eng.store_prefix(ids[:L])
            k_pre, k_graft, l_pre, l_restore = [], [], [], []
            state = Path(tmp) / f"state-{L}.bin"
            if llm is not None:
                llamacpp.save_state_file(llm, ids[:L], state)
            for _ in range(repeats):
                t = time.perf_counter()
                eng.recompute(ids, max_new_tokens=1, keep_logits=False, logits="last")
                k_pre.append(len(ids) / (time.perf_counter() - t))
                if llm is not None:
                    llm.reset()
                    t = time.perf_counter()
                    llm.eval(ids)
                    llamacpp.last_argmax(llm)
                    l_pre.append(time.perf_counter() - t)
                for _ in range(TTFT_PER_ROUND):  # the cheap sides, interleaved, several times a round
                    t = time.perf_counter()
                    _, rep = eng.forward(ids, max_new_tokens=1, logits="last")
                    k_graft.append(time.perf_counter() - t)
                    assert rep.tokens_grafted == L, rep.to_json()
                    if llm is not None:
                        llm.reset()
                        t = time.perf_counter()
                        llamacpp.load_state_file(llm, state)
                        l_restore.append(llamacpp.prefill_and_decode(llm, ids[L:], 1, t)["ttft_s"])
                bar.update()
            row = {"prefill_tokens_s": _stats(k_pre), "graft_ttft_s": _stats(k_graft)}
            report["kvmemory"][str(L)] = row
            if l_pre:
                lrow = {"prefill_s": _stats(l_pre), "prefill_tokens_s": _stats([len(ids) / x for x in l_pre]),
                        "restore_ttft_s": _stats(l_restore)}
                lrow["graft_vs_prefill"] = lrow["prefill_s"]["median"] / row["graft_ttft_s"]["median"]
                lrow["graft_vs_restore"] = lrow["restore_ttft_s"]["median"] / row["graft_ttft_s"]["median"]
                report["llamacpp"][str(L)] = lrow
        bar.close()
        if llm is not None:
            report["fidelity_vs_llamacpp"] = fidelity(eng, str(gf.path), _prompt(tok, 128), threads)
        if l_dec:
            report["decode_vs_llamacpp"] = (report["kvmemory"]["decode_tokens_s"]["median"]
                                            / report["llamacpp"]["decode_tokens_s"]["median"])
        return report


def fidelity(eng, gguf: str, ids: list[int], threads: int) -> dict:
    """kvmemory's logits (canonical recompute) against llama.cpp's on the same file and tokens: KL divergence
    per position (kvmemory's distribution as the reference), argmax agreement, max |logit difference|."""
    from llama_cpp import Llama
    import numpy as np

    llm = Llama(model_path=gguf, n_ctx=len(ids) + 16, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, logits_all=True)
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    mine = eng.recompute(ids, keep_logits=True).prefill_logits.to(torch.float32)
    p, q = torch.log_softmax(mine, -1), torch.log_softmax(theirs, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return {"tokens": len(ids), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "argmax_agreement": float((mine.argmax(-1) == theirs.argmax(-1)).float().mean()),
            "max_abs_logit_diff": float((mine - theirs).abs().max())}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def format_table(r: dict) -> str:
    mb = 1 / 2**20
    k, lc = r["kvmemory"], r["llamacpp"]
    lines = [f"{r['model']}  ({r['cpu']}, {r['threads']} threads, medians of {r['repeats']}, "
             f"linears {r.get('linear_impl', '?')})",
             f"file {r['file_bytes'] * mb:.0f} MB; resident {r['resident_bytes'] * mb:.0f} MB; panels read per decode "
             f"step {r['panel_bytes'] * mb:.0f} MB; read bandwidth {r['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s; "
             f"decode floor {r['decode_floor_tokens_s']:.1f} tokens/s",
             f"decode: kvmemory {k['decode_tokens_s']['median']:.2f} tokens/s"
             + (f", llama.cpp {lc['decode_tokens_s']['median']:.2f} ({r['decode_vs_llamacpp']:.2f}x)" if lc else "")]
    for L in (x for x in k if x.isdigit()):
        row = k[L]
        line = (f"L={L}: prefill {row['prefill_tokens_s']['median']:.1f} tokens/s, graft TTFT "
                f"{row['graft_ttft_s']['median'] * 1e3:.0f} ms")
        if L in lc:
            x = lc[L]
            line += (f"; llama.cpp prefill {x['prefill_tokens_s']['median']:.1f} tokens/s, restore TTFT "
                     f"{x['restore_ttft_s']['median'] * 1e3:.0f} ms; graft {x['graft_vs_prefill']:.0f}x its prefill, "
                     f"{x['graft_vs_restore']:.2f}x its restore")
        lines.append(line)
    if r.get("fidelity_vs_llamacpp"):
        f = r["fidelity_vs_llamacpp"]
        lines.append(f"fidelity vs llama.cpp over {f['tokens']} tokens: KL mean {f['kl_mean']:.2e}, max {f['kl_max']:.2e}; "
                     f"argmax agreement {f['argmax_agreement'] * 100:.1f} %")
    if r.get("llamacpp_skipped"):
        lines.append(f"llama.cpp: skipped ({r['llamacpp_skipped']})")
    return "\n".join(lines)
