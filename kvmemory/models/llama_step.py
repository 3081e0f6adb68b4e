"""A forward step for llama-architecture models with less Python per layer, the same bits as transformers'.

Running one token through `LlamaForCausalLM.forward` costs ~400 module calls and ~900 small torch ops
for the embedded model's 30 layers; with the linears and attention in kvmemory's kernels, that Python
is a third of a decode step, and a sixth of the 16-token step after a graft. `LlamaLeanStep` runs the
same computation for T new tokens (a decode step, the step after a graft, a prefill chunk) with the
modules' own `forward`s called directly (no hooks, no output dataclasses), the q/k/v projections in one
kernel call and gate/up in another (`gguf_linear.fuse`: each output is the same sum, so the same bits),
and, where the decode-step kernel runs (kernels/decode_ops.py), each residual add + RMS norm in one call
and RoPE on q / k with the K/V write into the cache in another; elsewhere the norms are the modules' own
`forward`s and RoPE is transformers' `apply_rotary_pos_emb`. Where every linear is GGUF blocks and the
attention is the few-query kernel, a step of a few tokens (a decode step, the step after a graft) goes
further: each layer's calls up to its gate/up projections are made from C (`kvm_decode_layer`: the same
functions, the same arguments, in the same order) and only SiLU(gate) * up stays in torch, 30 calls a
step instead of ~300.

Same bits, by construction and by test: every value is produced by the same torch ops or kernels,
in the same order, as transformers' forward produces it (elementwise ops round each element alike
whatever the tensor's shape; `tests/test_llama_step.py` asserts the logits and the cache equal
transformers' with `torch.equal`, for one token and for chunks of several). So it changes no result
and no stored byte; it is on the compute path (the profile's `code_sha256`) all the same.

Taken only where it is transformers' own `LlamaForCausalLM` or `Qwen2ForCausalLM` (not a subclass: Qwen2's
layer is llama's with biases on q/k/v, which the projections' own forwards add, and an RMS norm whose
forward is llama's, same source), with a SiLU MLP without bias, full attention in every layer and
kvmemory's CPU attention (models/attention.py); everything else runs transformers' forward. The C layer
loop adds a linear's bias as its forward does (one rounded add per output, after the sum).
"""

from __future__ import annotations

import ctypes
import logging
import time

import torch

from kvmemory.errors import KVMemoryError
from kvmemory.kernels import decode_ops, few_query_attention, quantized_linear
from kvmemory.models import attention, gguf_linear

log = logging.getLogger(__name__)

_ATTENTIONS = (attention.NAME, attention.FEWQ)


def why_not(model: torch.nn.Module) -> str | None:
    """None where `LlamaLeanStep` computes `model`'s forward steps, else why not."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, Qwen2RMSNorm

    cfg = model.config
    if type(model) not in (LlamaForCausalLM, Qwen2ForCausalLM):
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM or Qwen2ForCausalLM"
    if cfg._attn_implementation not in _ATTENTIONS:
        return f"attention {cfg._attn_implementation!r} is not kvmemory's CPU attention"
    if getattr(cfg, "mlp_bias", False) or cfg.hidden_act != "silu":
        return "not the llama MLP (a bias, or an activation other than SiLU)"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
        return "sliding-window layers"
    norms = (LlamaRMSNorm, Qwen2RMSNorm)  # the same forward (source), which decode_ops.norm_into computes
    for layer in model.model.layers:
        if type(layer.input_layernorm) not in norms or type(layer.post_attention_layernorm) not in norms:
            return "a norm other than LlamaRMSNorm"
    if type(model.model.norm) not in norms:
        return "a final norm other than LlamaRMSNorm"
    return None


def for_model(model: torch.nn.Module) -> LlamaLeanStep | None:
    """The model's `LlamaLeanStep` (made once per model: its fused panels are shared by every runner
    over it), or None where `why_not` says it does not apply."""
    step = model.__dict__.get("_kvmemory_lean_step")
    if step is None and why_not(model) is None:
        step = model.__dict__["_kvmemory_lean_step"] = LlamaLeanStep(model)
        from kvmemory.models.gguf_model import release_freed_memory

        release_freed_memory()  # fusing freed the layers' own panels: ~360 MB of heap for a 1.5B file
    return step


def _fused(layers: list) -> gguf_linear.GGUFLinear | None:
    """The layers in one kernel call (gguf_linear.fuse), or None where they do not fuse (other kinds of
    linears, other block formats: each then computes in its own call)."""
    try:
        return gguf_linear.fuse(layers)
    except ValueError:
        return None


class LlamaLeanStep:
    """`step(ids [1, T], position, cache)` -> logits [T, V], as `model(input_ids=ids, position_ids=...,
    cache=cache, use_cache=True).logits[0]` computes them (the same bits), writing the same K/V."""

    def __init__(self, model: torch.nn.Module):
        reason = why_not(model)
        if reason is not None:
            raise ValueError(f"no lean step for this model: {reason}")
        self.model = model
        self.cfg = model.config
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.attend = ALL_ATTENTION_FUNCTIONS[self.cfg._attn_implementation]  # what LlamaAttention calls
        self.layers = list(model.model.layers[: self.cfg.num_hidden_layers])
        self.head_dim = getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.cfg.num_attention_heads
        self.q_size = self.cfg.num_attention_heads * self.head_dim
        self.kv_size = self.cfg.num_key_value_heads * self.head_dim
        self.ffn = self.cfg.intermediate_size
        # One kernel call for q/k/v and one for gate/up where the linears are GGUF blocks; else each its own.
        self.qkv, self.gate_up = [], []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_fused([a.q_proj, a.k_proj, a.v_proj]))
            self.gate_up.append(_fused([mlp.gate_proj, mlp.up_proj]))
        self.kernel, self.width = self._decode_kernel()
        self.c_layers = self._c_layers()

    def _c_layers(self) -> list | None:
        """Each layer's `decode_ops.Layer` where `kvm_decode_layer` can make its calls (the decode-step
        kernel runs, every linear is GGUF blocks with the kernel loaded, the attention is the few-query
        kernel over heads it takes, one scaling), else None: the step then calls from Python."""
        qlib, alib = quantized_linear.load(), few_query_attention.load()
        if self.kernel is None or qlib is None or alib is None or self.cfg._attn_implementation != attention.FEWQ:
            return None
        Hq, Hkv, D = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.head_dim
        if D % 16 or D > 128 or Hq % Hkv:  # what kvm_fewq_attention refuses whatever the step
            return None
        attns = [layer.self_attn for layer in self.layers]
        if len({(a.scaling, bool(getattr(a, "is_causal", True))) for a in attns}) != 1:
            return None

        def linear(l) -> decode_ops.Linear | None:
            if not isinstance(l, gguf_linear.GGUFLinear) or l._fn is None:
                return None
            d, m = l.pointers()
            bias = l.bias.data_ptr() if l.bias is not None else None  # added after each sum, as forward adds it
            return decode_ops.Linear(l.kind, l.q.data_ptr(), d, m, l.q.shape[0], l.in_features, bias)

        out = []
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            # unfused (block types differ): q / gate in the fused slot, k, v / up beside it (decode_ops.cpp)
            qkv = [self.qkv[i]] if self.qkv[i] is not None else [a.q_proj, a.k_proj, a.v_proj]
            gate_up = [self.gate_up[i]] if self.gate_up[i] is not None else [mlp.gate_proj, mlp.up_proj]
            lin = [linear(x) for x in (qkv[0], a.o_proj, gate_up[0], mlp.down_proj, *qkv[1:], *gate_up[1:])]
            if any(x is None for x in lin):
                return None
            none = decode_ops.Linear()  # q null: the slot is fused
            k, v = lin[4:6] if len(qkv) == 3 else (none, none)
            up = lin[-1] if len(gate_up) == 2 else none
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            out.append(decode_ops.Layer(n1.weight.data_ptr(), n2.weight.data_ptr(), n1.variance_epsilon,
                                        n2.variance_epsilon, *lin[:4], k, v, up))
        # the entry points the Python path calls, handed to the C loop (the builds native.py chose)
        self._c_fns = (ctypes.cast(qlib.kvm_qlinear_linear, ctypes.c_void_p).value,
                       ctypes.cast(alib.kvm_fewq_attention, ctypes.c_void_p).value)
        self._c_scale, self._c_causal = attns[0].scaling, bool(getattr(attns[0], "is_causal", True))
        return out

    def _c_room(self, cache, T: int):
        """(position, head stride, K/V dtype, each layer's (ReservedLayer, K, V buffers)) where every layer
        has room for T more tokens in one kind of buffer (what `_rope_cache` writes into), else None."""
        Hkv, D = self.cfg.num_key_value_heads, self.head_dim
        rooms, first = [], None
        for i in range(len(self.layers)):
            layer = cache.layers[i]
            where = getattr(layer, "next_position", None)
            at = where(T, Hkv, D, torch.float32) if where is not None else None
            if at is None:
                return None
            k, v = layer.k_buf, layer.v_buf
            shape = (at, k.stride(1), k.dtype)
            if first is None:
                first = shape
            elif shape != first:
                return None
            rooms.append((layer, k, v))
        return (*first, rooms)

    def _c_rows(self, T: int) -> bool:
        """Whether the C loop can take T new rows: its layers are C's, and T rows fit the few-query
        kernel (MAX_ROWS query rows per K/V head)."""
        cfg = self.cfg
        return (self.c_layers is not None
                and T * cfg.num_attention_heads <= few_query_attention.MAX_ROWS * cfg.num_key_value_heads)

    def _c_takes(self, T: int, mask: torch.Tensor | None, room) -> bool:
        """Whether the C loop takes T rows at `room` (`_c_room`'s answer; None: no room) under `mask`: few
        enough rows, K/V in a dtype the kernels read, the mask as `_c_mask` takes it. The lean step's
        `step` and the batched step ask the same."""
        return (room is not None and self._c_rows(T) and room[2] in (torch.float32, torch.bfloat16)
                and self._c_mask(mask, T, room[0] + T))

    def _c_attention(self, T: int, mask: torch.Tensor | None, position: int) -> tuple[int, int]:
        """(causal flag, keys) of the C loop's attention for T rows at `position`, as few_query_forward
        passes them: causal without a mask (only on an empty cache, where the keys are the tokens' own)."""
        causal = int(T > 1 and mask is None and self._c_causal)
        return causal, (T if causal else position + T)

    @staticmethod
    def _c_mask(mask: torch.Tensor | None, T: int, S: int) -> bool:
        """Whether the kernel takes `mask` as the Python loop passes it (few_query_attention.attend): none,
        or [1, 1, T, S] bool rows, contiguous, each a non-empty prefix of trues (else it would refuse
        the call after the layer's K/V are written, so such a step keeps the Python loop)."""
        if mask is None:
            return True
        if mask.dtype is not torch.bool or tuple(mask.shape) != (1, 1, T, S) or mask.stride(3) != 1 or not mask.is_cpu:
            return False
        rows = mask[0, 0]
        counts = rows.sum(-1, keepdim=True)
        return bool((counts > 0).all()) and torch.equal(rows, torch.arange(S) < counts)

    def _c_step(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                room) -> torch.Tensor:
        """The layers of a step through `kvm_decode_layer` (h updated in place); returns the last
        layer's down projection (the delta not yet added to h)."""
        position, head_stride, kv_dtype, rooms = room
        T = h.shape[1]
        cfg = self.cfg
        causal, keys = self._c_attention(T, mask, position)
        kv = attention.kv_code(self.layers[0].self_attn, kv_dtype)  # the cache's dtype, and the scores' mode
        step = decode_ops.Step(
            *self._c_fns, T, cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim, cfg.hidden_size,
            self.ffn, self.width, torch.get_num_threads(), position, head_stride, kv, causal, keys,
            mask.data_ptr() if mask is not None else None, mask.stride(2) if mask is not None else 0,
            self._c_scale, cos.data_ptr(), sin.data_ptr(), h.data_ptr(), None, None)
        fn = self.kernel.kvm_decode_layer

        def call(i, step_ref, prev, cur, act):
            layer, k, v = rooms[i]
            rc = fn(step_ref, prev, act, cur, k.data_ptr(), v.data_ptr())
            if rc == 0:
                layer.mark_filled(position + T)
            return rc

        return self._run_c_layers(step, call)

    def _run_c_layers(self, step, call, silu_up=None) -> torch.Tensor:
        """A step's layers through a C layer call, h updated in place: `step` is the step's decode_ops.Step
        (its scratch and gate/up buffers are made here), `call(i, step_ref, prev, cur, act)` runs layer i
        (`cur`, its c_layers entry; `prev` and `act` the layer before's and its SiLU(gate) * up address,
        None for the first) and returns the kernel's code. SiLU(gate) * up stays torch's between layers:
        `silu_up(mlp, gate, up)`, over all rows at once by default. Returns the last layer's down
        projection (the delta not yet added to h)."""
        step_ref = ctypes.byref(step)
        scratch = torch.empty(self.kernel.kvm_decode_layer_scratch(step_ref), dtype=torch.float32)
        gu = torch.empty((1, step.T, 2 * self.ffn), dtype=torch.float32)
        step.scratch, step.gate_up = scratch.data_ptr(), gu.data_ptr()
        gate, up = gu[..., : self.ffn], gu[..., self.ffn:]  # as the Python path slices its gate_up output
        act, prev = None, None
        for i, cur in enumerate(self.c_layers):
            rc = call(i, step_ref, prev, cur, act.data_ptr() if act is not None else None)
            if rc:
                raise KVMemoryError(f"the decode step's layer {i} failed in a kernel ({rc})")
            mlp = self.layers[i].mlp
            act = silu_up(mlp, gate, up) if silu_up is not None else mlp.act_fn(gate) * up
            prev = cur
        return self.layers[-1].mlp.down_proj.forward(act)

    def _decode_kernel(self):
        """(library, sum width) of the decode-step kernel where it gives these norms' bits, else (None,
        None): a float32 model, and a width with which the kernel's norm equals the model's own
        (decode_ops.sum_lanes compares them on seeded random rows)."""
        lib = decode_ops.load()
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(self.model.model.norm)
        if lib is None or self.model.dtype != torch.float32 or any(
                n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms):
            return None, None
        first = norms[0]
        width = decode_ops.sum_lanes(first.forward, first.weight.detach(), first.variance_epsilon, lib)
        if width is None:
            log.info("kvmemory: the decode-step kernel's norm gives none of torch's sum orders here; "
                     "the decode step keeps torch's ops (the same bits, slower)")
            return None, None
        return lib, width

    def _norm(self, norm, h: torch.Tensor, delta: torch.Tensor | None, scratch: torch.Tensor) -> torch.Tensor:
        """h += delta (the residual add, in place; none where delta is None), then norm(h)."""
        if self.kernel is None:
            if delta is not None:
                h.add_(delta)  # transformers' `residual + hidden_states` (the same add), kept in h's memory
            return norm.forward(h)
        x = torch.empty_like(h)
        decode_ops.norm_into(self.kernel, h, delta, norm.weight, norm.variance_epsilon, self.width, scratch, x)
        return x

    def _rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer_idx: int):
        """q [1, H_q, T, D] with RoPE, and the layer's cached K / V with these tokens' written (RoPE on k)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        Hq, Hkv, D = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.head_dim
        T = qkv.shape[1]
        layer = cache.layers[layer_idx] if self.kernel is not None else None
        # a layer with reserved room (engine/cache.py's ReservedLayer) says where these tokens' K/V go
        where = getattr(layer, "next_position", None)
        at = where(T, Hkv, D, qkv.dtype) if where is not None else None
        if at is not None:
            q = decode_ops.rope_into(self.kernel, qkv, cos, sin, Hq, Hkv, layer.k_buf[0, :, at : at + T],
                                     layer.v_buf[0, :, at : at + T])
            k, v = layer.filled(at + T)
            return q, k, v
        # transformers' own: views of the projections, its apply_rotary_pos_emb, the cache's update
        heads = lambda a, b: qkv[..., a:b].view(1, T, -1, D).transpose(1, 2)  # noqa: E731
        q, k = apply_rotary_pos_emb(heads(0, self.q_size), heads(self.q_size, self.q_size + self.kv_size), cos, sin)
        v = heads(self.q_size + self.kv_size, self.q_size + 2 * self.kv_size)
        k, v = cache.update(k, v, layer_idx)
        return q, k, v

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, position: int, cache, marks: list | None = None,
             rows: int | None = None) -> torch.Tensor:
        """`rows`: the logits of the last `rows` positions only ([rows, V]; the final norm and lm_head
        skip the others); None, all T. A norm works row by row, so its rows keep their bits; the lm_head's
        do where its linear computes each row on its own (the GGUF-block kernel), else only a step with
        the same `rows` gives the same bits (what the runner's logits="last" compares).
        `marks`: a list to which (part, perf_counter()) is appended as each part of the step ends
        (bench/decode_parts.py times them); None, the default, times nothing."""
        from transformers.masking_utils import create_causal_mask

        def mark(part: str) -> None:
            if marks is not None:
                marks.append((part, time.perf_counter()))

        m = self.model.model
        T = ids.shape[1]
        embeds = m.embed_tokens.forward(ids)
        position_ids = torch.arange(position, position + T, device=embeds.device).unsqueeze(0)
        mask = create_causal_mask(config=self.cfg, inputs_embeds=embeds, attention_mask=None, cache=cache,
                                  position_ids=position_ids)
        cos, sin = m.rotary_emb(embeds, position_ids=position_ids)
        cos, sin = cos.contiguous(), sin.contiguous()  # [1, T, D]: these positions'
        h = embeds  # a new tensor: the residual adds below write into it
        scratch = torch.empty(h.shape[-1], dtype=torch.float32)
        delta = None  # the last block's output, not yet added to h
        mark("embedding, mask, rope tables")
        room = self._c_room(cache, T) if marks is None and self._c_rows(T) else None
        if not self._c_takes(T, mask, room):
            room = None
        if room is not None:
            delta = self._c_step(h, cos, sin, mask, room)
        for i, layer in enumerate(self.layers if room is None else ()):
            a, mlp = layer.self_attn, layer.mlp
            x = self._norm(layer.input_layernorm, h, delta, scratch)
            mark("norms + residual adds")
            if self.qkv[i] is not None:
                qkv = self.qkv[i].forward(x)
            else:
                qkv = torch.cat([a.q_proj.forward(x), a.k_proj.forward(x), a.v_proj.forward(x)], -1)
            mark("q/k/v linears")
            q, k, v = self._rope_cache(qkv, cos, sin, cache, a.layer_idx)
            mark("rope + cache write")
            out, _ = self.attend(a, q, k, v, mask, dropout=0.0, scaling=a.scaling, position_ids=position_ids,
                                 use_cache=True)
            mark("attention")
            delta = a.o_proj.forward(out.reshape(1, T, -1).contiguous())
            mark("o linear")
            x = self._norm(layer.post_attention_layernorm, h, delta, scratch)
            mark("norms + residual adds")
            if self.gate_up[i] is not None:
                gu = self.gate_up[i].forward(x)
                gate, up = gu[..., : self.ffn], gu[..., self.ffn:]
            else:
                gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
            delta = mlp.down_proj.forward(mlp.act_fn(gate) * up)
            mark("mlp (gate/up, silu, down)")
        if rows is not None and rows < T:
            if rows == 0:
                mark("final norm + lm_head")
                return h.new_empty(0, self.model.lm_head.out_features)
            h, delta = h[:, T - rows :], delta[:, T - rows :]  # contiguous: the last rows of [1, T, hidden]
        h = self._norm(m.norm, h, delta, scratch)
        logits = self.model.lm_head.forward(h)[0]
        mark("final norm + lm_head")
        return logits
