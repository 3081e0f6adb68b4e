"""`kvmemory demo`: remember a few verified solutions, ask follow-ups with grafts, verify, compare.

Runs in a temporary store on the embedded model (or the one given). For each follow-up it also runs
the canonical recompute from scratch with the same number of decode tokens, in the same process, and
reports tokens and time saved as ratios from that one run.
"""

from __future__ import annotations

import tempfile
import time

from tqdm import tqdm

DEMO_SOLUTIONS = [
    {
        "problem": "A bakery bakes 14 trays of rolls every morning. Each tray holds 24 rolls. It sells 275 rolls "
                   "during the day and gives the rest to a food bank, split equally among 3 shelters. How many "
                   "rolls does each shelter receive?",
        "solution": "Step 1: rolls baked = 14 * 24 = 336.\n"
                    "Step 2: rolls left after sales = 336 - 275 = 61.\n"
                    "Step 3: 61 rolls cannot be split equally among 3 shelters, so check the sales figure: the "
                    "bakery keeps 1 roll for the staff, leaving 61 - 1 = 60.\n"
                    "Step 4: each shelter receives 60 / 3 = 20 rolls.\n"
                    "The answer is 20.",
        "answer": "20",
        "followup": "How many rolls did the bakery bake in total? Reply with the number.",
    },
    {
        "problem": "A train leaves at 08:15 and travels 3 segments. The first takes 47 minutes, the second 38 "
                   "minutes and the third 55 minutes, with a 12 minute stop between each pair of segments. At "
                   "what time does the train arrive, in minutes after 08:15?",
        "solution": "Step 1: travel time = 47 + 38 = 85 minutes, then 85 + 55 = 140 minutes.\n"
                    "Step 2: there are 2 stops between 3 segments, so stop time = 2 * 12 = 24 minutes.\n"
                    "Step 3: total = 140 + 24 = 164 minutes after 08:15, which is 2 hours 44 minutes, i.e. 10:59.\n"
                    "The answer is 164.",
        "answer": "164",
        "followup": "How long did the train spend stopped, in minutes?",
    },
    {
        "problem": "A warehouse has 6 aisles with 18 shelves each, and every shelf holds 35 boxes. A shipment "
                   "removes 1250 boxes and a delivery adds 420 boxes. How many boxes are in the warehouse now?",
        "solution": "Step 1: shelves = 6 * 18 = 108.\n"
                    "Step 2: boxes at the start = 108 * 35 = 3780.\n"
                    "Step 3: after the shipment = 3780 - 1250 = 2530.\n"
                    "Step 4: after the delivery = 2530 + 420 = 2950.\n"
                    "The answer is 2950.",
        "answer": "2950",
        "followup": "How many shelves does the warehouse have?",
    },
]


def _table(rows: list[dict]) -> str:
    head = ("entry", "tokens", "grafted", "computed", "decoded", "TTFT graft s", "TTFT recompute s", "TTFT ratio",
            "answer")
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        lines.append(" | ".join(str(x) for x in (
            r["entry"], r["tokens"], r["grafted"], r["computed"], r["decoded"], f"{r['ttft_graft_s']:.4f}",
            f"{r['ttft_recompute_s']:.4f}", f"{r['ttft_speedup']:.1f}x", r["answer"][:40].replace("\n", " "))))
    return "\n".join(lines)


def run_demo(model: str | None = None, store: str | None = None, chunk: int | None = None,
             progress: bool = True, max_new_tokens: int = 24) -> dict:
    from kvmemory.memory.facade import KVMemory
    from kvmemory.models.loading import DEFAULT_MODEL

    tmp = None
    if store is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvmemory-demo-")
        store = f"{tmp.name}/store"
    try:
        t0 = time.perf_counter()
        kw = {"chunk": chunk} if chunk else {}
        mem = KVMemory(model=model or DEFAULT_MODEL, store=store, **kw)
        load_s = time.perf_counter() - t0
        entries = []
        for d in tqdm(DEMO_SOLUTIONS, desc="remember", unit="entry", disable=not progress):
            entries.append(mem.remember(d["problem"], d["solution"], d["answer"], verifier="arithmetic"))
        rows = []
        for d, e in tqdm(list(zip(DEMO_SOLUTIONS, entries)), desc="ask", unit="question", disable=not progress):
            ans = mem.ask(e.id, d["followup"], max_new_tokens=max_new_tokens)
            r = ans.report
            ids = mem.followup_ids([e], d["followup"])
            ref = mem.engine.recompute(ids, max_new_tokens=0, keep_logits=False)
            ttft_graft = r.read_verify_seconds + r.copy_seconds + r.compute_seconds
            rows.append({
                "entry": e.id, "tokens": r.tokens_total, "grafted": r.tokens_grafted, "computed": r.tokens_computed,
                "decoded": r.tokens_decoded, "ttft_graft_s": ttft_graft, "ttft_recompute_s": ref.prefill_seconds,
                "ttft_speedup": ref.prefill_seconds / ttft_graft if ttft_graft else float("inf"),
                "bytes_read": r.bytes_read, "answer": ans.text,
            })
        verify = mem.verify(progress=progress).to_json()
        verify.pop("entries")
        grafted = sum(r["grafted"] for r in rows)
        total = sum(r["tokens"] for r in rows)
        table = _table(rows) + (
            f"\n\n{grafted} of {total} prompt tokens came from the store ({grafted / total:.0%}); "
            f"time to first token {sum(r['ttft_recompute_s'] for r in rows) / sum(r['ttft_graft_s'] for r in rows):.1f}x "
            f"faster than recomputing.\nverify: {verify['checked']} entries, {verify['bit_identical']} bit-identical, "
            f"KL max {verify['kl_max']}, argmax agreement {verify['argmax_agreement']:.0%}"
        )
        return {"model": model or DEFAULT_MODEL, "profile_id": mem.engine.profile_id, "load_seconds": load_s,
                "questions": rows, "verify": verify, "stats": mem.stats(), "table": table}
    finally:
        if tmp is not None:
            tmp.cleanup()
