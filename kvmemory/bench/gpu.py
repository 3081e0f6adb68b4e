"""`kvmemory bench gpu`: time to first token on a GPU: the graft against transformers, the recompute,
`remember` and the floor, for model shapes from 2k to 32k tokens.

Models: random weights (no download: speed and exactness do not need trained ones) built in code from
the configs of SmolLM2-135M and Llama-3.1-8B (`SHAPES`; SmolLM2's `max_position_embeddings` raised to the
longest prompt: a shape to time, not a model to read), a tiny llama (`tiny`: the CPU run CI covers, a few
hundred tokens), and any local model folder (`models`, loaded by `models.loading.load_model`). bfloat16
by default; the engine opens with `step="auto"` (CUDA graphs of the static steps on a GPU:
engine/static_step.py) unless told otherwise.

Workload per length L: a prompt of L tokens whose first L - 64 are stored (one chain stored once, from
the longest prompt: every shorter prompt's chain is its prefix), so a graft reads L - 64 tokens' blocks
and computes one 64-token grid step. Sides, timed to the first token (chosen, on the host):

- single pass: transformers itself, `model.model(ids)` then the head on the last position only (sdpa;
  on a GPU the engine's own model object, on the CPU an unpacked copy with transformers' sdpa);
- graft: `Engine.forward(prompt, max_new_tokens=1, logits="last")` with the block files in the page
  cache (read, SHA-256-verified, copied into the cache, the 64 new tokens computed);
- graft from a verified hot tier: a hook (`hot_tier_side`) reported as skipped, with its reason, until
  this build has one;
- recompute: the canonical runner from scratch over the L tokens, in the same `logits="last"` mode;
- remember: what `KVMemory.remember` runs on the engine for a new prompt of L tokens:
  `compute_blocks` (every row's logits, 4 probe tokens decoded), the block files written, the graft
  proven from those files (`verify_tokens` against the recompute, bit-identical required), the blocks
  catalogued (no verifier, routing or entry row: those cost nothing next to it);
- floor: the graft's bytes over the measured pinned host-to-device bandwidth (one large `copy_` from
  pinned memory, best of several; on the CPU a host memcpy) plus one step: the graft's own 64-token step
  as it ran (median; with CUDA graphs, the GPU's time plus a launch).

Every side is timed `repeats` times per length, interleaved (rounds in one order, then reversed), after
one untimed warm-up each (graph captures, allocations); medians with min and max, every sample kept. The
first token of the graft must equal the recompute's at every L (`first_token_equal_recompute`, `ok`);
the single pass's is reported (another computation: not owed). `targets` states issue 39's goals where
this run measured them.
"""

from __future__ import annotations

import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvmemory.bench import page_cache
from kvmemory.bench.graft import spread

CHUNK = 64
NEW_TOKENS = 64  # the prompt's tokens after the stored prefix: one grid step
PROBE_TOKENS = 4  # what remember decodes to prove its graft (KVMemory's probe_tokens)
DEFAULT_SHAPES = ("smollm2-135m", "llama-3.1-8b")
DEFAULT_LENGTHS = (2048, 8192, 32768)
TINY_LENGTHS = (128, 256)


def _smollm2_135m(longest: int):
    import transformers as T

    # HuggingFaceTB/SmolLM2-135M(-Instruct)'s config.json, written out (no hub at run time)
    return T.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         max_position_embeddings=max(8192, longest), tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


def _llama31_8b(longest: int):
    import transformers as T

    # meta-llama/Llama-3.1-8B's config.json, written out
    return T.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
                         eos_token_id=128001,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})


def _tiny(longest: int):
    import transformers as T

    return T.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         max_position_embeddings=max(1024, longest), tie_word_embeddings=False)


SHAPES: dict[str, Callable] = {"smollm2-135m": _smollm2_135m, "llama-3.1-8b": _llama31_8b, "tiny": _tiny}
# Issue 39's goals on an H200 (graft TTFT against the single pass, per shape and L; over the floor; remember).
TARGET_VS_SINGLE_PASS = {"llama-3.1-8b": {32768: 10.0, 8192: 4.0, 2048: 2.0},
                         "smollm2-135m": {32768: 2.0, 8192: 2.0}}
TARGET_OVER_FLOOR = {"llama-3.1-8b": {8192: 1.5, 32768: 1.5}}
TARGET_REMEMBER_OVER_SINGLE_PASS = {"llama-3.1-8b": {32768: 3.0}}


class IdTokenizer:
    """What the engine needs of a tokenizer when the bench speaks in token ids (a random-weight model
    has no vocabulary): its identity in the profile, and ids for text."""

    chat_template = None
    special_tokens_map: dict = {}
    eos_token_id = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def get_vocab(self) -> dict:
        return {f"<{i}>": i for i in range(self.vocab)}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b % self.vocab for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"<{int(i)}>" for i in ids)


def hot_tier_side(engine) -> tuple[Callable | None, str]:
    """The graft from a verified hot tier (pinned host / GPU memory holding chains verified once), as a
    timed side; (None, why) where this build has none. The hook issue 39 item 2's hot tier plugs into."""
    return None, "no verified hot tier in this build (issue 39, item 2): nothing to time"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """GB/s of one large copy to the device from pinned host memory (best of `repeats`, after a warm-up):
    the link a graft's bytes cross. On the CPU, a host memcpy of the same kind (no link to cross)."""
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        kind = "pinned host-to-device copy_"
    else:
        nbytes = min(nbytes, 64 << 20)
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        kind = "host memcpy (a CPU run: no host-to-device link)"
    samples = []
    for i in range(repeats + 1):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        if i:  # the first is the warm-up
            samples.append(nbytes / (time.perf_counter() - t) / 1e9)
    return {"kind": kind, "bytes": nbytes, "gb_s": max(samples), "gb_s_samples": samples}


def _random_models(cfg, dtype: torch.dtype, device: torch.device, seed: int):
    """(engine model, single-pass model) with the same random weights: on a GPU one object (transformers'
    own sdpa and linears are what the engine runs there); on the CPU the engine's copy takes kvmemory's
    CPU attention and packed linears as `load_model` gives them, the single pass keeps transformers'."""
    from transformers import AutoModelForCausalLM

    from kvmemory.models import attention, packed_linear

    torch.manual_seed(seed)
    with torch.device(device):
        plain = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    plain.eval().requires_grad_(False)
    attn = attention.for_device("sdpa", device)
    if attn == "sdpa":
        return plain, plain
    cfg = type(cfg).from_dict(cfg.to_dict())
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    model.load_state_dict(plain.state_dict())
    model.eval().requires_grad_(False)
    packed_linear.pack_linears(model)
    return model, plain


def _open(name: str, lengths: Sequence[int], dtype: torch.dtype, device: torch.device, step: str, seed: int,
          store: Path):
    """An Engine over shape `name` (SHAPES) or the model folder `name`, and the single-pass model."""
    from transformers import AutoModelForCausalLM

    from kvmemory.engine.engine import Engine
    from kvmemory.models.loading import LoadedModel, load_model
    from kvmemory.store.local import LocalStore

    longest = max(lengths) + CHUNK  # the prompt, remember's probe tokens, the padded last chunk
    if name in SHAPES:
        cfg = SHAPES[name](longest)
        model, plain = _random_models(cfg, dtype, device, seed)
        loaded = LoadedModel(model, IdTokenizer(cfg.vocab_size), f"random-{name}", f"random-{name}")
        source = {"shape": name, "weights": f"random (torch.manual_seed({seed}))", "config": cfg.to_dict()}
    else:
        loaded = load_model(name, dtype=dtype, device=str(device))
        plain = loaded.model if device.type == "cuda" else \
            AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype, attn_implementation="sdpa").eval()
        source = {"model": name, "path": loaded.path}
    t = time.perf_counter()
    eng = Engine(loaded, LocalStore(store), chunk=CHUNK, max_positions=longest, step=step)
    return eng, plain, source, time.perf_counter() - t


def _machine(device: torch.device) -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update({"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                    "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(device))})
    return out


def run_gpu_bench(shapes: Sequence[str] = DEFAULT_SHAPES, models: Sequence[str] = (),
                  lengths: Sequence[int] | None = None, *, repeats: int = 3, device: str | None = None,
                  dtype: str = "bfloat16", step: str = "auto", seed: int = 0, progress: bool = True,
                  deadline: float | None = None, on_result: Callable[[dict], None] | None = None) -> dict:
    """The bench (module docstring). `lengths` are run in the order given. `deadline`: a time.monotonic()
    after which no new length starts (those left are listed as skipped, with the reason); `on_result(report)`
    is called after every length with the report so far (a caller that writes it as it goes keeps what was
    measured)."""
    from kvmemory.errors import InvalidInput

    names = list(shapes) + list(models)
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not names:
        raise InvalidInput(f"shapes must be among {', '.join(SHAPES)} (or give --model FOLDER), got {bad or 'none'}")
    # in the order given (a caller with a time budget may put the length that matters most first)
    lengths = [int(x) for x in (lengths or (TINY_LENGTHS if set(shapes) == {"tiny"} and not models
                                            else DEFAULT_LENGTHS))]
    if any(L <= NEW_TOKENS or L % CHUNK for L in lengths):
        raise InvalidInput(f"lengths must be multiples of the grid C={CHUNK} above {NEW_TOKENS}, got {lengths}")
    if repeats < 1:
        raise InvalidInput(f"repeats must be at least 1, got {repeats}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype)
    report = {"bench": "gpu", "device": str(dev), "dtype": dtype, "chunk": CHUNK, "new_tokens": NEW_TOKENS,
              "repeats": repeats, "step": step, "lengths": lengths, "machine": _machine(dev),
              "link": link_bandwidth(dev), "shapes": [], "skipped": []}
    for name in names:
        if deadline is not None and time.monotonic() > deadline:
            report["skipped"].append({"shape": name, "reason": "time budget spent before it started"})
            continue
        _bench_shape(name, lengths, torch_dtype, dev, step, repeats, seed, progress, deadline, report, on_result)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    rows = [(s["shape"], r) for s in report["shapes"] for r in s["rows"]]
    report["ok"] = bool(rows) and all(r["first_token_equal_recompute"] and r["remember_bit_identical"] for _, r in rows)
    report["targets"] = targets(report) if dev.type == "cuda" else []
    if on_result is not None:
        on_result(report)
    return report


def _bench_shape(name, lengths, dtype, dev, step, repeats, seed, progress, deadline, report, on_result) -> None:
    """Measure shape (or model folder) `name` at every length into a new entry of report["shapes"] (added
    before the first length: a caller writing the report as it goes keeps what was measured)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvmemory-bench-gpu-"))
    try:
        eng, plain, source, open_s = _open(name, lengths, dtype, dev, step, seed, tmp / "store")
        static = eng.runner.static
        shape = {"shape": name, **source, "profile_id": eng.profile_id, "step_mode": eng.runner.step_mode,
                 "graph_fallback": static.fallback if static is not None else None,
                 "graph_probe_equal": static.probe_equal if static is not None else None,
                 "attn_implementation": eng.profile.attn_implementation, "kv_dtype": eng.profile.kv_dtype,
                 "engine_open_s": open_s, "rows": [], "skipped": []}
        report["shapes"].append(shape)
        vocab = eng.runner.vocab_size
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (max(lengths),), generator=gen).tolist()
        t = time.perf_counter()
        eng.store_prefix(ids[: max(lengths) - NEW_TOKENS])  # every L's stored prefix is a prefix of this chain
        _sync(dev)
        shape["store_prefix_s"] = time.perf_counter() - t
        hot, hot_reason = hot_tier_side(eng)
        for L in lengths:
            if deadline is not None and time.monotonic() > deadline:
                shape["skipped"].append({"L": L, "reason": "time budget spent before this length started"})
                continue
            if progress:
                print(f"[bench gpu] {name} L={L}", file=sys.stderr, flush=True)
            shape["rows"].append(_bench_length(eng, plain, ids[:L], L, repeats, seed, dev, report["link"],
                                               hot, hot_reason, tmp))
            if on_result is not None:
                on_result(report)
        del eng, plain
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench_length(eng, plain, prompt: list[int], L: int, repeats: int, seed: int, dev: torch.device, link: dict,
                  hot, hot_reason: str, tmp: Path) -> dict:
    from kvmemory.store.local import LocalStore

    first: dict[str, int] = {}
    reports: list = []
    remembered: list[bool] = []
    files: list[Path] = []

    def single_pass():
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=dev)
            hidden = plain.model(input_ids=ids, use_cache=False).last_hidden_state
            first["single_pass"] = int(plain.lm_head(hidden[:, -1:]).argmax(-1))

    def graft():
        page_cache.warm(files)  # untimed: a store in regular use (warm page cache)
        t = time.perf_counter()
        res, rep = eng.forward(prompt, max_new_tokens=1, stop_token_ids=(), logits="last")
        elapsed = time.perf_counter() - t
        first["graft"] = res.generated[0]
        reports.append(rep)
        return elapsed

    def recompute():
        res = eng.recompute(prompt, max_new_tokens=1, stop_token_ids=(), keep_logits=False, logits="last")
        first["recompute"] = res.generated[0]

    def remember():
        # a new prompt each time (new blocks to write), into a store of its own removed after
        g = torch.Generator().manual_seed(seed * 1_000_003 + L * 7 + len(remembered))
        ids = torch.randint(0, eng.runner.vocab_size, (L,), generator=g).tolist()
        folder = tmp / f"remember-{len(remembered)}"
        store, eng.store = eng.store, LocalStore(folder)
        try:
            eng.store.put_profile(eng.profile_id, eng.profile.to_dict())
            t = time.perf_counter()
            ref, blocks = eng.compute_blocks(ids, max_new_tokens=PROBE_TOKENS)
            eng.store.write_block_files(blocks)
            vr = eng.verify_tokens(ids, decode_tokens=PROBE_TOKENS, single_pass=False, reference=ref,
                                   rows=eng.rows_for(blocks))
            eng.store.put_blocks(blocks, verified=True)
            elapsed = time.perf_counter() - t
            remembered.append(vr.bit_identical)
        finally:
            eng.store.close()
            eng.store = store
            shutil.rmtree(folder, ignore_errors=True)
        return elapsed

    timed = {"single_pass": single_pass, "graft": graft, "recompute": recompute, "remember": remember}
    if hot is not None:
        timed["graft_hot_tier"] = lambda: hot(prompt)
    # warm-ups (untimed): CUDA graphs captured, buffers grown, the chain's files listed
    single_pass()
    graft()
    files[:] = [eng.store.block_path(h) for h in reports[-1].blocks_used]
    reports.clear()
    recompute()
    remember()
    remembered.clear()
    samples: dict[str, list[float]] = {k: [] for k in timed}
    orders = []
    for r in range(repeats):
        order = list(timed) if r % 2 == 0 else list(timed)[::-1]
        orders.append(order)
        for side in order:
            _sync(dev)
            t = time.perf_counter()
            took = timed[side]()
            _sync(dev)
            samples[side].append(took if isinstance(took, float) else time.perf_counter() - t)
    rep = reports[-1]
    step_s = statistics.median(r.compute_seconds for r in reports)
    floor_s = rep.bytes_read / (link["gb_s"] * 1e9) + step_s
    med = {k: statistics.median(v) for k, v in samples.items()}
    row = {
        "L": L, "tokens_grafted": rep.tokens_grafted, "tokens_computed": rep.tokens_computed,
        "bytes_grafted": rep.bytes_read,
        "first_token": dict(first), "first_token_equal_recompute": first["graft"] == first["recompute"],
        "single_pass_first_token_equal": first["single_pass"] == first["recompute"],  # not owed: other shapes
        "remember_bit_identical": all(remembered) and len(remembered) == repeats,
        "ttft_s": {k: spread(v) for k, v in samples.items()}, "samples_s": samples, "round_orders": orders,
        "graft_parts_s": {k: statistics.median(getattr(r, k) for r in reports)
                          for k in ("read_verify_seconds", "copy_seconds", "compute_seconds")},
        "floor_s": floor_s, "floor_parts_s": {"link": rep.bytes_read / (link["gb_s"] * 1e9), "step": step_s},
        "graft_over_floor": med["graft"] / floor_s,
        "speedup_vs_single_pass": med["single_pass"] / med["graft"],
        "speedup_vs_recompute": med["recompute"] / med["graft"],
        "remember_over_single_pass": med["remember"] / med["single_pass"],
        "sides_skipped": {} if hot is not None else {"graft_hot_tier": hot_reason},
    }
    if rep.tokens_grafted != L - NEW_TOKENS:  # the bench's premise: say so rather than time something else
        row["premise_broken"] = f"grafted {rep.tokens_grafted} tokens, expected {L - NEW_TOKENS}"
        row["first_token_equal_recompute"] = False
    return row


def targets(report: dict) -> list[dict]:
    """Issue 39's goals this run measured: one line per goal and length, met or not."""
    out = []
    for s in report["shapes"]:
        for x in s["rows"]:
            L, name = x["L"], s["shape"]
            if L in TARGET_VS_SINGLE_PASS.get(name, {}):
                want = TARGET_VS_SINGLE_PASS[name][L]
                out.append({"shape": name, "L": L, "target": f"graft >= {want:g}x faster than the single pass",
                            "measured": x["speedup_vs_single_pass"], "met": x["speedup_vs_single_pass"] >= want})
            if L in TARGET_OVER_FLOOR.get(name, {}):
                want = TARGET_OVER_FLOOR[name][L]
                out.append({"shape": name, "L": L, "target": f"graft within {want:g}x of the floor",
                            "measured": x["graft_over_floor"], "met": x["graft_over_floor"] <= want})
            if L in TARGET_REMEMBER_OVER_SINGLE_PASS.get(name, {}):
                want = TARGET_REMEMBER_OVER_SINGLE_PASS[name][L]
                out.append({"shape": name, "L": L, "target": f"remember within {want:g}x of the single pass",
                            "measured": x["remember_over_single_pass"], "met": x["remember_over_single_pass"] <= want})
    return out


def format_table(r: dict) -> str:
    def cell(x: dict, side: str) -> str:
        sp = x["ttft_s"][side]
        return f"{sp['median']:.4f} [{sp['min']:.4f}-{sp['max']:.4f}]"

    out = [f"device {r['machine'].get('gpu', r['device'])}, {r['dtype']}; link {r['link']['kind']}: "
           f"{r['link']['gb_s']:.1f} GB/s; times: median [min-max] over {r['repeats']} interleaved repeats"]
    for s in r["shapes"]:
        out += ["", f"{s['shape']} (step mode {s['step_mode']}{'; graphs failed: ' + s['graph_fallback'] if s.get('graph_fallback') else ''}), "
                f"engine open {s['engine_open_s']:.1f} s", "",
                "| L | single pass s | graft s | recompute s | remember s | floor s | vs single pass | "
                "graft / floor | first token = recompute |", "|" + "---|" * 9]
        for x in s["rows"]:
            out.append(f"| {x['L']} | {cell(x, 'single_pass')} | {cell(x, 'graft')} | {cell(x, 'recompute')} | "
                       f"{cell(x, 'remember')} | {x['floor_s']:.4f} | {x['speedup_vs_single_pass']:.2f}x | "
                       f"{x['graft_over_floor']:.2f} | {x['first_token_equal_recompute']} |")
        for sk in s["skipped"]:
            out.append(f"| {sk['L']} | skipped: {sk['reason']} |")
    for sk in r.get("skipped", []):
        out.append(f"{sk['shape']}: skipped: {sk['reason']}")
    skipped_sides = {k: v for s in r["shapes"] for x in s["rows"] for k, v in x["sides_skipped"].items()}
    for k, v in skipped_sides.items():
        out.append(f"side {k} not timed: {v}")
    if r.get("targets"):
        missed = [t for t in r["targets"] if not t["met"]]
        out.append(f"targets: {len(r['targets']) - len(missed)} of {len(r['targets'])} met" +
                   "".join(f"; missed {t['shape']} L={t['L']}: {t['target']} ({t['measured']:.2f})" for t in missed))
    out.append(f"first token of every graft equal to the recompute's, every remember proven: {r['ok']}")
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = r["shapes"]
    fig, axes = plt.subplots(1, max(1, len(shapes)), figsize=(6 * max(1, len(shapes)), 4.5), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        Ls = [x["L"] for x in s["rows"]]
        for side, style, label in (("single_pass", "s-", "transformers single pass"),
                                   ("recompute", "o-", "canonical recompute"), ("remember", "v-", "remember"),
                                   ("graft", "D-", "kvmemory graft (SHA-256 verified)")):
            ax.plot(Ls, [x["ttft_s"][side]["median"] for x in s["rows"]], style, label=label)
        ax.plot(Ls, [x["floor_s"] for x in s["rows"]], "k:", label="floor: bytes / pinned H2D + one step")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length L (tokens; L - 64 stored)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"{s['shape']}, {r['dtype']}, step mode {s['step_mode']}\n"
                     f"{r['machine'].get('gpu', r['device'])}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["run_gpu_bench", "format_table", "plot", "targets", "link_bandwidth", "SHAPES", "hot_tier_side"]
