"""A token embedding looked up from a GGUF tensor's blocks: the rows asked for are expanded, nothing else.

transformers keeps the embedding as a float32 [vocabulary, hidden] matrix (671 MB for Gemma 3 270M's
262,144 x 640, 2.1 GB for a Llama-3 8B). Here the embedding's blocks stay in the GGUF-block kernel's
panel layout (the same panels the tied output layer computes from: one copy), and a lookup expands its
rows with torch's float32 operations in gguf-py's order, `(q - bias) * d`, then `+ m` where the format
has a minimum: one rounding each, as gguf-py's `dequantize` rounds (and where a minimum follows, d * q is
exact: kernels/quantized_linear.py), so a row equals gguf-py's byte for byte (tests/test_gguf_files.py).
Gemma's scaled embedding keeps its scale: `rows * embed_scale`, as its own forward computes it.
"""

from __future__ import annotations

import torch

from kvmemory.kernels import quantized_linear as qlinear


class GGUFEmbedding(torch.nn.Module):
    """`nn.Embedding`'s lookup over panels (q, d, m, kind: kernels/quantized_linear.py's layout)."""

    def __init__(self, original: torch.nn.Embedding, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = original.num_embeddings, original.embedding_dim
        self.padding_idx = getattr(original, "padding_idx", None)
        self.weight = None  # no float32 matrix exists (parameters() lists only real tensors)
        self.q, self.d, self.m, self.kind = q, d, m, kind
        self.fmt, self.sub, self.bias = qlinear.decode_kind(kind)
        scale = getattr(original, "embed_scale", None)
        if scale is not None:  # Gemma: `super().forward(ids) * self.embed_scale.to(self.weight.dtype)`
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows [len(ids), hidden] of the flat token ids."""
        p, lane = torch.div(ids, qlinear.PANEL, rounding_mode="floor"), ids % qlinear.PANEL
        q = self.q[p, :, lane]  # [T, K/2 | K]
        if self.fmt == qlinear.F32:
            return q.clone()
        if self.fmt in (qlinear.NIB, qlinear.NIBMIN):
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1)
        values = (q.to(torch.int32) - self.bias).to(torch.float32)
        d, m = self._scales(p, lane)
        w = values * d.repeat_interleave(self.sub, dim=1)
        if m is not None:
            w = w + m.repeat_interleave(self.sub, dim=1)
        return w

    def _scales(self, p: torch.Tensor, lane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 scale and minimum [T, K/sub] of each sub-block of the rows (panel p, lane): with
        K-quant scales, D * scale and -(DMIN * min), gguf-py's exact products, as the kernel takes them."""
        minimum = self.fmt in (qlinear.NIBMIN, qlinear.BYTEMIN)
        if not qlinear.kscales(self.kind):
            return self.d[p, :, lane], (self.m[p, :, lane] if minimum else None)
        subs, P = qlinear.SUPER // self.sub, qlinear.PANEL
        blocks = self.d[p]  # [T, K/256, super-block bytes]
        floats = blocks[:, :, :P * 4 * (2 if minimum else 1)].contiguous().view(torch.float32)  # [T, K/256, 16 | 32]
        ints = blocks[:, :, P * 4 * (2 if minimum else 1):].contiguous().view(torch.int8)
        ints = ints.view(*ints.shape[:2], 2 if minimum else 1, subs, P)  # [T, K/256, scale | min, subs, 16]
        rows = torch.arange(p.shape[0])
        D = floats[rows, :, lane]  # [T, K/256]
        d = (D[:, :, None] * ints[rows, :, 0, :, lane].to(torch.float32)).reshape(p.shape[0], -1)
        if not minimum:
            return d, None
        DMIN = floats[rows, :, P + lane]
        return d, -(DMIN[:, :, None] * ints[rows, :, 1, :, lane].to(torch.float32)).reshape(p.shape[0], -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        out = self.rows(flat).view(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(torch.float32)
        return out
