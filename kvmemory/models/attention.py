"""Grouped-query SDPA without `repeat_kv`: the attention kvmemory's CPU profile runs.

transformers' `sdpa` expands the K/V heads to the query heads (`repeat_kv`) whenever a mask is
given, which is every grid chunk that follows a cache: an O(L) copy of the whole cache per layer per
chunk (at 8k tokens of SmolLM2 it triples the attention time). torch's CPU kernels take the groups
natively (`enable_gqa=True`), reading each K/V head in place. Registered as `kvmemory_sdpa` in
transformers' attention and mask interfaces; the name lands in the execution profile like any other
attention implementation, so blocks made under `sdpa` are never mixed with these.

`kvmemory_fewq` is the same, except that calls with few query rows (a graft's new tokens, a decode
step: at most 128 query heads x tokens per K/V head) run the few-query kernel (few_query_attention.py),
1.3-2.7x as fast as SDPA there (its AVX2 and AVX-512 builds). Prefill's grid chunks keep SDPA, so
the K/V a block stores are the same bytes under either name; the logits of the few-row steps differ
in the last bits, which is why the two are different names (and so different execution profiles).

Both read a cache kept in bfloat16 under float32 queries (cache.py's `kv_dtype`): SDPA over K/V widened
to float32 (exact: every bfloat16 is a float32), the kernel widening the rows itself.

Under the q8 profile (`linears="q8"`, llama.cpp's arithmetic) the model's attention modules carry
`BF16_SCORES_ATTR` (`use_bf16_scores`): the kernel's calls over a bfloat16 cache score the queries rounded
to bfloat16 (few_query_attention.attend's `bf16_scores`), as llama.cpp rounds Q to its cache's type.

Chosen once, at load (`models.loading.load_model`): on the CPU `sdpa` becomes `kvmemory_fewq` where the kernel's
library (built into the package at install time) runs here (AVX-512 or AVX2), `kvmemory_sdpa` otherwise
(with one warning saying why: kernels/native.py); on a GPU SDPA with a mask and `enable_gqa` would fall
back to the math kernel, so `sdpa` stays.
"""

from __future__ import annotations

import torch

from kvmemory.kernels import few_query_attention
from kvmemory.errors import UnsupportedArchitecture

NAME = "kvmemory_sdpa"
FEWQ = "kvmemory_fewq"

BF16_SCORES_ATTR = "kvmemory_bf16_scores"  # on an attention module: the q8 profile's scores (module docstring)

# Arguments this function does not implement: a call that carries one goes to transformers' own sdpa.
_DELEGATE = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


def _causal_keys(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, is_causal: bool | None):
    """Whether the call is causal without a mask, and the keys / values it attends: causal without a
    mask only happens on an empty cache, where the keys are the queries' own."""
    T = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(T > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > T:
        key, value = key[:, :, :T], value[:, :, :T]
    return key, value, causal


def _widened(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V in the queries' dtype: a bfloat16 cache under float32 queries is widened, exactly (engine/cache.py)."""
    if key.dtype == query.dtype:
        return key, value
    return key.to(query.dtype), value.to(query.dtype)


def _grouped_sdpa(query, key, value, attention_mask, dropout, scaling, causal) -> torch.Tensor:
    key, value = _widened(query, key, value)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H_q, T, D], key / value [B, H_kv, S, D] (H_q a multiple of H_kv), mask [B|1, 1, T, S]
    (bool or additive) or None; returns [B, T, H_q, D] as transformers' attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if any(kwargs.get(k) for k in _DELEGATE):
        key, value = _widened(query, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    key, value, causal = _causal_keys(module, query, key, value, attention_mask, is_causal)
    return _grouped_sdpa(query, key, value, attention_mask, dropout, scaling, causal), None


def few_query_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, threads: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """`grouped_sdpa_forward`, with the few-query kernel for the calls it takes (it refuses the others:
    other dtypes or head sizes, batches, masks that are not causal prefixes, too many rows). `threads`:
    the kernel's thread count (few_query_attention.attend; the same bytes whatever it is)."""
    few_rows = query.shape[2] * query.shape[1] <= few_query_attention.MAX_ROWS * key.shape[1]
    if not few_rows or dropout or any(kwargs.get(k) for k in _DELEGATE):
        return grouped_sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    is_causal=is_causal, **kwargs)
    key, value, causal = _causal_keys(module, query, key, value, attention_mask, is_causal)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = few_query_attention.attend(query, key, value, attention_mask, scale, causal,
                                     **({"threads": threads} if threads else {}),
                                     bf16_scores=getattr(module, BF16_SCORES_ATTR, False))
    if out is None:  # refused (see few_query_attention.attend): the same call as `kvmemory_sdpa` makes
        out = _grouped_sdpa(query, key, value, attention_mask, dropout, scaling, causal)
    return out, None


def use_bf16_scores(model: torch.nn.Module) -> int:
    """Mark `model`'s attention modules for the q8 profile's scores (module docstring); returns how many."""
    n = 0
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling"):  # transformers' attention modules
            setattr(module, BF16_SCORES_ATTR, True)
            n += 1
    return n


def kv_code(module: torch.nn.Module, kv_dtype: torch.dtype) -> int:
    """The C steps' K/V code for a cache in `kv_dtype` under `module`'s scores (csrc/decode_ops.cpp
    `kv_bf16`): 0 float32, 1 bfloat16, 2 bfloat16 scored as the q8 profile scores."""
    if kv_dtype != torch.bfloat16:
        return 0
    return few_query_attention.BF16_SCORES if getattr(module, BF16_SCORES_ATTR, False) else 1


def register(name: str = NAME) -> str:
    """Make `name` (`kvmemory_sdpa` or `kvmemory_fewq`) a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, few_query_forward if name == FEWQ else grouped_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


def for_device(requested: str, device: str | torch.device) -> str:
    """The attention implementation to load with: `sdpa` on the CPU becomes `kvmemory_fewq` where the
    kernel runs, else `kvmemory_sdpa`. Asking for `kvmemory_fewq` where it cannot run is an error."""
    if requested == FEWQ:
        if few_query_attention.load() is None:
            raise UnsupportedArchitecture(f"{FEWQ} cannot run here: {few_query_attention.why_unavailable()}")
        return register(FEWQ)
    if requested == NAME:
        return register(NAME)
    if requested == "sdpa" and torch.device(device).type == "cpu":
        return register(FEWQ if few_query_attention.load() is not None else NAME)
    return requested
