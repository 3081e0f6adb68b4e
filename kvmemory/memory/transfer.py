"""Moving entries between machines: import a bundle (store/bundle.py) into this memory's store, after
checking it against this machine's engine, and prove the imported entries exact here.

`import_bundle(mem, path)` (what `KVMemory.import_bundle` and `kvmemory import` run), in this order;
nothing of the bundle is written before steps 1-4 pass:

1. The whole bundle is read and checked (`read_bundle`: every member's size and SHA-256 against the
   manifest, names, every block's payload against its header, every chain complete). A damaged
   bundle raises `BundleError`.
2. Every profile it carries must be this engine's (`ExecutionProfile.require_same`): another profile
   raises `ProfileMismatch` naming the fields that differ (another KV dtype, CPU, thread count,
   kernel build, library version ...). Blocks made under another profile are never grafted here.
3. Each entry's id must be the content hash of its namespace, texts and profile (memory/ids.py; for an
   updated entry, its first version's texts, which its history carries), so "already present" means
   the same entry; entries of a namespace the target store is not scoped to
   are refused (`InvalidInput`); a read-only store is refused.
4. Entries already in the store are skipped (and reported): importing twice adds nothing.
5. Proof before commit, as `remember` does: for each entry to prove, its blocks are written into the
   store (block files only, not yet catalogued, so no reader can find them), grafted back through
   the store's verified read path and compared with a recompute from scratch on this machine, every
   logit after the graft point (`Engine.verify_tokens`); its reference logits' SHA-256 must also equal
   the one its attestation recorded where it was made (same profile, same bytes, on another machine).
   Which entries: a sample (`sample`, default 3, chosen reproducibly from the bundle's SHA-256), or
   all (`verify_all`). If any proven entry fails, nothing is committed: the report names the failed
   entries and `ok` is False (the CLI exits 1). The files written for the proof are left as
   orphans, as a refused `remember` leaves them (`kvmemory fsck --repair` removes them).
6. Commit: each new entry with its chain (`Store.commit_entry`: one transaction per entry), then the
   router learns the imported entries (`resync_router` per namespace), so `recall` / `answer` find them.

Signed stores (a shared Redis store, a signed folder). A bundle carries no signatures (the HMAC keys
are each store's secret) and its hashes prove only that it was not damaged on the way: anyone can
write a bundle whose hashes agree over K/V that some other model computed. Readers of a signed store
graft signed blocks after checking only their SHA-256 against the signed catalogue, so a signature
vouches for the row. The import therefore signs nothing it has not proven: into a signed store every
entry is proven bit-identical here before it is committed (and signed with the target's key),
whatever `sample` says (the report says `proof: "all (signed store)"`).

Unsigned stores: entries outside the sample are committed on the strength of the bundle's checks
and the equal profile; `kvmemory verify --all` (or importing with `--verify-all`) proves every one.

Not tested yet: a bundle exported on the CPU and imported on a GPU machine goes through the same
profile check (device_type, device_name, dtype, accelerator ... differ) and should be refused by name,
and an export / import between two runs on one GPU machine should prove exact; no GPU was available
when this was written, so neither is exercised by tests/test_bundle.py.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmemory.memory.layout import entry_probe
from kvmemory.engine.profile import ExecutionProfile
from kvmemory.errors import BundleError, InvalidInput, ProfileMismatch, StoreReadOnly
from kvmemory.memory.ids import expected_id
from kvmemory.store.bundle import Bundle, read_bundle
from kvmemory.store.local import EntryRecord

DEFAULT_SAMPLE = 3


@dataclass(slots=True)
class ImportReport:
    """What `import_bundle` did. `verify` has the keys of `kvmemory verify --json` (checked,
    bit_identical, kl_max, argmax_agreement, attestation_match, entries)."""

    bundle: str
    sha256: str
    entry_ids: list[str]  # every entry in the bundle
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already in the store
    blocks: int = 0  # blocks in the bundle
    blocks_new: int = 0  # of them, blocks the store did not hold
    profile_id: str = ""
    proof: str = "sample"  # "sample", "all", "all (signed store)" or "none"
    verify: dict = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)  # entries whose proof failed (then nothing was imported)

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict:
        return {"bundle": self.bundle, "sha256": self.sha256, "entries": len(self.entry_ids),
                "entry_ids": self.entry_ids, "imported": self.imported, "skipped": self.skipped,
                "blocks": self.blocks, "blocks_new": self.blocks_new, "profile_id": self.profile_id,
                "proof": self.proof, "verify": self.verify, "failed": self.failed, "ok": self.ok}


def check_profile(engine, profile_id: str, profile: dict) -> None:
    """Raise ProfileMismatch (naming the fields) unless `profile` is this engine's profile, and
    BundleError when it is but claims another id (a profile altered to look like this one)."""
    what = f"the bundle's blocks (profile {profile_id[:12]})"
    current = engine.profile.to_dict()
    unknown = sorted(set(profile) - set(current))
    if unknown:
        fields = {k: (None, profile[k]) for k in unknown}
        raise ProfileMismatch(f"{what} were made under an execution profile with fields this kvmemory does not "
                              f"know ({', '.join(unknown)}): a newer kvmemory made them. They cannot be grafted "
                              "exactly here: upgrade kvmemory, or export from a store made with this version",
                              fields=fields)
    try:
        stored = ExecutionProfile.from_dict(profile)
    except (TypeError, ValueError) as exc:
        raise BundleError(f"{what}: the profile cannot be read ({exc})") from None
    engine.profile.require_same(stored, what)
    if profile_id != engine.profile_id or stored.profile_id != profile_id:
        raise BundleError(f"the bundle's profile {profile_id[:12]} is this machine's profile "
                          f"{engine.profile_id[:12]} under another id: it was altered")


def _pick(entries: list[EntryRecord], n: int, seed: str) -> list[EntryRecord]:
    if n >= len(entries):
        return list(entries)
    chosen = set(random.Random(seed).sample(range(len(entries)), n))
    return [e for i, e in enumerate(entries) if i in chosen]


def _bar(progress: bool, items, **kw):
    from tqdm import tqdm

    return tqdm(items, disable=not progress, file=sys.stderr, **kw)


def import_bundle(mem, bundle: Bundle | str | os.PathLike, *, sample: int = DEFAULT_SAMPLE, verify_all: bool = False,
                  progress: bool = False) -> ImportReport:
    """Import a bundle into `mem`'s store (a KVMemory: its engine, store and router); see the module
    docstring for the checks, the proof and what signed stores require."""
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
        raise InvalidInput(f"sample must be a non-negative integer, got {sample!r}")
    engine, store = mem.engine, mem.store
    if not isinstance(bundle, Bundle):
        bundle = read_bundle(bundle, progress=progress)
    for pid, prof in bundle.profiles.items():
        check_profile(engine, pid, prof)
    for e in bundle.entries:
        # an updated entry keeps the id of its first version, whose texts its history holds
        if expected_id(e) != e.id:
            raise BundleError(f"entry {e.id}: its id is not the hash of its namespace, first version's texts and "
                              "profile (altered)")
        # what an answer checks before it uses an entry: its texts re-tokenize to its token ids (which hash
        # to its chain): a bundle whose texts were edited, with its id and manifest recomputed, is refused
        why = mem.checks.entry(e)
        if why is not None:
            raise BundleError(f"entry {e.id} of the bundle does not check against itself: {why}. Nothing was "
                              "imported")
    scope = getattr(store, "namespace", None)
    if scope is not None:
        others = sorted({e.namespace for e in bundle.entries} - {scope})
        if others:
            raise InvalidInput(f"the target store is scoped to namespace {scope!r}; the bundle holds entries of "
                               f"{others}. Export one namespace (--namespace) or import into an unscoped store")
    if getattr(store, "readonly", False):
        raise StoreReadOnly(f"the store at {getattr(store, 'url', None) or store.path} is read-only; nothing imported")

    present = set(store.entry_ids())
    new = [e for e in bundle.entries if e.id not in present]
    signed = getattr(store, "signer", None) is not None
    report = ImportReport(bundle=str(bundle.path), sha256=bundle.sha256, entry_ids=[e.id for e in bundle.entries],
                          skipped=[e.id for e in bundle.entries if e.id in present], blocks=len(bundle.blocks),
                          profile_id=engine.profile_id)
    if signed:
        to_prove, report.proof = list(new), "all (signed store)"
    elif verify_all:
        to_prove, report.proof = list(new), "all"
    else:
        to_prove = _pick(new, sample, bundle.sha256)
        report.proof = "sample" if to_prove or not new else "none"
    report.verify = _prove(mem, bundle, to_prove, progress)
    report.failed = [r["entry"] for r in report.verify["entries"] if not r["ok"]]
    if report.failed:
        return report  # nothing committed

    if new:
        held = store.known_blocks(list(bundle.blocks))
        report.blocks_new = len({h for e in new for h in e.chain} - set(held))
        for pid, prof in bundle.profiles.items():
            store.put_profile(pid, prof)  # this engine's own (checked above); stored for readers of the store
    for e in _bar(progress, new, desc="import", unit="entry"):
        store.commit_entry(e, bundle.blocks_of(e))
        report.imported.append(e.id)
    for ns in sorted({e.namespace for e in bundle.entries}):
        mem.resync_router(ns)  # listed and written to the router's folder: an import is a bulk change
    return report


def _prove(mem, bundle: Bundle, entries: Sequence[EntryRecord], progress: bool) -> dict:
    """Graft each entry's blocks (written, not catalogued) through the store's verified read path and
    compare with a recompute here; a summary with the keys of `VerifySummary.to_json()` plus `ok`."""
    engine, store = mem.engine, mem.store
    out = {"checked": 0, "bit_identical": 0, "kl_max": 0.0, "argmax_agreement": 1.0, "attestation_match": 0,
           "entries": []}
    for e in _bar(progress, entries, desc="verify", unit="entry"):
        blocks = bundle.blocks_of(e)
        store.write_block_files(blocks)
        k = int(e.attestation.get("decode_tokens", mem.probe_tokens))
        # what `remember` proved: the entry's ids, the probe question after them, cut at the entry's end
        probe = entry_probe(engine.tokenizer, e.token_ids, e.problem, e.solution, e.answer)
        vr = engine.verify_tokens(probe.ids, decode_tokens=k, single_pass=False, rows=engine.rows_for(blocks),
                                  cuts=probe.cuts)
        c = vr.comparison
        attested = (e.attestation.get("logits_sha256") == c.reference_sha256
                    and e.attestation.get("graft_point") == vr.graft_point)
        out["checked"] += 1
        out["bit_identical"] += int(c.bit_identical)
        out["kl_max"] = max(out["kl_max"], c.kl_max)
        out["argmax_agreement"] = min(out["argmax_agreement"], c.argmax_agreement)
        out["attestation_match"] += int(attested)
        out["entries"].append({"entry": e.id, "ok": bool(c.bit_identical and attested), "attestation_match": attested,
                               **vr.to_json()})
    return out


__all__ = ["ImportReport", "import_bundle", "check_profile", "DEFAULT_SAMPLE"]
