"""Writing an entry: the verifier's verdict, the KV computed once and its graft proven, the atomic commit.

What `remember`, `remember_later`, `note`, `update` and `recompute` share (the facade keeps the checks
of what the caller passed, and routing):

- `verify_solution`: the verifier by name (exact-answer with an answer, else none) and its verdict,
  as the entry records it ({"name", "version", "ok", "detail"});
- `compute_kv`: the entry's token ids, its blocks (written to the store) and the attestation of a
  proof that grafting them is bit-identical to a recompute; nothing is returned, and nothing
  committed, when it is not;
- `compute_and_commit`: a planned entry (`KVMemory._plan`) computed and committed in one step,
  keeping the history of an entry remembered again (`compute_entry` is its compute half, which a
  batch, memory/many.py, runs for every item before one commit).
"""

from __future__ import annotations

import time

from kvmemory.engine.engine import VerifyReport
from kvmemory.errors import InvalidInput, UnknownEntry, VerificationFailed
from kvmemory.memory.layout import Layout, entry_probe
from kvmemory.memory.listing import HISTORY_KEY
from kvmemory.memory.prompts import entry_messages, render_ids
from kvmemory.store.local import EntryRecord


def verify_solution(problem: str, solution: str, answer: str | None, verifier) -> dict:
    """The verdict of `verifier` (a Verifier, a name, or None: exact-answer with an answer, else none)."""
    if verifier is None or isinstance(verifier, str):
        from kvmemory.memory.verifiers import verifier_by_name

        verifier = verifier_by_name(verifier or ("exact-answer" if answer is not None else "none"))
    result = verifier(problem, solution, answer)
    return {"name": verifier.name, "version": getattr(verifier, "version", "0"), "ok": bool(result.ok),
            "detail": result.detail}


def compute_kv(mem, problem: str, solution: str, answer: str | None):
    """Token ids, blocks (written to the store) and attestation of a solution, the graft proven."""
    eng = mem.engine
    ids = render_ids(eng.tokenizer, entry_messages(problem, solution, answer))
    # The entry's ids and a probe question after them, cut at the entry's end: every chunk of the
    # entry is a block (its last, partial one too: a tail block, so a short entry is grafted whole),
    # and the proof grafts all of them and computes the probe (memory/layout.py).
    probe = entry_probe(eng.tokenizer, ids, problem, solution, answer)
    eng.runner.check_ids(probe.ids, mem.probe_tokens)
    ref, blocks = eng.compute_blocks(probe.ids, max_new_tokens=mem.probe_tokens, cuts=probe.cuts, upto=len(ids))
    # Write the block files, then prove the graft by reading them back through the verified path.
    eng.store.write_block_files(blocks)
    vr = _prove(mem, probe, blocks, ref)
    if not vr.bit_identical:
        raise VerificationFailed(
            f"the grafted logits differ from the recompute (KL {vr.comparison.kl_max}, argmax agreement "
            f"{vr.comparison.argmax_agreement:.4f}): this execution profile is not deterministic; nothing stored"
        )
    return ids, blocks, vr.attestation


def _prove(mem, probe: Layout, blocks, ref) -> VerifyReport:
    """Graft the just-written blocks (read back and hashed) and compare with the recompute `ref`."""
    eng = mem.engine
    return eng.verify_tokens(probe.ids, decode_tokens=mem.probe_tokens, single_pass=False, reference=ref,
                             rows=eng.rows_for(blocks), cuts=probe.cuts)


def compute_and_commit(mem, plan: dict) -> EntryRecord:
    """Compute a planned entry's KV and commit it (an entry remembered again keeps its history)."""
    entry, blocks = compute_entry(mem, plan)
    mem.engine.store.commit_entry(entry, blocks)
    return entry


def compute_entry(mem, plan: dict):
    """A planned entry's record and blocks (the block files written, the graft proven), not committed:
    what `compute_and_commit` commits, and what a batch (memory/many.py) commits with the others."""
    eng = mem.engine
    history: list = []
    try:
        cur = eng.store.get_entry(plan["id"])
    except UnknownEntry:
        cur = None
    if cur is not None:
        if (cur.problem, cur.solution, cur.answer) != (plan["problem"], plan["solution"], plan["answer"]):
            # Ids are content hashes of the first version: this content was an entry that
            # `update` has changed since. Re-adding it would silently undo that update.
            raise InvalidInput(
                f"entry {cur.id} was this solution before an update changed it (now version "
                f"{len(cur.meta.get(HISTORY_KEY) or ()) + 1}); to go back, `update({cur.id!r}, ...)` "
                "with these texts (its history keeps every version)")
        history = list(cur.meta.get(HISTORY_KEY) or ())
    ids, blocks, attestation = compute_kv(mem, plan["problem"], plan["solution"], plan["answer"])
    now = time.time()
    meta = {**plan["meta"], "aliases": plan["aliases"]}
    if history:
        meta[HISTORY_KEY] = history
    entry = EntryRecord(
        id=plan["id"], namespace=plan["namespace"], problem=plan["problem"], solution=plan["solution"],
        answer=plan["answer"], verifier=plan["verdict"], verified=plan["verdict"]["ok"], token_ids=tuple(ids),
        profile_id=eng.profile_id, chain=tuple(m.hash for m, _ in blocks), attestation=attestation, meta=meta,
        created=cur.created if cur is not None else now, updated=now,
    )
    return entry, blocks
