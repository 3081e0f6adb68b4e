"""Random-weight GGUF files of a real model's shape (`kvmemory bench gguf --synthetic llama-3.1-8b`).

What a user's 8B Q4_K_M file costs kvmemory (load, memory, decode, graft) depends on its shape and block
types, not on its weights: this writes a llama-architecture file of the shape asked for with llama.cpp's
Q4_K_M recipe (Q4_K linears; Q6_K for the output layer and for half the layers' attn_v and ffn_down; F32
norms), random blocks with small finite scales, and a byte-level tokenizer padded to the vocabulary size.
Tensors are written one at a time (nothing of the file is held whole in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# where each K-quant block keeps its float16 scales: (byte offset, how many)
_SCALES = {"Q2_K": (80, 2), "Q3_K": (108, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}
_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 8192
    rope_theta: float = 500000.0


SHAPES = {
    "llama-3.1-8b": Shape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, context=131072),
    "llama-3.2-1b": Shape(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256, context=131072),
    "tiny": Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=512, context=2048),  # for tests
}


def random_k_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, bytes per row] random K-quant blocks whose float16 scales are small (1e-3 .. 3e-3) and finite,
    so that activations stay finite through many layers."""
    if k % 256:
        raise ValueError(f"a {kind} row holds whole blocks of 256 weights, not {k}")
    raw = rng.integers(0, 256, size=(n * (k // 256), _BLOCK_BYTES[kind]), dtype=np.uint8)
    off, count = _SCALES[kind]
    scales = (rng.random((raw.shape[0], count)) * 2e-3 + 1e-3).astype(np.float16)
    raw[:, off:off + 2 * count] = scales.view(np.uint8).reshape(raw.shape[0], 2 * count)
    return raw.reshape(n, -1)


def byte_tokens(vocab: int) -> list[str]:
    """GPT-2's byte-level alphabet, one merged token ("Ġt"), then filler tokens up to `vocab`."""
    return byte_alphabet() + ["Ġt"] + [f"<|x{i}|>" for i in range(vocab - 257)]


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 symbols its BPE writes bytes as."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    by_byte = dict(zip(bs, cs))
    return [chr(by_byte[b]) for b in range(256)]


def write(path: str | Path, shape: Shape | str, seed: int = 0) -> Path:
    """Write a random Q4_K_M-style llama GGUF of `shape` at `path`; returns it."""
    import gguf

    shape = SHAPES[shape] if isinstance(shape, str) else shape
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head_dim = shape.hidden // shape.heads
    plan = [("token_embd.weight", "Q4_K", shape.vocab, shape.hidden)]
    for i in range(shape.layers):
        heavy = "Q6_K" if i % 2 == 0 else "Q4_K"  # llama.cpp's Q4_K_M: Q6_K for half of attn_v and ffn_down
        plan += [(f"blk.{i}.attn_norm.weight", "F32", 0, shape.hidden),
                 (f"blk.{i}.attn_q.weight", "Q4_K", shape.heads * head_dim, shape.hidden),
                 (f"blk.{i}.attn_k.weight", "Q4_K", shape.kv_heads * head_dim, shape.hidden),
                 (f"blk.{i}.attn_v.weight", heavy, shape.kv_heads * head_dim, shape.hidden),
                 (f"blk.{i}.attn_output.weight", "Q4_K", shape.hidden, shape.heads * head_dim),
                 (f"blk.{i}.ffn_norm.weight", "F32", 0, shape.hidden),
                 (f"blk.{i}.ffn_gate.weight", "Q4_K", shape.ffn, shape.hidden),
                 (f"blk.{i}.ffn_up.weight", "Q4_K", shape.ffn, shape.hidden),
                 (f"blk.{i}.ffn_down.weight", heavy, shape.hidden, shape.ffn)]
    plan += [("output_norm.weight", "F32", 0, shape.hidden), ("output.weight", "Q6_K", shape.vocab, shape.hidden)]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random {path.stem}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_tokens(shape.vocab))
    w.add_token_types([1] * shape.vocab)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    for name, kind, n, k in plan:  # tensor infos first (the header), then the data one tensor at a time
        if kind == "F32":
            w.add_tensor_info(name, (k,), np.dtype(np.float32), k * 4)
        else:
            nbytes = n * (k // 256) * _BLOCK_BYTES[kind]
            w.add_tensor_info(name, (n, k // 256 * _BLOCK_BYTES[kind]), np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # The data as gguf-py's write_tensor_data lays it out (each tensor aligned, then padded), written in
    # pieces: an 8B file's output layer alone is 430 MB.
    fout = w.fout[0]
    for name, kind, n, k in plan:
        w.write_padding(fout, fout.tell())
        if kind == "F32":
            np.ones(k, dtype=np.float32).tofile(fout)
            nbytes = k * 4
        else:
            nbytes = 0
            for r0 in range(0, n, 4096):
                piece = random_k_blocks(kind, min(4096, n - r0), k, rng)
                piece.tofile(fout)
                nbytes += piece.nbytes
        w.write_padding(fout, nbytes)
    fout.close()
    w.fout = None
    return path
