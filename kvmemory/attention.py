"""Grouped-query SDPA without `repeat_kv`: the attention kvmemory's CPU profile runs.

transformers' `sdpa` expands the K/V heads to the query heads (`repeat_kv`) whenever a mask is
given, which is every grid chunk that follows a cache: an O(L) copy of the whole cache per layer per
chunk (at 8k tokens of SmolLM2 it triples the attention time). torch's CPU kernels take the groups
natively (`enable_gqa=True`), reading each K/V head in place. Registered as `kvmemory_sdpa` in
transformers' attention and mask interfaces; the name lands in the execution profile like any other
attention implementation, so blocks made under `sdpa` are never mixed with these.

Chosen once, at load: on the CPU `sdpa` becomes `kvmemory_sdpa` (`models.load_model`); on a GPU
SDPA with a mask and `enable_gqa` would fall back to the math kernel, so `sdpa` stays.
"""

from __future__ import annotations

import torch

NAME = "kvmemory_sdpa"

# Arguments this function does not implement: a call that carries one goes to transformers' own sdpa.
_DELEGATE = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H_q, T, D], key / value [B, H_kv, S, D] (H_q a multiple of H_kv), mask [B|1, 1, T, S]
    (bool or additive) or None; returns [B, T, H_q, D] as transformers' attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if any(kwargs.get(k) for k in _DELEGATE):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    T = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(T > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > T:  # causal without a mask only happens on an empty cache
        key, value = key[:, :, :T], value[:, :, :T]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `kvmemory_sdpa` a valid `attn_implementation` (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, grouped_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def for_device(requested: str, device: str | torch.device) -> str:
    """The attention implementation to load with: `sdpa` on the CPU becomes `kvmemory_sdpa`."""
    if requested == NAME or (requested == "sdpa" and torch.device(device).type == "cpu"):
        return register()
    return requested
