"""The canonical runner: chunk-grid prefill, then decode one token at a time. This is the reference.

Prefill runs in chunks aligned to absolute multiples of the grid `C`: position `p` belongs to chunk
`p // C`. A run that starts from a graft at `g` (a multiple of `C`) computes exactly the chunks a run
from scratch computes after `g`, with the same shapes and the same cache contents before each of them,
so every kernel sees the same inputs and the logits are bit-identical. A single-pass `model(ids)` uses
other GEMM shapes and differs in the last bits; that gap is a diagnostic, never part of the promise.

Cuts: a prompt made of segments (a stored entry followed by a question, a chat's earlier turns followed
by the next) may also be cut where a segment ends: `cuts` are positions where a chunk ends besides the
grid's, so a segment's last, partial chunk is computed on its own and kept as a block (a tail block),
and the next segment starts a chunk of its own, up to the next multiple of C. Chunks are then
`chunk_spans(start, end, C, cuts)`; a run from a graft at a cut computes exactly the chunks a run from
scratch with the same cuts computes after it, so the promise is unchanged: a graft and its recompute
share the token ids and the cuts (an attestation records them). Without cuts nothing changes.
Why cuts: an entry of 37 tokens has no full block at C = 64, so without them it would graft nothing;
with a cut at its end it grafts all 37.

Why `C = 64` by default: a graft always recomputes the tail that does not fill a block (at most
`C - 1` tokens, plus at least the last prompt token), so a small grid keeps that work small; a block of
the default model is then 64 x 30 layers x 2 x 3 heads x 64 dims x 4 bytes = 2.9 MB, large enough that
per-block costs (a file, a catalogue row, a hash call) are amortised, and CPU prefill in 64-token
chunks costs about the same per token as longer chunks (measured on SmolLM2: `kvmemory bench graft`).

Kernels: on the CPU the model runs `kvmemory_sdpa` (models/attention.py), SDPA reading grouped K/V heads in
place instead of expanding them per chunk, or on AVX-512 and AVX2 CPUs `kvmemory_fewq`, which also gives the
steps with few query rows (a graft's tail, decoding) kvmemory's own attention kernel
(kernels/few_query_attention.py); its linears compute from the GGUF's own blocks for the embedded model
(gguf_linear.py) or with oneDNN-packed weights (packed_linear.py); all are chosen at load and recorded in
the profile.

Logits (`logits="all"`, the default): computed for every position of every prefill chunk, so the lm_head
GEMM shape depends only on the chunk, which keeps prefill logits comparable between a grafted run and a
full one (what `verify` compares and `/v1/completions` hashes). `logits="last"`: only the rows a token is
chosen from, the prompt's last position and each decode step, as llama.cpp and transformers' `generate`
compute them; what answering needs (`KVMemory.generate`), and the lm_head over a chunk's other rows is
skipped (at 16 new tokens after a graft, ~15 rows of a 49152 x 576 product and their hashes). A grafted
run and a recompute in the same mode compute the same rows with the same shapes: the same bits.

Cache layout (transformers' `DynamicCache`, full-attention layers writing into room reserved for the
whole forward, cache.py): per layer K and V of shape `[batch=1, H_kv, S, D]` (views of
`[1, H_kv, capacity, D]` buffers); sliding-window layers keep only the last `window - 1` positions.

Step mode (`step`, the profile's `step_mode`): "dynamic" is the path above (the CPU default); "static" and
"cuda-graph" run every step on static shapes over a cache the runner keeps (static_step.py: padded
chunks, key-length buckets, CUDA graphs on a GPU), where every layer keeps every position.
"""

from __future__ import annotations

import math

import hashlib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvmemory.engine.batched_step import BatchedStep, StepItem
from kvmemory.engine.cache import ReservedLayer, copied, new_cache
from kvmemory.engine.static_step import StaticGrid, resolve_step_mode
from kvmemory.errors import InvalidInput, UnsupportedArchitecture
from kvmemory.engine.profile import tensor_bytes
from kvmemory.models import llama_step

DEFAULT_CHUNK = 64

# Rope types whose frequencies depend on the total sequence length: a KV computed in a short context
# differs from the same position in a longer one, so no own-position graft can be exact.
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


@dataclass(slots=True, frozen=True)
class Sampling:
    """Decode settings. `temperature == 0` is greedy; otherwise seeded sampling (top-k / top-p)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        # Refused here, once, so every caller (adapters, server, CLI) gets the same typed error rather
        # than a negative temperature silently decoding greedily.
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidInput(f"temperature must be a finite number >= 0 (0 decodes greedily), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidInput(f"top_k must be an integer >= 0 (0 = no top-k cut), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidInput(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = Sampling()


@dataclass(slots=True)
class ForwardResult:
    """What one canonical forward (prefill from `start`, then decode) produced."""

    token_ids: list[int]  # the prompt
    start: int  # first position computed (the graft point; 0 from scratch)
    generated: list[int]  # decoded tokens
    prefill_logits: torch.Tensor | None  # [n - start, V] when kept
    decode_logits: torch.Tensor | None  # [len(generated) - 1, V] when kept (the logits fed by each new token)
    logits_sha256: str  # over the bytes of every logit computed (`logits` mode), prefill then decode, in order
    argmax: list[int]  # argmax of every logit row computed, in order
    prefill_seconds: float
    decode_seconds: float
    stopped_by: str = "length"
    extra: dict = field(default_factory=dict)

    @property
    def tokens_computed(self) -> int:
        return len(self.token_ids) - self.start

    @property
    def tokens_decoded(self) -> int:
        return len(self.generated)

    def all_logits(self) -> torch.Tensor:
        parts = [t for t in (self.prefill_logits, self.decode_logits) if t is not None and t.numel()]
        return torch.cat(parts, 0) if parts else torch.empty(0)


def check_cuts(cuts: Sequence[int] | None) -> tuple[int, ...]:
    """`cuts` as a sorted tuple of distinct positive positions (InvalidInput for anything else)."""
    if not cuts:
        return ()
    try:
        out = sorted({int(c) for c in cuts})
    except (TypeError, ValueError):
        raise InvalidInput(f"cuts must be token positions (integers), got {cuts!r}") from None
    if any(isinstance(c, bool) for c in cuts) or out[0] < 1 or any(int(c) != c for c in cuts):
        raise InvalidInput(f"cuts must be positive token positions, got {list(cuts)!r}")
    return tuple(out)


def chunk_spans(start: int, end: int, chunk: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Chunks of [start, end) cut at absolute multiples of `chunk` and at every position of `cuts`
    (the ends of a prompt's segments: a stored entry, a chat turn; see the module docstring)."""
    marks = sorted(c for c in set(cuts) if start < c < end)
    spans = []
    p, i = start, 0
    while p < end:
        e = min((p // chunk + 1) * chunk, end)
        while i < len(marks) and marks[i] <= p:
            i += 1
        if i < len(marks) and marks[i] < e:
            e = marks[i]
        spans.append((p, e))
        p = e
    return spans


def span_boundary(position: int, chunk: int, cuts: Sequence[int] = ()) -> bool:
    """Whether a span of the grid (with these cuts) may end, and the next start, at `position`."""
    return position % chunk == 0 or position in cuts


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(type(model).forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise UnsupportedArchitecture(f"{type(model).__name__}.forward takes no cache argument")


def check_architecture(model: torch.nn.Module, chunk: int) -> None:
    """Refuse models whose cache cannot be grafted exactly, with a reason."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cfg = model.config.get_text_config(decoder=True)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_types = {rope.get("rope_type") or rope.get("type")} if isinstance(rope, dict) else set()
    if isinstance(rope, dict):  # per-layer-type rope parameters (Gemma3 style)
        rope_types |= {v.get("rope_type") for v in rope.values() if isinstance(v, dict)}
    bad = rope_types & _LENGTH_DEPENDENT_ROPE
    if bad:
        raise UnsupportedArchitecture(
            f"{type(model).__name__} uses rope type {sorted(bad)}, whose frequencies depend on the total "
            "sequence length: a stored KV block is not valid in a longer context, so it cannot be grafted "
            "exactly. Use a model (or config) with a fixed rope."
        )
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != cfg.num_hidden_layers:
        raise UnsupportedArchitecture(
            f"{type(model).__name__}: the cache has {len(cache.layers)} layers for {cfg.num_hidden_layers} "
            "decoder layers (KV sharing or a hybrid cache); exact grafting supports one KV per layer."
        )
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            if layer.sliding_window - 1 < chunk:
                raise UnsupportedArchitecture(
                    f"layer {i} keeps a sliding window of {layer.sliding_window} positions, smaller than the "
                    f"grid C={chunk} + 1: its blocks cannot be captured whole. Use a grid C <= "
                    f"{layer.sliding_window - 1}."
                )
        elif type(layer) is not DynamicLayer:
            raise UnsupportedArchitecture(
                f"layer {i} uses a {type(layer).__name__} cache, which kvmemory cannot graft exactly "
                "(only full and sliding-window attention layers are supported)."
            )


# Attention implementations that read a cache narrower than the queries (attention.py widens it).
_WIDENING_ATTENTION = ("kvmemory_sdpa", "kvmemory_fewq")


def resolve_kv_dtype(model: torch.nn.Module, kv_dtype: torch.dtype | str | None, full_attention_only: bool) -> torch.dtype:
    """The dtype the cache keeps K/V in. None: the model's. "auto" (what `Engine.open` asks for): bfloat16
    under a float32 model on the CPU with kvmemory's attention and full-attention layers only (half the
    bytes per block to store, read and verify, and half the cache for attention to stream, as
    llama.cpp's F16 cache; cache.py), else the model's. A named dtype other than the model's is taken
    only where "auto" would choose it; anything else is refused with the reason."""
    model_dtype = next(model.parameters()).dtype
    attn = getattr(model.config, "_attn_implementation", None)
    if kv_dtype == "auto":
        narrow = (model_dtype == torch.float32 and next(model.parameters()).device.type == "cpu"
                  and full_attention_only and attn in _WIDENING_ATTENTION)
        return torch.bfloat16 if narrow else model_dtype
    if kv_dtype is None:
        return model_dtype
    if isinstance(kv_dtype, str):
        from kvmemory.store.blocks import DTYPES

        if DTYPES.get(kv_dtype) is None:
            raise InvalidInput(f"kv_dtype must be 'auto' or a dtype name such as 'bfloat16', got {kv_dtype!r}")
        kv_dtype = DTYPES[kv_dtype]
    if kv_dtype == model_dtype:
        return kv_dtype
    if not (model_dtype == torch.float32 and kv_dtype == torch.bfloat16):
        raise InvalidInput(f"a {kv_dtype} KV cache under a {model_dtype} model is not supported "
                           "(bfloat16 K/V under a float32 model is)")
    if attn not in _WIDENING_ATTENTION:
        raise InvalidInput(f"a bfloat16 KV cache under a float32 model needs attention {' or '.join(_WIDENING_ATTENTION)} "
                           f"(the CPU default), not {attn!r}")
    if not full_attention_only:
        raise UnsupportedArchitecture("a KV dtype other than the model's needs full-attention layers only "
                                      "(sliding-window layers keep transformers' own cache)")
    return kv_dtype


class CanonicalRunner:
    """Chunk-grid prefill and token-by-token decode over a frozen model."""

    def __init__(self, model: torch.nn.Module, chunk: int = DEFAULT_CHUNK, max_positions: int | None = None,
                 kv_dtype: torch.dtype | str | None = None, step: str = "dynamic"):
        """`kv_dtype`: see `resolve_kv_dtype` (None: the model's dtype). `step`: "dynamic", "static",
        "cuda-graph" or "auto" (static_step.resolve_step_mode; `step_mode` says what runs)."""
        if chunk < 1:
            raise InvalidInput(f"the chunk grid must be a positive number of tokens, got {chunk}")
        check_architecture(model, chunk)
        self.model = model
        self.chunk = chunk
        self.device = next(model.parameters()).device
        self._cache_kwarg = _cache_kwarg(model)
        cfg = model.config.get_text_config(decoder=True)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(max_positions or getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        # Per cache layer, its sliding window, or None for a full-attention layer reserving room
        # (known once: a graft shapes its buffers by them, graft.py). With no windows at all, a graft
        # can hold every layer in one tensor.
        self.sliding_windows = [None if isinstance(l, ReservedLayer) else l.sliding_window
                                for l in new_cache(model).layers]
        self.full_attention_only = all(w is None for w in self.sliding_windows)
        self.kv_dtype = resolve_kv_dtype(model, kv_dtype, self.full_attention_only)  # runner.new_cache keeps K/V in it
        self._lean_step = llama_step.for_model(model)  # None: every step runs transformers' forward
        self._choices_step: BatchedStep | None = None  # score_choices' (made when first used)
        # transformers' models that compute the lm_head on the last rows only when asked (logits="last")
        self._keeps_logits = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        self.step_mode = resolve_step_mode(step, self.device)
        self.static: StaticGrid | None = None
        if self.step_mode != "dynamic":
            self.static = StaticGrid(model, chunk, self.kv_dtype, self.sliding_windows, self.max_positions,
                                     self._cache_kwarg, graphs=self.step_mode == "cuda-graph",
                                     fallback_ok=step == "auto")
            self.step_mode = self.static.mode  # "static" where step="auto" could not capture (it says why)
            # Its cache keeps every position of every layer (a sliding window is a mask there), so a
            # graft restores them all (graft.py shapes its buffers by these).
            self.sliding_windows = [None] * len(self.sliding_windows)
            self.full_attention_only = True

    def new_cache(self, capacity: int = 0):
        """An empty cache whose full-attention layers reserve `capacity` positions (cache.py)."""
        return new_cache(self.model, capacity, self.kv_dtype)

    def check_ids(self, token_ids: Sequence[int], extra: int = 0) -> None:
        n = len(token_ids)
        if n == 0:
            raise InvalidInput("empty input: there is nothing to compute")
        if n + extra > self.max_positions:
            raise InvalidInput(
                f"{n} prompt tokens + {extra} to decode exceed the model's {self.max_positions} positions; "
                "shorten the text (or raise max_positions if the model really supports more)"
            )
        try:  # min / max run in C: 8k ids in 0.1 ms, where int() on each took 1 ms
            if 0 <= min(token_ids) and max(token_ids) < self.vocab_size:
                return
        except TypeError:  # not all numbers: int() decides below
            pass
        bad = [t for t in token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise InvalidInput(f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    @torch.inference_mode()
    def _step(self, ids: torch.Tensor, start: int, cache, rows: int | None = None) -> torch.Tensor:
        """One forward over `ids` (shape [1, T]) at absolute positions start..start+T-1; returns the
        logits of the last `rows` positions [rows, V] (None: all T). On a plain llama model it goes
        through the lean step (the same bits: llama_step.py); in a static step mode, static_step.py's."""
        if self.static is not None:
            return self.static.step(ids, start, rows)
        if self._lean_step is not None:
            return self._lean_step.step(ids, start, cache, rows=rows)
        T = ids.shape[1]
        pos = torch.arange(start, start + T, device=self.device).unsqueeze(0)
        keep = {}
        if rows is not None and rows < T and self._keeps_logits:
            keep["logits_to_keep"] = max(rows, 1)  # transformers reads 0 as "all"
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._cache_kwarg: cache}, **keep)
        logits = out.logits[0]
        return logits if rows is None else logits[logits.shape[0] - rows :]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int],
        *,
        start: int = 0,
        cache=None,
        max_new_tokens: int = 0,
        sampling: Sampling = GREEDY,
        stop_token_ids: Sequence[int] = (),
        keep_logits: bool = True,
        on_chunk: Callable[[int, int, object], None] | None = None,
        on_token: Callable[[int], bool] | None = None,
        logits: str = "all",
        cuts: Sequence[int] = (),
    ) -> ForwardResult:
        """Prefill `token_ids[start:]` on the grid (over `cache`, which holds positions < start), then decode.

        `cuts`: positions where a prefill chunk ends besides the grid's (chunk_spans); a graft and its
        recompute pass the same ones. `start` is 0, a multiple of C or a cut.

        `on_chunk(chunk_start, chunk_end, cache)` is called after each prefill chunk (used to capture
        blocks). `on_token(token_id)` is called for each decoded token; returning True stops decoding.
        `logits`: "all" (every prefill position's, hashed and kept) or "last" (only the rows a token is
        chosen from; nothing to keep, so `keep_logits` must be False): see the module docstring.
        """
        if logits not in ("all", "last"):
            raise InvalidInput(f"logits must be 'all' or 'last', got {logits!r}")
        if logits == "last" and keep_logits:
            raise InvalidInput("logits='last' computes no prefill rows to keep: pass keep_logits=False, "
                               "or logits='all' to keep every row")
        self.check_ids(token_ids, max_new_tokens)
        cuts = check_cuts(cuts)
        n = len(token_ids)
        if not span_boundary(start, self.chunk, cuts) or not 0 <= start < n:
            raise InvalidInput(f"prefill must start on the grid or at a cut inside the prompt (start={start}, n={n})")
        if cache is None:
            if start:
                raise InvalidInput("a prefill that starts after position 0 needs the cache of the positions before")
            if self.static is None:
                cache = self.new_cache(n + max_new_tokens)
        static = self.static
        if static is not None:  # its own buffers, holding `cache`'s positions < start (static_step.py)
            cache = static.begin(cache, start, n, n + max_new_tokens)
        ids = torch.tensor([list(map(int, token_ids[start:]))], dtype=torch.long, device=self.device)  # what is computed
        hasher = hashlib.sha256()
        argmax: list[int] = []
        kept: list[torch.Tensor] = []

        def account(logits: torch.Tensor) -> None:
            hasher.update(tensor_bytes(logits))  # the logits' own bytes, no conversion
            argmax.extend(logits.argmax(-1).tolist())
            if keep_logits:
                kept.append(logits.detach().cpu())

        t0 = time.perf_counter()
        last = None
        for s, e in chunk_spans(start, n, self.chunk, cuts):
            # "last": the lm_head runs only on the prompt's last position (in the last chunk)
            last = self._step(ids[:, s - start : e - start], s, cache, rows=None if logits == "all" else int(e == n))
            account(last)
            if on_chunk is not None:
                on_chunk(s, e, cache if static is None else static.view(e))
        prefill_logits = torch.cat(kept, 0) if keep_logits else None
        t1 = time.perf_counter()

        generated: list[int] = []
        decode_kept: list[torch.Tensor] = []
        kept = decode_kept
        gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
        stopped_by = "length"
        next_logits = last[-1]
        stops = set(int(t) for t in stop_token_ids)
        for i in range(max_new_tokens):
            tok = _choose(next_logits, sampling, gen)
            generated.append(tok)
            if tok in stops:
                stopped_by = "stop_token"
                break
            if on_token is not None and on_token(tok):
                stopped_by = "stop"
                break
            if i == max_new_tokens - 1:
                break
            step = self._step(torch.tensor([[tok]], device=self.device), n + i, cache)
            account(step)
            next_logits = step[-1]
        t2 = time.perf_counter()
        if static is not None:  # the positions computed: the prompt, and each token a decode step fed
            cache = static.view(n + max(len(generated) - 1, 0))
        return ForwardResult(
            token_ids=list(map(int, token_ids)),
            start=start,
            generated=generated,
            prefill_logits=prefill_logits,
            decode_logits=torch.cat(decode_kept, 0) if keep_logits and decode_kept else (
                torch.empty(0, self.vocab_size) if keep_logits else None),
            logits_sha256=hasher.hexdigest(),
            argmax=argmax,
            prefill_seconds=t1 - t0,
            decode_seconds=t2 - t1,
            stopped_by=stopped_by,
            extra={"cache": cache, "next_logits": next_logits},
        )

    def _choice_stepper(self) -> BatchedStep:
        """The batched step `score_choices` shares among a prompt's choices (made once)."""
        if self._choices_step is None:
            self._choices_step = BatchedStep(self)
        return self._choices_step

    def check_choices(self, choices: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """`choices` as tuples of ints, or InvalidInput: none given, an empty one, or an id the model lacks.
        Checked once where a caller hands them in (Engine.choose_many, Batch.add), before anything runs."""
        out = tuple(tuple(int(t) for t in c) for c in choices or ())
        if not out:
            raise InvalidInput("no choices to pick from")
        if any(len(c) == 0 for c in out):
            raise InvalidInput("every choice needs at least one token")
        self.check_ids([t for c in out for t in c])
        return out

    def first_choice_scores(self, next_logits: torch.Tensor, choices: Sequence[Sequence[int]]) -> list[float]:
        """Each choice's first token's log-probability after the prompt (`score_choices` adds the rest);
        `choices` already checked (`check_choices`)."""
        first = next_logits.float().log_softmax(-1)
        return [float(first[int(c[0])]) for c in choices]

    def choices_in_steps(self, cache) -> bool:
        """Whether the choices after a prompt in `cache` are scored as steps of the lean step (the runs of
        `choice_runs` in one step after the prompt's K/V where the step is shared: `choice_items`)."""
        layers = getattr(cache, "layers", None)
        return bool(self._lean_step is not None and self.static is None and layers
                    and all(isinstance(layer, ReservedLayer) for layer in layers))

    def choice_items(self, n: int, cache, choices: Sequence[Sequence[int]]) -> list[StepItem]:
        """One step item per run of `choice_runs`, at the n positions after the prompt, for a shared step
        (`add_choice_logits` reads their logits; `choices_done` then sets the cache back to n positions).

        Where every layer of the prompt's cache has room for the longest run in one layout (the lean
        step's `_c_room`; the buffers are moved into larger ones once where short), every run is over
        that cache itself: a shared step makes each item's RoPE + K/V write and attention of a layer
        before the next item's (batched_step.py: kvm_decode_rows, or its Python loop, item by item), so a
        run writes its K/V at positions n.. and attends over the prompt's n and its own, and the next run
        overwrites them: the calls, and bits, of a run over a copy of the prompt's K/V without the copies
        (~3 ms and the prompt's K/V each). Else each run over its own copy."""
        runs = [_run_ids(run, self.device) for run in choice_runs(choices)]
        if self._choices_in_place(n, cache, max(ids.shape[1] for ids in runs)):
            return [StepItem(ids, n, cache) for ids in runs]
        return [StepItem(ids, n, copied(cache, room=ids.shape[1])) for ids in runs]

    def _choices_in_place(self, n: int, cache, longest: int) -> bool:
        """Whether runs of up to `longest` tokens can be stepped over the prompt's cache itself (see
        `choice_items`): it holds n positions and, once given room, every layer has it in one layout."""
        if not all(layer.get_seq_length() == n for layer in cache.layers):
            return False
        for layer in cache.layers:
            layer.make_room(longest)
        room = self._lean_step._c_room(cache, longest)
        return room is not None and room[0] == n

    @staticmethod
    def choices_done(n: int, cache) -> None:
        """The prompt's cache back to its n positions after a step of `choice_items` over it."""
        for layer in cache.layers:
            layer.filled(n)

    @torch.inference_mode()
    def score_choices(self, n: int, cache, next_logits: torch.Tensor, choices: Sequence[Sequence[int]]) -> list[float]:
        """Log-likelihood of each choice (token ids) as the continuation of an n-token prompt.

        `cache` holds the prompt's positions and `next_logits` its last logits (a prefill's `extra`);
        the cache is consumed. On the lean step (a llama / qwen2 model over kvmemory's reserved cache)
        the choices' tokens are runs stepped after the prompt's n positions (`choice_runs`: choices that
        start alike share rows): where rows share steps (batched_step.why_not), all runs in one shared step
        after the prompt's K/V (`choice_items`); else one run after another over the prompt's cache. Its
        views then go back to its n positions. Either way a choice's score depends on nothing
        but the prompt's cache, its own tokens and the run that holds them (the same bits both ways;
        a choice no other one extends or starts like is its own run).
        Elsewhere one batched forward scores every choice: the cache is repeated per choice and the
        choices are right-padded, which causal attention keeps out of every scored position (the scores
        then depend on the set of choices too). Deterministic under the profile either way, whether the
        prefix was grafted or recomputed (the same cache).
        """
        scores = self.first_choice_scores(next_logits, choices)
        T = max(len(c) for c in choices) - 1
        if T == 0:
            return scores
        if self.choices_in_steps(cache):
            # the choices' runs in one shared step after the prompt's K/V (each run's logits are the bits of
            # its step alone: batched_step.py, choice_items), or one run after another over the prompt's
            # cache; its views then back to n positions
            runs = choice_runs(choices)
            stepper = self._choice_stepper()
            if stepper.shared and len(runs) > 1:
                outs = stepper.step(self.choice_items(n, cache, choices))
                self.choices_done(n, cache)
            else:
                outs = []
                for run in runs:
                    outs.append(self._step(_run_ids(run, self.device), n, cache))
                    for layer in cache.layers:
                        layer.filled(n)
            add_choice_logits(scores, choices, outs)
            return scores
        B = len(choices)
        ids = torch.tensor([list(map(int, c[:-1])) + [0] * (T + 1 - len(c)) for c in choices], device=self.device)
        pos = torch.arange(n, n + T, device=self.device).unsqueeze(0).expand(B, -1)
        cache.batch_repeat_interleave(B)
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._cache_kwarg: cache})
        logp = out.logits.float().log_softmax(-1)
        for b, c in enumerate(choices):
            scores[b] += float(sum(logp[b, t - 1, int(c[t])] for t in range(1, len(c))))
        return scores


def multi_token(choices: Sequence[Sequence[int]]) -> list[int]:
    """The indices of the choices of more than one token (those scored past their first token)."""
    return [b for b, c in enumerate(choices) if len(c) > 1]


def choice_runs(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The token runs stepped after the prompt to score `choices` past their first tokens: each
    multi-token choice's tokens but the last, less every run that another one starts with (in the order
    the choices first need them). Choices that share their first tokens share those rows: SmolLM2's
    numbers all start with ' ', and ' 3.', ' 32.', ' 37.' need the runs ' 32' and ' 37' only (10 numbers:
    ~17 rows in ~6 runs instead of ~25 in 10)."""
    wanted = list(dict.fromkeys(tuple(choices[b][:-1]) for b in multi_token(choices)))
    return [r for r in wanted if not any(len(o) > len(r) and o[:len(r)] == r for o in wanted)]


def _run_of(choice: Sequence[int], runs: Sequence[tuple[int, ...]]) -> int:
    """The index of the first run of `choice_runs` that starts with `choice`'s tokens but the last."""
    head = tuple(choice[:-1])
    return next(i for i, r in enumerate(runs) if r[:len(head)] == head)


def _run_ids(run: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([list(run)], device=device)


def add_choice_logits(scores: list[float], choices: Sequence[Sequence[int]], outs: Sequence[torch.Tensor]) -> None:
    """Add to each multi-token choice's score (`first_choice_scores`) its later tokens' log-probabilities,
    from the logits of the run that holds its tokens (`outs`, in `choice_runs` order). The runs' logits
    depend on the runs, so a choice's score on the set of runs its choices need: the same set, the same
    bits, whichever way the runs were stepped (one shared step, one after another, or beside other rows)."""
    runs = choice_runs(choices)
    logps = [logits.float().log_softmax(-1) for logits in outs]
    for b in multi_token(choices):
        c, logp = choices[b], logps[_run_of(choices[b], runs)]
        scores[b] += float(sum(logp[t - 1, int(c[t])] for t in range(1, len(c))))


def _choose(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    """Pick the next token: greedy argmax, or seeded sampling in float32 on the CPU (repeatable)."""
    if sampling.greedy:
        return int(logits.argmax())
    x = logits.detach().float().cpu() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(x, min(sampling.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop = cum - sorted_p > sampling.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))
