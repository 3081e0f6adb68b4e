"""Tiny random-init models built from configs (the architecture matrix) and an id-level tokenizer.

A module of its own (not conftest.py) so tests import it by a name no other conftest.py can shadow.
"""

from __future__ import annotations

import torch

from kvmemory.models import attention
from kvmemory.models import packed_linear
from kvmemory.engine.engine import Engine
from kvmemory.models.loading import LoadedModel
from kvmemory.store.local import LocalStore

TINY_VOCAB = 512


class IdTokenizer:
    """The smallest tokenizer the engine needs when tests speak in token ids (no text)."""

    chat_template = None
    special_tokens_map: dict = {}
    eos_token_id = None

    def __init__(self, vocab: int = TINY_VOCAB):
        self.vocab = vocab

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab)}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b % self.vocab for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) % 256 for i in ids).decode("latin-1")


def _base(**kw):
    d = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, head_dim=16)
    d.update(kw)
    return d


def tiny_config(arch: str):
    """Tiny configs; sliding windows are small (40) so that 100+ token prompts cross them with C=16."""
    import transformers as T

    if arch == "llama":
        return T.LlamaConfig(**_base())
    if arch == "mistral":
        return T.MistralConfig(**_base(sliding_window=40))
    if arch == "qwen2":
        return T.Qwen2Config(**_base(num_hidden_layers=3, use_sliding_window=True, sliding_window=40,
                                     max_window_layers=1))
    if arch == "qwen3":
        return T.Qwen3Config(**_base())
    if arch == "gemma2":
        return T.Gemma2Config(**_base(sliding_window=40, layer_types=["sliding_attention", "full_attention"],
                                      query_pre_attn_scalar=16))
    if arch == "gemma3":
        return T.Gemma3TextConfig(**_base(num_hidden_layers=3, sliding_window=40,
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                          query_pre_attn_scalar=16))
    if arch == "phi3":
        return T.Phi3Config(**_base(pad_token_id=0, bos_token_id=1, eos_token_id=2))
    raise ValueError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn: str | None = None,
               pack: bool = True):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    # Gemma2 has no SDPA path in transformers (softcapped attention): it runs eager.
    attn = attn or ("eager" if arch == "gemma2" else attention.for_device("sdpa", "cpu"))
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    model.eval().requires_grad_(False)
    if pack:
        packed_linear.pack_linears(model)  # as models.loading.load_model does on the CPU
    return model


def tiny_engine(arch: str, store_path, dtype=torch.float32, chunk: int = 16, seed: int = 0, kv_dtype=None,
                step: str = "auto", device: str = "cpu") -> Engine:
    """`step`: the runner's step mode (engine/static_step.py); `device`: where the model runs."""
    model = tiny_model(arch, dtype, seed, pack=device == "cpu",
                       attn=None if device == "cpu" else ("eager" if arch == "gemma2" else "sdpa"))
    model.to(device)
    return Engine(LoadedModel(model, IdTokenizer(), f"tiny-{arch}", f"tiny-{arch}"), LocalStore(store_path),
                  chunk=chunk, kv_dtype=kv_dtype, step=step)


def assert_graft_equals_recompute(eng: Engine, ids: list[int], stored: int, new_tokens: int) -> None:
    """Store `ids[:stored]`, answer `ids` with a graft, and require the recompute's exact bytes: the
    same tokens, and every prefill and decode logit equal (torch.equal)."""
    eng.store_prefix(ids[:stored])
    res, rep = eng.forward(ids, max_new_tokens=new_tokens, stop_token_ids=(), keep_logits=True)
    ref = eng.recompute(ids, max_new_tokens=new_tokens)
    assert rep.tokens_grafted == stored
    assert res.generated == ref.generated
    assert torch.equal(res.decode_logits, ref.decode_logits)
    assert torch.equal(res.prefill_logits, ref.prefill_logits[stored:])


def save_tiny_llama(folder) -> str:
    """A 1-layer random Llama with the embedded model's tokenizer and chat template, saved as an HF folder
    under `folder` (seconds, not minutes): for CLI tests that load a model by path. Returns its path."""
    from pathlib import Path

    import transformers as T

    from kvmemory.adapters.tokens import tokenizer_for

    out = Path(folder) / "model"
    tok = tokenizer_for()
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, head_dim=16,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
