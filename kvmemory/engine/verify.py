"""Proof that a graft is exact: compare a grafted run with a recompute from scratch.

Every logit after the graft point is compared, prefill and decode steps alike: SHA-256 of the logits
bytes must be equal, the KL divergence exactly 0.0 and the argmax agreement 100 %. An attestation
records the hashes of the inputs (token ids, profile) and of the reference logits, so anyone with the
same model and profile can re-check an entry. The gap to a plain single-pass forward is reported as a
diagnostic and never asserted.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from kvmemory.store.blocks import ids_bytes
from kvmemory.engine.profile import canonical_json, sha256_hex
from kvmemory.engine.runner import ForwardResult

ATTESTATION_VERSION = 1


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


def make_attestation(token_ids, profile_id: str, graft_point: int, reference: ForwardResult,
                     comparison: Comparison) -> dict:
    """The record anyone can re-check: inputs' hashes, the graft point and the reference logits' hash."""
    body = {
        "version": ATTESTATION_VERSION,
        "token_ids_sha256": hashlib.sha256(ids_bytes(token_ids)).hexdigest(),
        "profile_id": profile_id,
        "graft_point": graft_point,
        "decode_tokens": len(reference.generated),
        "generated": list(reference.generated),
        "positions": comparison.positions,
        "logits_sha256": comparison.reference_sha256,
        "bit_identical": comparison.bit_identical,
        "kl_max": comparison.kl_max,
        "argmax_agreement": comparison.argmax_agreement,
        "verified_at": time.time(),
    }
    body["attestation_id"] = sha256_hex(canonical_json({k: v for k, v in body.items() if k != "verified_at"}))
    return body
