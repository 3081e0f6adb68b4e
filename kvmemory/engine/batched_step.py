"""The batched step: rows of several sequences, each at its own positions over its own KV cache, in one
forward step, every row's logits the same bits as the same sequence's step run alone.

A step carries items (ids [1, T], position, cache, rows): a decode row (T = 1) of a generating sequence
or a prefill chunk of another (the grid's chunk: runner.chunk_spans), grafted or not, each over its own
cache (cache.py's `ReservedLayer`s). Where the step is shared (`why_not` is None), everything that works
row by row runs once over the rows of all items concatenated, and everything that depends on a
sequence's own positions or keys runs per item with exactly the call its own step makes:

- shared: the embedding (a lookup per row), the residual adds + RMS norms (decode_ops' kernel: one sum
  per row, in an order fixed by the row alone), the GGUF-block linears (quantized_linear: "each output
  is one fixed sum, k ascending: a row's bytes depend on nothing else, not the rows beside it") and the
  lm_head (a GGUF-block linear too);
- per item: the causal mask, the RoPE tables (cos / sin of its positions: torch's vectorised and
  scalar transcendental loops round differently, and which elements take which loop depends on the
  tensor's size), RoPE + the K/V write into its cache, and attention over its own keys
  (few_query_attention, or SDPA for a long chunk) with the very arguments its own step passes;
- SiLU(gate) * up: an elementwise torch op whose vectorised / scalar split (and, over 32,768 elements,
  thread split) depends on the tensor's size, so it runs per prefill chunk (the shape of that chunk's
  own step) and over groups of decode rows small enough to run on one thread (below torch's grain
  size, each row is one inner loop from its first element: the loop a one-row step runs).

The lean step's C layer loop (llama_step.py, `kvm_decode_layer`) makes the same calls with the same
arguments as its Python path (tests/test_llama_step.py), so a row computed here equals the one that
loop computes for a decode step alone. A step whose every sequence takes that loop in its own step (a
decode row, or a chunk of few enough rows: a short prefill chunk, an answer choice's run) makes its
layers' calls the same way, one C call a layer (`kvm_decode_rows_layer`: a 2 / 4 / 8-row decode step
of the embedded model 28 / 21 / 23 % faster on 2 Zen 1 cores), the rows' attention calls spread over the
threads where their caches are apart (each row's call the same whichever thread makes it). Rows that
need no view of their K/V after the step only mark their layers filled (cache.py `mark_filled`: ~10 us
saved a layer and row). tests/test_batched_step.py asserts it with
`torch.equal` on every row's logits, for batches of 1 to 16 sequences, grafted and cold, short and long.

Where the step cannot be shared exactly (`why_not` says why: a model the lean step does not compute,
linears other than GGUF blocks, whose GEMM changes its reduction with the number of rows (torch's and
oneDNN's on the CPU, cuBLAS on a GPU), the norm kernel not giving torch's bits, or the static step modes,
whose one cache holds one sequence), the items run one after the other through the runner's own step:
the same answers, no sharing. Nothing is ever batched inexactly.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmemory.kernels import decode_ops, few_query_attention
from kvmemory.models import attention, gguf_linear

GRAIN = 32768  # torch's at::internal::GRAIN_SIZE: an elementwise op below it runs on one thread
ONE_THREAD_KEYS = 4096  # a decode row over fewer cached keys runs its attention on one thread (rows side by side)


PLAN_ATTR = "_kvmemory_row_plan"  # where a sequence's decode-row plan is kept: on its cache, for the cache's life


@dataclass(slots=True)
class _RowPlan:
    """A decode row's C arguments that stay the same from step to step (the layers' K/V buffers and their
    addresses, the query and rope scratch), kept on the sequence's cache: working them out again each step
    (a walk over every layer, four pointer arrays) cost about as much as the row's attention. `writes`: each
    layer's count of view changes (cache.ReservedLayer.writes) when the plan was built; the plan's own
    writes only mark the layers filled, so any other write to the cache changes a count, and the plan is
    then built again."""

    rooms: list  # each layer's (ReservedLayer, K buffer, V buffer)
    at: int  # the next position to write
    capacity: int  # the buffers' positions
    head_stride: int
    kv_dtype: torch.dtype
    writes: list
    q: torch.Tensor
    scratch: torch.Tensor
    k_base: list
    v_base: list
    k_read: ctypes.Array
    v_read: ctypes.Array
    k_write: ctypes.Array
    v_write: ctypes.Array

    @property
    def room(self) -> tuple:
        """What `LlamaStep._c_room` gives for one more token."""
        return self.at, self.head_stride, self.kv_dtype, self.rooms


@dataclass(slots=True)
class StepItem:
    """One sequence's part of a step: `ids` [1, T] at positions position..position+T-1 over `cache`
    (holding positions < position); `rows`: the logits of its last `rows` positions (None: all T)."""

    ids: torch.Tensor
    position: int
    cache: object
    rows: int | None = None


def _row_exact(linear) -> bool:
    return isinstance(linear, gguf_linear.GGUFLinear) and linear._fn is not None


def why_not(runner) -> str | None:
    """None where the runner's steps can share rows exactly (see the module docstring), else why not."""
    if runner.static is not None:
        return f"step mode {runner.step_mode!r} keeps one cache for one sequence"
    lean = runner._lean_step
    if lean is None:
        return "the model is not one the lean llama step computes (llama / qwen2 with kvmemory's CPU attention)"
    if lean.kernel is None:
        return "the decode-step norm kernel does not give this model's norm bits here"
    for i, layer in enumerate(lean.layers):
        a, mlp = layer.self_attn, layer.mlp
        qkv = [lean.qkv[i]] if lean.qkv[i] is not None else [a.q_proj, a.k_proj, a.v_proj]
        gu = [lean.gate_up[i]] if lean.gate_up[i] is not None else [mlp.gate_proj, mlp.up_proj]
        if not all(_row_exact(x) for x in qkv + gu + [a.o_proj, mlp.down_proj]):
            return ("its linears are not GGUF-block linears with the kernel loaded (a GEMM's reduction "
                    "order changes with the number of rows)")
    if not _row_exact(lean.model.lm_head):
        return "its lm_head is not a GGUF-block linear with the kernel loaded"
    return None


def profile_status() -> dict:
    """What `kvmemory kernels` says about batching here, without a model: which profiles share a step's
    rows (exactly) and which step their sequences one at a time."""
    from kvmemory.kernels import quantized_linear

    q, d = quantized_linear.load() is not None, decode_ops.load() is not None
    shared = q and d
    summary = ("rows of several sequences share each step (bit-identical to each alone) for llama / qwen2 GGUF "
               "models on the CPU" if shared else
               "no profile shares steps here (" + ", ".join(
                   n for n, ok in (("the GGUF-block linear kernel", q), ("the decode-step kernel", d)) if not ok)
               + " not running): every sequence is computed alone within each step")
    summary += ("; other profiles (torch / oneDNN / GPU GEMMs, whose reduction changes with the row count, other "
                "architectures, static steps) compute each sequence alone within a step: the same answers, "
                "no sharing")
    return {"shared_for_gguf_llama": shared, "qlinear_kernel": q, "decode_kernel": d, "summary": summary}


class BatchedStep:
    """Steps of several sequences over one runner: shared where `why_not(runner)` is None (`shared`),
    else each item through the runner's own step in turn."""

    def __init__(self, runner):
        self.runner = runner
        self.why_not = why_not(runner)
        self.shared = self.why_not is None
        self.lean = runner._lean_step if self.shared else None

    @torch.inference_mode()
    def step(self, items: Sequence[StepItem]) -> list[torch.Tensor]:
        """Each item's logits ([rows or T, V]), as `runner._step(ids, position, cache, rows)` gives them."""
        if not items:
            return []
        if not self.shared or len(items) == 1:
            return [self.runner._step(it.ids, it.position, it.cache, rows=it.rows) for it in items]
        return self._shared(items)

    def _groups(self, Ts: list[int], ffn: int) -> list[tuple[int, int]]:
        """Row ranges over which SiLU(gate) * up runs in one call: each prefill chunk alone; consecutive
        decode rows together while the group stays below torch's grain (one thread, row by row)."""
        groups, at, i = [], 0, 0
        per = max(1, (GRAIN - 1) // ffn)
        while i < len(Ts):
            if Ts[i] != 1:
                groups.append((at, at + Ts[i]))
                at += Ts[i]
                i += 1
                continue
            j = i
            while j < len(Ts) and Ts[j] == 1 and j - i < per:
                j += 1
            groups.append((at, at + j - i))
            at += j - i
            i = j
        return groups

    def _row_plan(self, cache, position: int) -> _RowPlan | None:
        """The decode-row arguments kept on `cache` since its last step, where nothing has touched it since
        (no layer's views changed but by its steps, and it has room for one more position);
        else built again from `_c_room` (None: no room in one kind of buffer)."""
        plan = getattr(cache, PLAN_ATTR, None)
        if (plan is not None and plan.at == position and position < plan.capacity
                and all(cache.layers[i] is layer and layer.writes == w
                        for i, ((layer, _, _), w) in enumerate(zip(plan.rooms, plan.writes)))):
            return plan
        room = self.lean._c_room(cache, 1)
        if room is None or room[0] != position:
            return None
        at, head_stride, kv_dtype, rooms = room
        cfg = self.lean.cfg
        L = len(rooms)
        k_base = [k.data_ptr() for _, k, _ in rooms]
        v_base = [v.data_ptr() for _, _, v in rooms]
        writes = [layer.writes for layer, _, _ in rooms]
        plan = _RowPlan(rooms, at, rooms[0][1].shape[-2], head_stride, kv_dtype, writes,
                        torch.empty((1, 1, cfg.num_attention_heads, self.lean.head_dim), dtype=torch.float32),
                        torch.empty(cfg.num_key_value_heads * self.lean.head_dim, dtype=torch.float32),
                        k_base, v_base, (ctypes.c_void_p * L)(*k_base), (ctypes.c_void_p * L)(*v_base),
                        (ctypes.c_void_p * L)(), (ctypes.c_void_p * L)())
        setattr(cache, PLAN_ATTR, plan)
        return plan

    def _fast_row(self, row: int, plan: _RowPlan, mask, cos: torch.Tensor, sin: torch.Tensor,
                  threads: int | None) -> tuple[decode_ops.Row, int]:
        """A decode row's arguments for `kvm_decode_rows` (its rope / attention calls of every layer, as
        kvm_decode_layer makes them: csrc/decode_ops.cpp; `row`: its index among the step's rows), and
        its cache's K/V code (attention.kv_code; the step's rows share it). The buffers they point into are
        kept alive (the plan's by its cache)."""
        at, D = plan.at, self.lean.head_dim
        bf16 = attention.kv_code(self.lean.layers[0].self_attn, plan.kv_dtype)  # 0 float32, else bfloat16
        offset = at * D * (2 if bf16 else 4)
        # the keys start at the buffers' first position (k_read): the attention reads [0, at + 1)
        for i, (k, v) in enumerate(zip(plan.k_base, plan.v_base)):
            plan.k_write[i], plan.v_write[i] = k + offset, v + offset
        self._keep.extend((cos, sin, mask))
        r = decode_ops.Row(row, 1, 0, cos.data_ptr(), sin.data_ptr(), plan.q.data_ptr(), plan.scratch.data_ptr(),
                           ctypes.addressof(plan.k_write), ctypes.addressof(plan.v_write),
                           ctypes.addressof(plan.k_read), ctypes.addressof(plan.v_read),
                           mask.data_ptr() if mask is not None else None, at + 1,
                           mask.stride(2) if mask is not None else 0, threads or torch.get_num_threads(),
                           plan.head_stride)
        return r, bf16

    def _fast_chunk(self, row: int, T: int, room, mask, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[decode_ops.Row, int]:
        """A short chunk's arguments for `kvm_decode_rows` (T rows from `row` at room's position: its RoPE /
        attention calls of every layer as its own step's `kvm_decode_layer` makes them), and its K/V code.
        The caller has checked what `LlamaLeanStep._c_step` needs (room, the mask, few enough rows)."""
        lean = self.lean
        cfg, D = lean.cfg, lean.head_dim
        at, head_stride, kv_dtype, rooms = room
        code = attention.kv_code(lean.layers[0].self_attn, kv_dtype)
        causal, keys = lean._c_attention(T, mask, at)  # as _c_step passes them
        offset = at * D * (2 if code else 4)
        L = len(rooms)
        k_read = (ctypes.c_void_p * L)(*[k.data_ptr() for _, k, _ in rooms])
        v_read = (ctypes.c_void_p * L)(*[v.data_ptr() for _, _, v in rooms])
        k_write = (ctypes.c_void_p * L)(*[p + offset for p in k_read])
        v_write = (ctypes.c_void_p * L)(*[p + offset for p in v_read])
        q = torch.empty((T, cfg.num_attention_heads, D), dtype=torch.float32)
        scratch = torch.empty(cfg.num_key_value_heads * D, dtype=torch.float32)
        self._keep.extend((cos, sin, mask, k_read, v_read, k_write, v_write, q, scratch))
        r = decode_ops.Row(row, T, causal, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), scratch.data_ptr(),
                           ctypes.addressof(k_write), ctypes.addressof(v_write), ctypes.addressof(k_read),
                           ctypes.addressof(v_read), mask.data_ptr() if mask is not None else None, keys,
                           mask.stride(2) if mask is not None else 0, torch.get_num_threads(), head_stride)
        return r, code

    def _rows_layers(self, h: torch.Tensor, rows_c, rows_arg, groups: list[tuple[int, int]]) -> torch.Tensor:
        """The layers of a step whose every sequence's rows take `kvm_decode_rows`, through
        `kvm_decode_rows_layer` (h updated in place): per layer the calls the loop in `_shared` makes, with
        its arguments, in one call; SiLU(gate) * up stays torch's, over the same row groups. Returns the last
        layer's down projection (the delta not yet added to h), as the loop leaves it."""
        lean = self.lean
        cfg = lean.cfg
        R = h.shape[1]
        step = decode_ops.Step(*lean._c_fns, R, cfg.num_attention_heads, cfg.num_key_value_heads, lean.head_dim,
                               cfg.hidden_size, lean.ffn, lean.width, torch.get_num_threads(), 0, 0, 0, 0, R, None,
                               0, lean._c_scale, None, None, h.data_ptr(), None, None)
        fn, rows_ref, n = lean.kernel.kvm_decode_rows_layer, ctypes.byref(rows_c), len(rows_arg)
        return lean._run_c_layers(
            step, lambda i, step_ref, prev, cur, act: fn(step_ref, prev, act, cur, rows_ref, rows_arg, n, i),
            lambda mlp, gate, up: torch.cat([mlp.act_fn(gate[:, s:e]) * up[:, s:e] for s, e in groups], 1))

    def _shared(self, items: Sequence[StepItem]) -> list[torch.Tensor]:
        from transformers.masking_utils import create_causal_mask

        lean = self.lean
        m = lean.model.model
        Ts = [int(it.ids.shape[1]) for it in items]
        bounds, at = [], 0
        for T in Ts:
            bounds.append((at, at + T))
            at += T
        R = at
        self._keep = []  # buffers the C calls write through pointers, held until the step ends
        embeds = m.embed_tokens.forward(torch.cat([it.ids for it in items], 1))  # [1, R, hidden]
        per_item = []
        fewq = lean.cfg._attn_implementation == attention.FEWQ
        # the few-query kernel where the lean step's C loop runs (_c_layers has checked one scaling and causal flag)
        alib = few_query_attention.load() if lean.c_layers is not None else None
        Hq, Hkv = lean.cfg.num_attention_heads, lean.cfg.num_key_value_heads
        for it, (a, b) in zip(items, bounds):
            e = embeds[:, a:b]
            position_ids = torch.arange(it.position, it.position + (b - a), device=e.device).unsqueeze(0)
            mask = create_causal_mask(config=lean.cfg, inputs_embeds=e, attention_mask=None, cache=it.cache,
                                      position_ids=position_ids)
            cos, sin = m.rotary_emb(e, position_ids=position_ids)
            # where every layer has room for these rows (as the lean step's C loop finds it), RoPE writes
            # K/V there directly (_rope_cache's own path, its per-layer checks done once per step)
            plan = self._row_plan(it.cache, it.position) if b - a == 1 else None
            room = plan.room if plan is not None else lean._c_room(it.cache, b - a) if b - a > 1 else None
            if room is not None and room[0] != it.position:
                room = None
            # a decode row over few keys: its attention on one thread (the same bytes, no wait for a core)
            extra = {"threads": 1} if fewq and b - a == 1 and it.position < ONE_THREAD_KEYS else {}
            cos, sin = cos.contiguous(), sin.contiguous()
            # rows with room and the few-query kernel, as its own step's C loop takes them (LlamaLeanStep._c_takes:
            # forward: few enough rows, the mask's rows prefixes): both calls straight to C with the
            # arguments kvm_decode_layer passes them, a decode row's pointers kept on its cache (_RowPlan)
            fast = None
            if lean._c_takes(b - a, mask, room):
                fast = (self._fast_row(a, plan, mask, cos, sin, extra.get("threads")) if b - a == 1 else
                        self._fast_chunk(a, b - a, room, mask, cos, sin))
            per_item.append((position_ids, mask, cos, sin, room, extra, fast, plan))
        # those sequences' rope / attention calls of a layer in one call (kvm_decode_rows), where they
        # share the K/V dtype (one step's caches: they do)
        fast_rows = [pi[6] for pi in per_item if pi[6] is not None]
        rows_c = rows_arg = None
        if fast_rows and len({f[1] for f in fast_rows}) == 1:
            a0 = lean.layers[0].self_attn
            rows_c = decode_ops.Rows(ctypes.cast(alib.kvm_fewq_attention, ctypes.c_void_p).value, Hq, Hkv,
                                     lean.head_dim, fast_rows[0][1], a0.scaling, torch.get_num_threads())
            rows_arg = (decode_ops.Row * len(fast_rows))(*[f[0] for f in fast_rows])
            self._keep.extend((rows_c, rows_arg))
        elif fast_rows:  # caches of different layouts: each row through the calls below, as a chunk's
            per_item = [(*pi[:6], None, pi[7]) for pi in per_item]
        all_fast = rows_c is not None and len(fast_rows) == len(items)
        h = embeds.contiguous()
        scratch = torch.empty(h.shape[-1], dtype=torch.float32)
        groups = self._groups(Ts, lean.ffn)
        delta = None
        if all_fast:  # all in C: each layer's calls in one C call (the same calls, the same bits)
            delta = self._rows_layers(h, rows_c, rows_arg, groups)
        for i, layer in enumerate(() if all_fast else lean.layers):
            a_mod, mlp = layer.self_attn, layer.mlp
            x = lean._norm(layer.input_layernorm, h, delta, scratch)
            if lean.qkv[i] is not None:
                qkv = lean.qkv[i].forward(x)
            else:
                qkv = torch.cat([a_mod.q_proj.forward(x), a_mod.k_proj.forward(x), a_mod.v_proj.forward(x)], -1)
            outs = []
            att = torch.empty((1, R, Hq * lean.head_dim), dtype=torch.float32) if alib is not None else None
            if rows_c is not None:
                rc = lean.kernel.kvm_decode_rows(ctypes.byref(rows_c), rows_arg, len(rows_arg), i, qkv.data_ptr(),
                                                 qkv.shape[-1], att.data_ptr())
                if rc:  # refused (never for the shapes _fast_row takes) or out of memory
                    raise ValueError(f"the decode-step kernels refused a decode row ({rc})")
            for it, (a, b), (position_ids, mask, cos, sin, room, extra, fast, _) in zip(items, bounds, per_item):
                if fast is not None:
                    outs.append(att[:, a:b])
                    continue
                if room is not None:
                    at, (layer_kv, kb, vb) = room[0], room[3][i]
                    q = decode_ops.rope_into(lean.kernel, qkv[:, a:b], cos, sin, Hq, Hkv, kb[0, :, at:b - a + at],
                                             vb[0, :, at:b - a + at])
                    k, v = layer_kv.filled(at + b - a)
                else:
                    q, k, v = lean._rope_cache(qkv[:, a:b], cos, sin, it.cache, a_mod.layer_idx)
                out, _ = lean.attend(a_mod, q, k, v, mask, dropout=0.0, scaling=a_mod.scaling,
                                     position_ids=position_ids, use_cache=True, **extra)
                outs.append(out.reshape(1, b - a, -1))
            if all_fast:  # every row's attention is already in place
                delta = a_mod.o_proj.forward(att)
            else:
                delta = a_mod.o_proj.forward(torch.cat(outs, 1).contiguous() if len(outs) > 1 else outs[0].contiguous())
            x = lean._norm(layer.post_attention_layernorm, h, delta, scratch)
            if lean.gate_up[i] is not None:
                gu = lean.gate_up[i].forward(x)
                gate, up = gu[..., : lean.ffn], gu[..., lean.ffn:]
            else:
                gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
            act = torch.cat([mlp.act_fn(gate[:, s:e]) * up[:, s:e] for s, e in groups], 1)
            delta = mlp.down_proj.forward(act)
        for it, (a, b), pi in zip(items, bounds, per_item):
            if pi[6] is None:
                continue
            plan = pi[7]
            if plan is not None:  # a decode row written by C: the layers now hold it (views made when read)
                for layer_kv, _, _ in plan.rooms:
                    layer_kv.mark_filled(it.position + 1)
                plan.at = it.position + 1
            else:  # a chunk written by C
                for layer_kv, _, _ in pi[4][3]:
                    layer_kv.mark_filled(it.position + b - a)
        # the final norm and lm_head over the rows whose logits are wanted, as each item's own step keeps them
        keep = []
        for it, (a, b) in zip(items, bounds):
            r = (b - a) if it.rows is None else min(it.rows, b - a)
            keep.append(r)
        index = torch.tensor([p for (a, b), r in zip(bounds, keep) for p in range(b - r, b)], dtype=torch.long)
        vocab = lean.model.lm_head.out_features
        if index.numel() == 0:
            return [h.new_empty(0, vocab) for _ in items]
        hk = h.index_select(1, index)
        dk = delta.index_select(1, index)
        logits = self.lean.model.lm_head.forward(lean._norm(m.norm, hk, dk, scratch))[0]
        out, at = [], 0
        for r in keep:
            out.append(logits[at : at + r] if r else h.new_empty(0, vocab))
            at += r
        return out


__all__ = ["BatchedStep", "GRAIN", "ONE_THREAD_KEYS", "StepItem", "profile_status", "why_not"]
