"""Static-shape grid and decode steps, captured in CUDA graphs on a GPU: the runner's step modes.

Why: on a GPU a forward step of the canonical runner cost 36-70 ms whatever its size (an H200, issue 39:
16,285 kernel launches for 10 chunks, the GPU busy 41 ms of 528); the CPU dispatching thousands of small
kernels from Python is the step. A CUDA graph replays a captured sequence of kernels with one launch, but
only over fixed shapes and fixed addresses. The chunk grid already fixes the queries (C rows; one row for
a decode step); what grows is the number of keys. Here every step has static shapes:

- one cache kept by the runner (per layer K and V `[1, H_kv, capacity, D]`, views of one tensor
  `[layers, 2, H_kv, capacity, D]` when every layer has the same shape: the layout `graft.py` fills in
  place, so a graft lands where the steps read it), written with `index_copy_` at positions held in a
  device tensor. Every layer keeps every position, sliding-window layers included (their window is a
  mask here), so a graft restores them whole;
- a partial chunk (a prompt's last, or a segment's at a cut: runner.py) is padded to C rows with token 0 at
  the positions that follow; only the first T rows' logits are returned. The pad rows' K/V land at the
  positions after the chunk, which the next step (a chunk or a decode step) overwrites before it reads
  them and which are masked until then;
- attention reads a key-length bucket: keys [0, B), B the smallest C * 2^k that holds the step's last
  position (at most the capacity), under a mask computed on the device from the positions (causal, and
  each sliding layer's window);
- step modes (`STEP_MODES`, the profile's `step_mode`): "dynamic" is the runner's own path (cache.py,
  shapes that grow; the CPU default, unchanged); "static" runs this module's steps eagerly (the CPU tests
  run it); "cuda-graph" captures one graph per (rows, bucket) the first time it is needed and replays it.

Why buckets, against the two other static designs:
- one graph per chunk index (attention over exactly the keys needed): L/C graphs for a prefill and one
  per position for decoding, 512 + 32k whole-forward captures at 32k: capture time and memory unbounded;
- attention over the whole capacity with a mask (transformers' StaticCache): one graph per kind, but a
  2k prompt in a 32k cache attends over 32k keys at every step, and every decode step reads the whole
  cache;
- power-of-two buckets: log2(capacity / C) + 1 graphs per kind (10 at 32k); a step reads at most twice
  the keys it needs (a prefill from scratch of a power of two about 1.3x the causal minimum), and a
  graft's tail step at L = 2^k reads exactly L keys.

Why explicit graphs over static buffers rather than `torch.compile(mode="reduce-overhead")` (what
transformers' generation uses with its StaticCache): compiling generates other kernels (Inductor fuses
the norms, RoPE and activations into Triton kernels whose arithmetic differs from the eager ops', and
changes with the compiler's version and autotuning), recompiles behind guards, and its CUDA-graph trees
decide when to capture; here the kernels are the eager step's, captured as they run, and when each graph
is captured is the module's own decision.

Exactness (graft == recompute under one profile). A block, a graft's steps and a recompute's steps are
all computed here, under the same `step_mode` (a profile field): a graft and a recompute run the same
step (the same graph, chosen by the chunk's position alone) over the same input bytes. Positions < start
hold the grafted blocks, which are the bytes the recompute wrote there; every position >= start is zeroed
when a forward begins (what an earlier forward left there would differ between the two runs, and a
masked key contributes an exact 0 only where its value is finite) and is then written by the same steps
in the same order; the pad rows read and write only what both runs hold alike. Whether a captured graph
gives the eager static step's bits is measured (tests/test_static_step.py on a GPU,
scripts/gpu_check.py), not relied on: "static" and "cuda-graph" are two profiles. When a capture fails
while the engine opens, `step="auto"` takes "static" for the engine's life and says so (a warning and
`StaticGrid.fallback`); asking for "cuda-graph" raises `GraphCaptureError`, and so does a later capture
that fails: a run never switches mode silently.

The K/V write: `index_copy_` of T rows at T distinct positions. Under torch's deterministic mode CUDA
routes it through a sort-based `index_put_` (a sort and allocations per layer, which may not capture);
each destination is written exactly once, so the plain kernel is deterministic too, and the write runs it
with the flag lifted for that one call on CUDA.

Capacity: grows by doubling as forwards need it (the graphs captured over the old buffers are dropped
and captured again when needed). The steps' results do not depend on it (only the heads' stride
changes: cache.py's note; tests/test_static_step.py checks it).
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from kvmemory.errors import GraphCaptureError, InvalidInput, UnsupportedArchitecture

log = logging.getLogger(__name__)

STEP_MODES = ("dynamic", "static", "cuda-graph")
# What a step's attention mask looks like for each mask function transformers pairs with an attention
# implementation: booleans (sdpa and kvmemory's, which register sdpa_mask) or an additive float mask (eager).
_BOOL, _ADDITIVE = "bool", "additive"


def resolve_step_mode(requested: str, device: torch.device) -> str:
    """The step mode to open with: "auto" is "cuda-graph" on a GPU and "dynamic" on the CPU."""
    if requested == "auto":
        return "cuda-graph" if device.type == "cuda" else "dynamic"
    if requested not in STEP_MODES:
        raise InvalidInput(f"step must be 'auto' or one of {', '.join(STEP_MODES)}, not {requested!r}")
    if requested == "cuda-graph" and device.type != "cuda":
        raise InvalidInput(f"step='cuda-graph' needs a CUDA device; the model is on {device.type!r} "
                           "(step='static' runs the same static shapes eagerly)")
    return requested


def _mask_kind(attn_implementation: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    fn = ALL_MASK_ATTENTION_FUNCTIONS[attn_implementation] if attn_implementation in ALL_MASK_ATTENTION_FUNCTIONS \
        else None
    if fn is sdpa_mask:
        return _BOOL
    if fn is eager_mask:
        return _ADDITIVE
    raise UnsupportedArchitecture(f"the static step builds sdpa-style or eager masks; attention "
                                  f"{attn_implementation!r} takes another kind (use step='dynamic')")


class _StepCache:
    """What the model's attention layers call `update` on during a static step: each layer's K/V are
    written at the step's positions and the bucket's keys are handed back."""

    def __init__(self, grid: "StaticGrid"):
        self.grid = grid

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.grid._write(layer_idx, key_states, value_states)


class StaticGrid:
    """The runner's static steps over its own cache; also the engine's room (`take` / `give` / `clear`,
    as cache.Room), so a graft reads straight into the buffers the steps read."""

    def __init__(self, model: torch.nn.Module, chunk: int, kv_dtype: torch.dtype, windows: list[int | None],
                 max_positions: int, cache_kwarg: str, graphs: bool, fallback_ok: bool = False):
        """`windows`: per cache layer its sliding window, None for full attention (runner.sliding_windows
        before the runner makes them all None). `graphs`: capture CUDA graphs (a probe capture runs now:
        where it fails, `fallback_ok` keeps the static steps eagerly, else GraphCaptureError)."""
        cfg = model.config.get_text_config(decoder=True)
        self.model = model
        self.C = int(chunk)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype
        self.windows = list(windows)
        self.cache_kwarg = cache_kwarg
        self.mask_kind = _mask_kind(str(getattr(model.config, "_attn_implementation", None)))
        self.mask_keys = self._mask_keys(cfg)
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv_shape = (heads, head_dim)  # every layer's, checked on each write
        # The last chunk of a prompt of max_positions tokens is padded up to the grid.
        self.limit = math.ceil(int(max_positions) / self.C) * self.C
        self.capacity = 0
        self.whole: torch.Tensor | None = None  # [layers, 2, H_kv, capacity, D]
        self.keys: list[torch.Tensor] = []  # per layer [1, H_kv, capacity, D] (views of `whole`)
        self.values: list[torch.Tensor] = []
        self.dirty = 0  # every position >= dirty holds zeros
        self.kinds = sorted({self.C, 1})
        self.ids = {k: torch.zeros(1, k, dtype=torch.long, device=self.device) for k in self.kinds}
        self.pos = {k: torch.zeros(1, k, dtype=torch.long, device=self.device) for k in self.kinds}
        self._base = {k: torch.arange(k, dtype=torch.long, device=self.device).unsqueeze(0) for k in self.kinds}
        self._kv = _StepCache(self)
        self._bucket = 0
        self._positions: torch.Tensor | None = None
        self.graphs_on = bool(graphs)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.captures = 0  # graphs captured over the engine's life (captured again after a growth)
        self._pool = None
        self._stream = None
        self.fallback: str | None = None  # why "cuda-graph" was asked and "static" runs
        self.probe_equal: bool | None = None  # at open: a captured step's logits equal the eager one's
        if self.graphs_on:
            self._probe(fallback_ok)

    @property
    def mode(self) -> str:
        return "cuda-graph" if self.graphs_on else "static"

    def _mask_keys(self, cfg) -> list | None:
        """How the model takes its masks: None (one 4D mask for every layer: all layers alike), or per
        layer type ("full_attention", "sliding_attention") the window of its layers (a dict of masks)."""
        if len(set(self.windows)) == 1:
            return None
        types = getattr(cfg, "layer_types", None)
        if not types or len(types) != len(self.windows):
            raise UnsupportedArchitecture("layers with different windows but no `layer_types` in the config: "
                                          "the static step cannot tell the model which mask is whose")
        by_type: dict[str, int | None] = {}
        for t, w in zip(types, self.windows):
            if by_type.setdefault(t, w) != w:
                raise UnsupportedArchitecture(f"layers of type {t!r} have different windows")
        return sorted(by_type.items(), key=lambda kv: kv[0])

    # ------------------------------------------------------------------ buffers
    def bucket_for(self, end: int) -> int:
        """The keys a step whose last position is end - 1 attends: the smallest C * 2^k >= end, at most
        the capacity limit. A function of `end` alone: a graft and a recompute pick the same one."""
        if end > self.limit:
            raise InvalidInput(f"position {end - 1} is past the static cache's {self.limit} positions "
                               "(max_positions)")
        b = self.C
        while b < end:
            b *= 2
        return min(b, self.limit)

    def ensure(self, need: int) -> None:
        """Room for `need` positions (a bucket size): the buffers grow, zeroed, and the graphs captured
        over the old ones are dropped. What the old buffers held is not kept (begin copies a graft's)."""
        if need <= self.capacity:
            return
        cap = self.bucket_for(need)
        self.graphs.clear()  # they read and write the old buffers' addresses
        self.whole, self.keys, self.values = None, [], []
        layers = len(self.windows)
        H, D = self.kv_shape
        # torch.zeros, never empty: positions not yet written must be the same bytes in every run. Normal
        # tensors, not inference ones (even when a forward grows them): a graft writes them outside it.
        with torch.inference_mode(False), torch.no_grad():
            self.whole = torch.zeros(layers, 2, H, cap, D, dtype=self.kv_dtype, device=self.device)
        self.keys = [self.whole[i, 0].unsqueeze(0) for i in range(layers)]
        self.values = [self.whole[i, 1].unsqueeze(0) for i in range(layers)]
        self.capacity, self.dirty = cap, 0

    def _zero(self, start: int, end: int) -> None:
        if end > start:
            self.whole[:, :, :, start:end].zero_()

    # ------------------------------------------------------------------ the room (graft.py)
    def take(self, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device):
        """The cache tensor for a graft of (layers, 2, H, S, D) with S positions (cache.Room.take), grown
        to hold them; None when the blocks' layout is not this cache's (the graft allocates, `begin`
        copies)."""
        layers, two, H, S, D = shape
        if dtype != self.kv_dtype or torch.device(device) != self.device or two != 2 \
                or layers != len(self.windows) or (H, D) != self.kv_shape:
            return None
        self.ensure(S)
        self.dirty = max(self.dirty, S)  # the graft writes up to S positions: zeroed again past the graft point
        return self.whole

    def give(self, cache) -> None:
        """Nothing to keep: the buffers are the runner's (cache.Room.give)."""

    def clear(self) -> None:
        """Free the buffers and the graphs (made again when needed)."""
        self.graphs.clear()
        self.whole, self.keys, self.values, self.capacity, self.dirty = None, [], [], 0, 0

    # ------------------------------------------------------------------ a forward
    def begin(self, cache, start: int, n: int, total: int):
        """Prepare a forward of an n-token prompt computing from `start` (positions < start are in
        `cache`, a graft's, or in these buffers already), `total` positions in all with the decoded
        tokens. Returns the transformers cache viewing positions [0, start)."""
        # + C: a chunk that starts at a cut (runner.chunk_spans) is padded to C rows past the grid
        need = max(math.ceil(n / self.C) * self.C + self.C, total, 1)
        self.ensure(need)
        if start:
            self._adopt(cache, start)
        self._zero(start, self.dirty)
        self.dirty = start
        return self.view(start)

    def _adopt(self, cache, start: int) -> None:
        """Make positions [0, start) of every layer hold `cache`'s (a copy, unless they are already ours)."""
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.keys):
            raise InvalidInput("a forward that starts after position 0 needs the cache of the positions before")
        from transformers.cache_utils import DynamicSlidingWindowLayer

        for i, layer in enumerate(layers):
            for src, dst in ((layer.keys, self.keys[i]), (layer.values, self.values[i])):
                held = src.shape[-2]
                # a sliding-window layer holds the last `held` of its `cumulative_length` positions
                offset = int(layer.cumulative_length) - held if isinstance(layer, DynamicSlidingWindowLayer) else 0
                if offset != 0 or held < start:
                    raise InvalidInput(f"layer {i} of the given cache holds positions [{offset}, {offset + held}), "
                                       f"not [0, {start}): the static step needs every position of every layer")
                if src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride():
                    continue  # grafted into these buffers (take)
                dst[:, :, :start].copy_(src[:, :, :start])

    def view(self, end: int):
        """A transformers cache over positions [0, end) of the buffers (no copy): what on_chunk's block
        capture and `score_choices` read. Its layers hold views exactly `end` long, so anything that
        appends to it allocates (cache.ReservedLayer) instead of writing into these buffers."""
        from kvmemory.engine.cache import ReservedLayer, new_cache

        cache = new_cache(self.model, 0, self.kv_dtype)
        for layer, k, v, w in zip(cache.layers, self.keys, self.values, self.windows):
            if isinstance(layer, ReservedLayer):
                layer.adopt(k[:, :, :end], v[:, :, :end], end)
            else:  # transformers' sliding-window layer: the last window - 1 positions
                keep = min(end, w - 1)
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k[:, :, end - keep : end], v[:, :, end - keep : end]
                layer.cumulative_length = end
        return cache

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: int, rows: int | None = None) -> torch.Tensor:
        """`ids` [1, T] at positions start..start+T-1 (T == 1, or a chunk of at most C rows starting on the
        grid or at a cut); returns the logits [T, V] (the last `rows` of them), as runner._step does."""
        T = int(ids.shape[1])
        kind = 1 if T == 1 else self.C
        if T > kind:
            raise InvalidInput(f"a static step takes one token or a chunk of at most C={self.C} (T={T}, start={start})")
        end = start + kind
        if end > self.capacity:
            raise InvalidInput(f"positions up to {end} in a static cache of {self.capacity} (begin() first)")
        bucket = self.bucket_for(end)
        static_ids, pos = self.ids[kind], self.pos[kind]
        static_ids[:, :T].copy_(ids)
        if T < kind:
            static_ids[:, T:].zero_()  # the pad token
        torch.add(self._base[kind], start, out=pos)
        self.dirty = max(self.dirty, end)
        if self.graphs_on:
            graph = self.graphs.get((kind, bucket))
            if graph is None:
                graph = self.graphs[(kind, bucket)] = self._capture(kind, bucket)
            graph[0].replay()
            out = graph[1]
        else:
            out = self._forward(kind, bucket)
        logits = out[0, :T]
        if rows is not None:
            logits = logits[T - rows :]
        # A graph's output is overwritten by its next replay (and its memory is shared with the other
        # graphs' intermediates): the caller gets its own copy.
        return logits.clone() if self.graphs_on else logits

    def _forward(self, kind: int, bucket: int) -> torch.Tensor:
        """The model over the static inputs of `kind` rows with `bucket` keys; logits [1, kind, V]. Only
        device ops on fixed shapes and addresses: what a graph captures."""
        pos = self.pos[kind]
        self._bucket, self._positions = bucket, pos[0]
        keys = torch.arange(bucket, device=self.device)
        q = pos[0].unsqueeze(1)  # [kind, 1]
        causal = keys.unsqueeze(0) <= q  # [kind, bucket]
        masks = {}
        for w in set(self.windows):
            allowed = causal if w is None else causal & (keys.unsqueeze(0) > q - w)
            masks[w] = self._format(allowed)
        if self.mask_keys is None:
            mask = masks[self.windows[0]]
        else:
            mask = {t: masks[w] for t, w in self.mask_keys}
        out = self.model(input_ids=self.ids[kind], position_ids=pos, attention_mask=mask, use_cache=True,
                         **{self.cache_kwarg: self._kv})
        return out.logits

    def _format(self, allowed: torch.Tensor) -> torch.Tensor:
        """[kind, bucket] booleans as the attention implementation takes its 4D mask [1, 1, kind, bucket]."""
        allowed = allowed[None, None]
        if self.mask_kind == _BOOL:
            return allowed
        # transformers' eager_mask: 0 where attended, the dtype's minimum elsewhere
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~allowed, torch.finfo(self.dtype).min)

    def _write(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor):
        k_buf, v_buf = self.keys[i], self.values[i]
        if key_states.shape[1] != k_buf.shape[1] or key_states.shape[3] != k_buf.shape[3] \
                or value_states.shape[1:] != key_states.shape[1:] or key_states.shape[0] != 1:
            raise UnsupportedArchitecture(
                f"layer {i} computes K/V of shape {tuple(key_states.shape)} / {tuple(value_states.shape)}; the "
                f"static cache holds [1, {k_buf.shape[1]}, ., {k_buf.shape[3]}] for every layer (use step='dynamic')")
        with self._unique_writes():
            # rounded to the cache's dtype as cache.ReservedLayer's copy_ rounds (to nearest even)
            k_buf.index_copy_(2, self._positions, key_states.to(k_buf.dtype))
            v_buf.index_copy_(2, self._positions, value_states.to(v_buf.dtype))
        return k_buf[:, :, : self._bucket], v_buf[:, :, : self._bucket]

    @contextlib.contextmanager
    def _unique_writes(self):
        """On CUDA, the plain `index_copy_` kernel (see the module docstring: every position is written
        once, so it is deterministic) rather than the sort-based one deterministic mode picks."""
        if self.device.type != "cuda" or not torch.are_deterministic_algorithms_enabled():
            yield
            return
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(False)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(True, warn_only=warn)

    # ------------------------------------------------------------------ CUDA graphs
    def _capture(self, kind: int, bucket: int) -> tuple[object, torch.Tensor]:
        """Capture the step of `kind` rows over `bucket` keys. The warm-up runs the step itself eagerly on
        the static inputs already set: it writes the K/V of the step's own positions, which the replay
        then writes again from the same inputs, so capturing in the middle of a forward changes nothing."""
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
                self._pool = torch.cuda.graph_pool_handle()
            side = self._stream
            current = torch.cuda.current_stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._forward(kind, bucket)  # warm-up: lazy initialisations (cuBLAS handles, workspaces)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a graft's reader threads may use CUDA meanwhile (other streams, not captured)
            with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                out = self._forward(kind, bucket)
        except Exception as exc:  # noqa: BLE001 - any capture failure is reported as one typed error
            raise GraphCaptureError(f"capturing the static step ({kind} rows, {bucket} keys) in a CUDA graph "
                                    f"failed: {type(exc).__name__}: {exc}") from exc
        self.captures += 1
        return graph, out

    @torch.inference_mode()
    def _probe(self, fallback_ok: bool) -> None:
        """Capture the smallest grid and decode steps now, so a device or model that cannot be captured is
        known when the engine opens (and the profile records what runs), and compare a captured step's
        logits with the eager one's (`probe_equal`, a diagnostic). Leaves the buffers zeroed."""
        try:
            self.ensure(min(2 * self.C, self.limit))
            equal = True
            for kind in self.kinds:
                bucket = self.bucket_for(kind)
                self.ids[kind].zero_()
                torch.add(self._base[kind], 0, out=self.pos[kind])
                eager = self._forward(kind, bucket).clone()
                graph, out = self.graphs[(kind, bucket)] = self._capture(kind, bucket)
                graph.replay()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                equal = equal and torch.equal(out, eager)
            self.probe_equal = bool(equal)
        except GraphCaptureError as exc:
            if not fallback_ok:
                raise
            self.graphs.clear()
            self.graphs_on = False
            self.fallback = str(exc)
            log.warning("kvmemory: %s; this engine runs the static steps without CUDA graphs (step_mode "
                        "'static', recorded in its profile)", exc)
        finally:
            self.dirty = self.capacity
            if self.whole is not None:
                self._zero(0, self.capacity)
            self.dirty = 0
