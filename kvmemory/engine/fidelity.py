"""Fidelity: how far an execution profile's logits are from a stock transformers float32 single pass.

Exactness and fidelity are two different questions, and kvmemory answers them separately:

- **Exactness** (verify.py): a grafted run equals the canonical recompute *under the same profile*,
  byte for byte. That is the promise, checked by SHA-256 of the logits, never by a tolerance.
- **Fidelity** (this module): how close the canonical recompute of a profile is to what the model
  computes without kvmemory. A profile runs kvmemory's own kernels (linears from the GGUF's blocks
  or oneDNN-packed ones, the few-query attention kernel, K/V rounded to bfloat16, 64-token grid
  chunks), so its logits differ from a plain `model(ids)` in the last bits, or more. A deterministic
  bug in one of those kernels is invisible to `verify` (both sides run it); it is visible here.

The reference is transformers on its own: `AutoModelForCausalLM.from_pretrained` of the folder the
engine loaded, in float32, with transformers' `sdpa` attention, torch's plain `nn.Linear` layers and a
float32 K/V cache, one single pass `model(ids).logits` over all the ids. It is loaded once per
measurement (or passed in, to share one load between several profiles), kept out of the store, and
run under the engine's torch settings (`engine.determinism.applied()`: same thread count, same
deterministic switches), so the only differences are the profile's.

What is measured, over a fixed, committed set of texts (`FIDELITY_TEXTS`: prose, code, arithmetic,
structured data, a chat-templated prompt; 14 to 639 tokens, so up to 10 grid chunks are crossed) and
every position of each: the canonical runner's prefill logits (`Engine.recompute`) and the logits of
`decode_steps` greedy decode steps, against the single pass over the prompt followed by the tokens
kvmemory decoded (so every compared row has the same ids before it on both sides). Per position, in
float64: |Δlogit| (max over the vocabulary), KL(stock || profile) of the softmaxes, and whether the
argmaxes agree. Reported: max |Δ|, KL mean and max, argmax agreement, over all positions, per phase
(prefill, decode) and per text, with the number of texts and positions, the profile (`to_dict` and
`profile_id`) and the model. Every figure comes from the run; nothing here is asserted: the tests
(tests/test_fidelity.py) hold each profile's measured bound.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmemory.errors import InvalidInput
from kvmemory.store.blocks import ids_bytes

REFERENCE_DESCRIPTION = ("transformers AutoModelForCausalLM.from_pretrained of the engine's model folder, "
                         "float32 weights and compute, attn_implementation='sdpa', torch's nn.Linear, float32 "
                         "K/V; one single pass model(ids).logits over the prompt plus the decoded tokens")
DECODE_STEPS = 4  # greedy decode steps compared per text (the logits fed by each of the first 4 new tokens)
_ROWS = 128  # logit rows converted to float64 at a time (49k-wide vocabularies: ~50 MB per block)


@dataclass(slots=True, frozen=True)
class FidelityText:
    """One committed text: plain `text`, or chat `messages` rendered by the model's chat template."""

    name: str
    kind: str
    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()

    def ids(self, tokenizer) -> list[int]:
        if self.messages:
            msgs = [{"role": r, "content": c} for r, c in self.messages]
            if getattr(tokenizer, "chat_template", None):
                rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            else:  # a model without a template: a plain layout, still the same ids on both sides
                rendered = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
        else:
            rendered = self.text
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


_PROSE_LONG = """\
The river that runs through the old market town has changed its course three times in recorded history. \
The first change came after a winter of heavy snow, when the spring melt carried so much gravel down from \
the hills that the main channel silted up within a single week. The millers, whose wheels depended on a \
steady flow, petitioned the town council for money to dig a new channel, and the council, after a long \
argument about who should pay, agreed to split the cost between the mills and the merchants who used the \
river to bring grain and timber into the market square.

The second change was deliberate. A canal company bought the land along the eastern bank and straightened \
the river over a distance of four miles, cutting through two meanders that had flooded the lower fields \
almost every autumn. Farmers who had lost crops to those floods welcomed the work; fishermen, who had \
caught their best eels in the slow water of the bends, did not. The canal made transport cheaper, and for \
a generation the town grew faster than any of its neighbours. Warehouses appeared along the new straight \
bank, then a brewery, a tannery and a small foundry that made parts for agricultural machines.

The third change was the river's own doing again. A century after the canal was cut, a storm stalled over \
the hills for two days and the water rose higher than anyone living had seen. The straightened channel \
carried the flood faster than the old meanders ever had, and where the canal met the original bed below \
the town, the current tore away the bank and opened a new path across the water meadows. When the water \
fell, the river ran in a channel nobody had planned, and the warehouses on the canal stood beside a \
stretch of still water that slowly filled with reeds.

Historians of the town like to say that each of these changes tells you who held power at the time. The \
millers could only ask; the canal company could buy; the storm needed no one's permission. Engineers \
draw a different lesson. A river is a system that moves sediment as well as water, and any change to its \
shape changes where the sediment settles. Straightening a channel makes the water faster, faster water \
carries more gravel, and the gravel has to come to rest somewhere downstream, usually where the slope \
eases and the current slows. The flood that broke the bank was unusual, but the place where it broke \
was predictable, and a survey made twenty years earlier had marked it as the weakest point on the canal.

Today the town keeps a small museum in the old toll house at the canal lock. Its main exhibit is a long \
table covered with maps, one for each century, drawn to the same scale and laid out side by side, so that \
a visitor can walk along the table and watch the blue line of the river bend, straighten and bend again. \
Children are given a handful of sand and a tray of water to build their own rivers, and most of them \
discover, without being told, that the water always finds the lowest path and that a wall built in the \
wrong place only moves the problem a little further along.
"""

_CODE = '''\
def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals and return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [ordered[0]]
    for start, end in ordered[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


class RateLimiter:
    def __init__(self, capacity: int, refill_per_second: float) -> None:
        self.capacity = capacity
        self.tokens = float(capacity)
        self.refill = refill_per_second
        self.updated = 0.0

    def allow(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.refill)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


if __name__ == "__main__":
    print(merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18), (17, 20)]))
'''

# The committed set. Its ids (per the model's tokenizer) are hashed into every report (`texts_sha256`).
FIDELITY_TEXTS: tuple[FidelityText, ...] = (
    FidelityText("prose-short", "prose",
                 "The lighthouse keeper climbed the spiral stairs every evening to light the lamp."),
    FidelityText("arithmetic", "arithmetic",
                 "A school orders 14 boxes of pencils with 36 pencils in each box. During the first term the "
                 "pupils use 287 pencils, and the teachers take 45 more for the staff room.\n"
                 "Pencils ordered: 14 * 36 = 504.\nPencils used: 287 + 45 = 332.\n"
                 "Pencils left: 504 - 332 = 172.\nThe answer is 172.\n"
                 "Check: 172 + 332 = 504 and 504 / 36 = 14, so the numbers agree."),
    FidelityText("chat", "chat", messages=(
        ("system", "You are a careful assistant. Answer briefly and show each calculation step."),
        ("user", "A train leaves at 09:40 and arrives at 13:15. It stops for 12 minutes at each of 3 "
                 "stations. How many minutes is it actually moving?"),
    )),
    FidelityText("data-json", "structured",
                 '{"order_id": 48213, "customer": {"name": "R. Okafor", "city": "Leeds"}, "items": ['
                 '{"sku": "TEA-042", "qty": 3, "price": 4.25}, {"sku": "CUP-007", "qty": 2, "price": 6.90}, '
                 '{"sku": "POT-001", "qty": 1, "price": 18.00}], "shipping": "standard", "paid": true}'),
    FidelityText("code", "code", _CODE),
    FidelityText("prose-long", "prose", _PROSE_LONG),
)


def select_texts(names: Sequence[str] | None = None) -> tuple[FidelityText, ...]:
    """The committed texts named (in the committed order), or all of them for None."""
    if not names:
        return FIDELITY_TEXTS
    known = {t.name for t in FIDELITY_TEXTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidInput(f"unknown fidelity texts {unknown}; the committed ones are {', '.join(sorted(known))}")
    return tuple(t for t in FIDELITY_TEXTS if t.name in set(names))


class StockReference:
    """The stock transformers float32 model of one model folder (loaded once; nothing of kvmemory runs in it)."""

    def __init__(self, path: str, device: torch.device | str = "cpu", *, memo: bool = False):
        """`memo`: keep each pass's logits (keyed by the ids and the thread count), for measuring several
        profiles of one model on the same texts without recomputing the same single pass (tests)."""
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.path = str(path)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32,
                                                          attn_implementation="sdpa")
        self.model.eval().requires_grad_(False).to(self.device)
        self.load_seconds = time.perf_counter() - t0
        self._memo: dict | None = {} if memo else None
        self.attn_implementation = str(getattr(self.model.config, "_attn_implementation", None))
        # What computes the linears: only torch's own nn.Linear is the reference (no kvmemory layer).
        self.linear_types = sorted({type(m).__module__ + "." + type(m).__qualname__
                                    for m in self.model.modules() if isinstance(m, torch.nn.Linear)})
        if self.attn_implementation != "sdpa" or self.linear_types != ["torch.nn.modules.linear.Linear"]:
            raise InvalidInput(f"the stock reference must run transformers' sdpa and torch's nn.Linear; it runs "
                               f"{self.attn_implementation!r} and {self.linear_types}")

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), V] float32 logits of one single pass (transformers' own DynamicCache, float32 K/V)."""
        key = (ids_bytes(ids), torch.get_num_threads())
        if self._memo is not None and key in self._memo:
            return self._memo[key]
        x = torch.tensor([list(map(int, ids))], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x).logits[0].float().cpu()
        if self._memo is not None:
            self._memo[key] = out
        return out

    def weights_equal(self, model: torch.nn.Module) -> tuple[bool, int]:
        """Whether every tensor the two state dicts share by name has the same dtype, shape and bytes
        (false when the engine computes in another dtype), and how many were compared."""
        ours, theirs = self.model.state_dict(), model.state_dict()
        shared = [k for k in ours if k in theirs]
        equal = all(ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
                    and torch.equal(ours[k].cpu(), theirs[k].cpu()) for k in shared)
        return bool(shared) and equal, len(shared)

    def to_json(self) -> dict:
        import transformers

        return {"implementation": REFERENCE_DESCRIPTION, "path": self.path, "dtype": "float32",
                "attn_implementation": self.attn_implementation, "linear_types": self.linear_types,
                "kv_dtype": "float32", "transformers_version": transformers.__version__,
                "torch_version": torch.__version__, "load_seconds": round(self.load_seconds, 3)}


@dataclass(slots=True)
class _Tally:
    """Per-position figures accumulated in float64."""

    positions: int = 0
    max_abs: float = 0.0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    agree: int = 0

    def add(self, stock: torch.Tensor, ours: torch.Tensor) -> None:
        for s in range(0, stock.shape[0], _ROWS):
            p = stock[s:s + _ROWS].double()
            q = ours[s:s + _ROWS].double()
            self.max_abs = max(self.max_abs, float((p - q).abs().max()))
            lp, lq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)  # KL(stock || profile), per position
            self.kl_sum += float(kl.sum())
            self.kl_max = max(self.kl_max, float(kl.max()))
            self.agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            self.positions += p.shape[0]

    def merge(self, other: "_Tally") -> None:
        self.positions += other.positions
        self.max_abs = max(self.max_abs, other.max_abs)
        self.kl_sum += other.kl_sum
        self.kl_max = max(self.kl_max, other.kl_max)
        self.agree += other.agree

    def to_json(self) -> dict:
        n = self.positions
        return {"positions": n, "max_abs_diff": self.max_abs, "kl_mean": self.kl_sum / n if n else 0.0,
                "kl_max": self.kl_max, "argmax_agreement": self.agree / n if n else 1.0,
                "argmax_disagreements": n - self.agree}


def measure_fidelity(engine, *, texts: Sequence[FidelityText] = FIDELITY_TEXTS, decode_steps: int = DECODE_STEPS,
                     reference: StockReference | None = None) -> dict:
    """Measure `engine`'s canonical logits against the stock float32 single pass (see the module
    docstring) and return the report as a JSON-able dict. `reference` shares a loaded stock model
    between several engines of the same model folder; by default one is loaded for this call and
    dropped after it. Nothing is written to the engine's store."""
    if decode_steps < 0:
        raise InvalidInput(f"decode_steps must be >= 0, got {decode_steps}")
    if not texts:
        raise InvalidInput("no texts to measure fidelity on")
    path = str(engine.loaded.path)
    t_start = time.perf_counter()
    with engine.determinism.applied():  # the reference runs under the engine's threads and switches too
        if reference is None:
            reference = StockReference(path, engine.device)
        elif reference.path != path:
            raise InvalidInput(f"the stock reference was loaded from {reference.path!r}, the engine from {path!r}")
        weights_equal, weights_compared = reference.weights_equal(engine.model)
        overall, prefill, decode = _Tally(), _Tally(), _Tally()
        per_text, ids_hash = [], hashlib.sha256()
        ours_s = stock_s = 0.0
        for t in texts:
            ids = t.ids(engine.tokenizer)
            ids_hash.update(t.name.encode() + b"\0" + ids_bytes(ids))
            t0 = time.perf_counter()
            # max_new_tokens = steps + 1: the logits fed by each of the first `steps` decoded tokens.
            run = engine.recompute(ids, max_new_tokens=decode_steps + 1 if decode_steps else 0, stop_token_ids=())
            t1 = time.perf_counter()
            fed = list(run.generated[:decode_steps])
            stock = reference.logits(ids + fed)
            t2 = time.perf_counter()
            ours_s, stock_s = ours_s + t1 - t0, stock_s + t2 - t1
            n = len(ids)
            ours_decode = run.decode_logits if run.decode_logits is not None else torch.empty(0, stock.shape[1])
            if run.prefill_logits.shape != (n, stock.shape[1]) or ours_decode.shape[0] != len(fed):
                raise InvalidInput(f"{t.name}: the runner kept {tuple(run.prefill_logits.shape)} prefill and "
                                   f"{ours_decode.shape[0]} decode logit rows for {n} ids and {len(fed)} steps")
            tp, td = _Tally(), _Tally()
            tp.add(stock[:n], run.prefill_logits.float())
            if len(fed):
                td.add(stock[n:], ours_decode.float())
            tt = _Tally()
            tt.merge(tp)
            tt.merge(td)
            prefill.merge(tp)
            decode.merge(td)
            overall.merge(tt)
            per_text.append({"name": t.name, "kind": t.kind, "tokens": n, "decode_steps": len(fed),
                             "ids_sha256": hashlib.sha256(ids_bytes(ids)).hexdigest(),
                             "generated": run.generated, **tt.to_json()})
    prof = engine.profile
    return {
        "what": "fidelity of this profile's canonical logits to a stock transformers float32 single pass "
                "(not exactness: a graft's bit-identity to the recompute is what verify checks)",
        "model": engine.loaded.source,
        "model_path": path,
        "profile_id": engine.profile_id,
        "profile": prof.to_dict(),
        "reference": reference.to_json(),
        "reference_weights_equal": weights_equal,
        "reference_weights_compared": weights_compared,
        "texts": len(per_text),
        "texts_sha256": ids_hash.hexdigest(),
        "decode_steps": decode_steps,
        "positions": overall.positions,
        "prefill_positions": prefill.positions,
        "decode_positions": decode.positions,
        **{k: v for k, v in overall.to_json().items() if k != "positions"},
        "by_phase": {"prefill": prefill.to_json(), "decode": decode.to_json()},
        "per_text": per_text,
        "seconds": {"profile": round(ours_s, 3), "reference": round(stock_s, 3),
                    "total": round(time.perf_counter() - t_start, 3)},
    }


def profile_label(profile: dict) -> str:
    """A short name for a profile: its linears, attention and K/V dtype."""
    return f"{profile.get('linear_impl')} linears, {profile.get('attn_implementation')}, {profile.get('kv_dtype')} K/V"


def format_fidelity(report: dict) -> str:
    """A readable table of a `measure_fidelity` report."""
    lines = [f"fidelity of profile {report['profile_id'][:12]} ({profile_label(report['profile'])}, "
             f"{report['profile'].get('threads')} threads, chunk {report['profile'].get('chunk')})",
             f"  model {report['model']}; reference: stock transformers float32, sdpa, nn.Linear, float32 K/V, "
             "single pass",
             f"  {report['texts']} texts, {report['positions']} positions ({report['prefill_positions']} prefill, "
             f"{report['decode_positions']} decode; {report['decode_steps']} greedy steps per text)",
             ""]
    head = f"  {'':<14} {'positions':>9} {'max |dlogit|':>13} {'KL mean':>11} {'KL max':>11} {'argmax agree':>13}"
    lines.append(head)

    def row(name: str, d: dict) -> str:
        return (f"  {name:<14} {d['positions']:>9} {d['max_abs_diff']:>13.6g} {d['kl_mean']:>11.3e} "
                f"{d['kl_max']:>11.3e} {d['argmax_agreement']:>12.2%}")

    lines.append(row("all", report))
    for phase, d in report["by_phase"].items():
        lines.append(row(phase, d))
    for t in report["per_text"]:
        lines.append(row(t["name"], t))
    lines.append("")
    lines.append("  Exactness (graft vs recompute, byte equality) is verify's check; these are distances to "
                 "another implementation.")
    return "\n".join(lines)


__all__ = ["DECODE_STEPS", "FIDELITY_TEXTS", "FidelityText", "StockReference", "format_fidelity",
           "measure_fidelity", "profile_label", "select_texts"]
