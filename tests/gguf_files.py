"""GGUF files the tests write themselves: a tiny random model of each architecture of the matrix, its
linears in any block type the kernel computes, with a small byte-level tokenizer and a chat template.

Weights come from a random-init transformers model (tiny_models.tiny_config); each tensor is written under
its GGUF name (gguf-py's tensor name map, as llama.cpp's converter names it) with the converter's own
changes undone by transformers' reader applied in reverse (llama's q/k row interleave, Gemma's norm - 1).
Types gguf-py quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16) are quantized from the weights; K-quant
blocks are random bytes with small finite scales (gguf-py cannot quantize them), so their model is not
the random-init one, only some model: what matters is that every reader agrees on it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tiny_models import tiny_config

from kvmemory.bench import synthetic_gguf

ARCH_NAMES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3": "gemma3", "phi3": "phi3"}  # llama.cpp writes Mistral models as its llama architecture
_K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # random blocks (gguf-py cannot quantize them)
MERGES = ["Ġ t", "h e", "Ġ a"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet, then specials and merged tokens: 272 tokens, whole panels of 16."""
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    merged = ["".join(m.split(" ")) for m in MERGES]
    return synthetic_gguf.byte_alphabet() + specials + merged + [
        f"<|x{i}|>" for i in range(16 - len(specials) - len(merged))]


def _encode(kind: str, w: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(bytes or values, raw type) of a [n, k] float32 weight written as `kind`."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        return w, None
    if kind == "F16":
        return w.astype(np.float16), None
    if kind in _K_TYPES:
        return synthetic_gguf.random_k_blocks(kind, w.shape[0], w.shape[1], rng), qtype
    return quants.quantize(w, qtype), qtype


def _forward_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row interleave (transformers undoes it on reading)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str | Path, arch: str, linear_type: str = "Q8_0", embedding_type: str = "Q8_0",
                    seed: int = 0, tied: bool = True, split: int = 1) -> list[Path]:
    """Write a tiny random `arch` model as a GGUF file at `path` (`split` > 1: as gguf-split's parts,
    `path` being the stem); returns the file(s)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from kvmemory.models.gguf_model import _hf_names

    rng = np.random.default_rng(seed)
    cfg = tiny_config(arch)
    tokens = _byte_tokens()
    cfg.vocab_size = len(tokens)
    cfg.tie_word_embeddings = tied
    if linear_type in _K_TYPES or embedding_type in _K_TYPES:  # K-quant rows are whole super-blocks of 256
        cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 512, 64
    cfg.bos_token_id, cfg.eos_token_id = 256, 260
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g_arch = ARCH_NAMES[arch]
    names = {hf: g for g, hf in _hf_names(model, g_arch).items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), g_arch, split_max_tensors=0 if split == 1 else -(-len(names) // split))
    pre = g_arch
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(10000.0)  # both readers take the file's value
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * 5 + [1] * len(MERGES) + [3] * (len(tokens) - 261 - len(MERGES)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(256)
    w.add_eos_token_id(260)
    w.add_pad_token_id(256)
    w.add_unk_token_id(256)
    w.add_chat_template(TEMPLATE)
    del pre
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for hf_name, tensor in model.state_dict().items():
        g = names.get(hf_name)
        if g is None or (tied and hf_name == "lm_head.weight"):
            continue
        values = tensor.numpy().astype(np.float32)
        owner = hf_name.rpartition(".")[0]
        if g_arch == "llama" and (".attn_q." in g or ".attn_k." in g) and g.endswith(".weight"):
            values = _forward_permute(values, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
        if g_arch in ("gemma2", "gemma3") and "norm.weight" in g:
            values = values + 1
        if values.ndim == 2 and (owner in linears or g == "token_embd.weight"):
            kind = embedding_type if g == "token_embd.weight" else linear_type
            data, qtype = _encode(kind, values, rng)
            if qtype is None:
                w.add_tensor(g, data)
            else:
                w.add_tensor(g, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(g, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split == 1:
        return [path]
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
