"""`kvmemory demo`: the value on one screen, every number measured in this run.

1. The model alone answers a few multi-step word problems (greedy decoding, a token budget).
2. Their worked solutions are remembered: the arithmetic verifier re-checks every step, the KV cache
   is computed once and its graft proven bit-identical before anything is stored.
3. The same problems come back reworded (same numbers, other words). Each is routed to its verified
   entry, the entry's KV is grafted at its own positions and the model answers. The answer mode is
   printed: by default the reliable one (`KVMemory.answer(answer_prefix="The answer is",
   choices="numbers")`: the model picks, by log-likelihood, among the numbers the routed verified
   solution wrote), because free decoding of a 135M model copies numbers wrongly even with the right
   solution in context; `answer_mode="free"` shows free greedy decoding instead. Time to first token
   is measured side by side on each question's prompt: grafted, and recomputed from scratch
   (interleaved runs, medians).
4. `verify` recomputes every entry from scratch and compares its logits with its graft.

Every answer is compared in code with the expected answer (✓/✗ and a total); nothing printed is
a constant. Runs in a temporary store on the embedded model (or the model / store given).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass

from tqdm import tqdm

ANSWER_PREFIX = "The answer is"
ANSWER_MODES = ("choices", "free")


@dataclass(frozen=True, slots=True)
class DemoProblem:
    problem: str  # what the model alone is asked, and what is remembered
    steps: tuple[str, ...]  # the worked solution (every "a op b = c" is re-checked by the verifier)
    answer: int
    reworded: str  # the same problem in other words, with the same numbers (the router checks them)

    @property
    def solution(self) -> str:
        return "\n".join(self.steps)


DEMO_PROBLEMS = (
    DemoProblem(
        problem="A bakery bakes 14 trays of rolls every morning, and each tray holds 24 rolls. It sells 276 rolls "
                "during the day and gives the rest to 3 shelters in equal shares. How many rolls does each "
                "shelter receive?",
        steps=("Step 1: Find how many rolls the bakery bakes. There are 14 trays and every tray holds 24 rolls, "
               "so the bakery bakes 14 * 24 = 336 rolls each morning.",
               "Step 2: Find how many rolls are left after the day's sales. The bakery sells 276 of its 336 "
               "rolls, so 336 - 276 = 60 rolls are left over.",
               "Step 3: Share the leftover rolls. The 60 rolls are split equally among 3 shelters, so each "
               "shelter receives 60 / 3 = 20 rolls.",
               "The answer is 20."),
        answer=20,
        reworded="Every morning a bakery makes 14 trays of 24 rolls. After selling 276 rolls it splits the "
                 "leftover rolls equally among 3 shelters. How many rolls go to each shelter?",
    ),
    DemoProblem(
        problem="A train trip has 3 legs that take 47, 38 and 55 minutes, and the train stops for 12 minutes "
                "between one leg and the next. How many minutes does the whole trip take?",
        steps=("Step 1: Add up the time the train is moving. The first two legs take 47 + 38 = 85 minutes, "
               "and with the third leg the moving time is 85 + 55 = 140 minutes.",
               "Step 2: Count the stops. The train stops only between one leg and the next, so 3 legs have "
               "2 stops between them, and the time stopped is 2 * 12 = 24 minutes.",
               "Step 3: The whole trip is the moving time plus the stopped time, so it takes 140 + 24 = 164 "
               "minutes.",
               "The answer is 164."),
        answer=164,
        reworded="How long in minutes is a train trip made of 3 legs of 47, 38 and 55 minutes, with a 12 minute "
                 "stop between each leg and the next?",
    ),
    DemoProblem(
        problem="A warehouse has 6 aisles with 18 shelves each, and every shelf holds 35 boxes. A shipment takes "
                "away 1250 boxes and a delivery brings 420 boxes. How many boxes are in the warehouse now?",
        steps=("Step 1: Count the shelves. There are 6 aisles with 18 shelves in each aisle, so the warehouse "
               "has 6 * 18 = 108 shelves.",
               "Step 2: Count the boxes at the start. Every one of the 108 shelves holds 35 boxes, so there "
               "are 108 * 35 = 3780 boxes to begin with.",
               "Step 3: The shipment takes 1250 boxes away, so 3780 - 1250 = 2530 boxes remain on the shelves.",
               "Step 4: The delivery brings 420 boxes in, so the warehouse now holds 2530 + 420 = 2950 boxes.",
               "The answer is 2950."),
        answer=2950,
        reworded="There are 6 aisles in a warehouse, each with 18 shelves of 35 boxes. Then 1250 boxes are "
                 "shipped out and 420 boxes are delivered. How many boxes does the warehouse hold now?",
    ),
)


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def _tail(text: str, n: int) -> str:
    """The last whole words of `text` that fit in `n` characters (where a decode ended)."""
    words, out = text.split(), ""
    for w in reversed(words):
        if len(out) + len(w) + 2 > n:
            return "…" + out
        out = f"{w} {out}" if out else w
    return out


def _report(r: dict) -> str:
    base, rows, v = r["base"], r["questions"], r["verify"]
    n = len(rows)
    mode = r["answer_mode"]
    out = [f"kvmemory demo: {r['model_name']} on {r['device']}, profile {r['profile_id'][:12]}, "
           f"chunk {r['chunk']}, a temporary store" if r["temporary_store"] else
           f"kvmemory demo: {r['model_name']} on {r['device']}, profile {r['profile_id'][:12]}, "
           f"chunk {r['chunk']}, store {r['store']}",
           "",
           f"1. The model alone (greedy decoding, up to {r['base_budget']} tokens, no memory)",
           f"   {'#':<2} {'expected':>8} {'answer':>8}     {'decoded':>7} {'seconds':>8}  last words"]
    for i, b in enumerate(base["questions"], 1):
        got = "none" if b["answer_value"] is None else str(b["answer_value"])
        out.append(f"   {i:<2} {b['expected']:>8} {got:>8}  {_mark(b['correct'])}  {b['tokens_decoded']:>7} "
                   f"{b['seconds']:>8.2f}  {_tail(b['answer'], 44)!r}")
    out.append(f"   model alone: {base['right']}/{n} right, {base['tokens_decoded']} tokens decoded, "
               f"{base['seconds']:.1f} s")
    out += ["", f"2. Remember the verified worked solutions (verifier ran; KV computed once; graft proven "
                f"bit-identical before storing)"]
    for i, e in enumerate(r["entries"], 1):
        out.append(f"   {i:<2} {e['id']}  {e['verifier']}: {e['verifier_detail']}; {e['tokens']} tokens, "
                   f"{e['blocks']} blocks ({e['seconds']:.1f} s)")
    if mode == "choices":
        how = (f'answer mode: choices="numbers" after "{ANSWER_PREFIX}": the model picks, by log-likelihood,\n'
               "   among the numbers the routed verified solution wrote (free decoding of a small model is unreliable)")
    else:
        how = (f'answer mode: free greedy decoding after "{ANSWER_PREFIX}" (up to {r["answer_budget"]} tokens; '
               "--answer-mode choices is the reliable one)")
    out += ["", "3. The same problems reworded, answered with memory (routed, KV grafted at its own positions)",
            f"   {how}",
            f"   {'#':<2} {'route':>5} {'expected':>8} {'answer':>8}     {'grafted':>7} {'computed':>8} "
            f"{'decoded':>7}  {'TTFT graft':>10} {'recompute':>9} {'speedup':>7}"]
    for i, q in enumerate(rows, 1):
        got = "none" if q["answer_value"] is None else str(q["answer_value"])
        out.append(f"   {i:<2} {q['route_score']:>5.3f} {q['expected']:>8} {got:>8}  {_mark(q['correct'])}  "
                   f"{q['grafted']:>7} {q['computed']:>8} {q['decoded']:>7}  {q['ttft_graft_s']:>9.3f}s "
                   f"{q['ttft_recompute_s']:>8.3f}s {q['ttft_speedup']:>6.1f}x")
    t = r["totals"]
    out.append(f"   with memory: {t['right']}/{n} right, {t['decoded']} tokens decoded (model alone: "
               f"{base['tokens_decoded']}), {t['answer_seconds']:.1f} s answering (model alone: {base['seconds']:.1f} s);")
    out.append(f"   {t['grafted']} of {t['prompt_tokens']} prompt tokens grafted "
               f"({t['grafted'] / max(t['prompt_tokens'], 1):.0%}); time to first token {t['ttft_graft_s']:.2f} s "
               f"vs {t['ttft_recompute_s']:.2f} s recomputing the same prompts ({t['ttft_speedup']:.1f}x; "
               f"medians of {r['ttft_repeats']} runs each)")
    out += ["", f"4. verify: {v['checked']} entries recomputed from scratch and compared with their graft: "
                f"{v['bit_identical']} bit-identical (SHA-256 of the logits), KL max {v['kl_max']}, "
                f"argmax agreement {v['argmax_agreement']:.0%}",
            "", f"{t['right']}/{n} right with memory, {base['right']}/{n} alone; all bit-identical: "
                f"{'yes' if r['ok'] else 'NO'} ({r['seconds']:.0f} s in all, model loaded in {r['load_seconds']:.1f} s)"]
    return "\n".join(out)


def run_demo(model: str | None = None, store: str | None = None, chunk: int | None = None,
             progress: bool = True, answer_mode: str = "choices", base_budget: int = 128,
             answer_budget: int = 12, ttft_repeats: int = 3, problems=DEMO_PROBLEMS, device: str = "auto",
             dtype: str = "auto") -> dict:
    """Run the demo; returns its JSON (`table` holds the one-screen text). `device` / `dtype`: where and
    in what the model runs (models/devices.py; the embedded model stays on the CPU under "auto")."""
    from kvmemory.errors import InvalidInput
    from kvmemory.memory.facade import KVMemory
    from kvmemory.memory.verifiers import extract_answer
    from kvmemory.models.loading import DEFAULT_MODEL

    if answer_mode not in ANSWER_MODES:
        raise InvalidInput(f"answer_mode must be one of {ANSWER_MODES}, got {answer_mode!r}")
    if ttft_repeats < 1:
        raise InvalidInput(f"ttft_repeats must be at least 1, got {ttft_repeats}")
    bar = dict(disable=not progress, unit="question")
    t_start = time.perf_counter()
    tmp = None
    if store is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvmemory-demo-")
        store_path = f"{tmp.name}/store"
    else:
        store_path = store
    try:
        kw = {"chunk": chunk} if chunk else {}
        mem = KVMemory(model=model or DEFAULT_MODEL, store=store_path, namespace="kvmemory-demo", device=device,
                       dtype=dtype, **kw)
        load_s = time.perf_counter() - t_start
        eng = mem.engine

        # 1. the model alone
        base_rows = []
        for p in tqdm(problems, desc="model alone", **bar):
            ans = mem.answer(p.problem, use_memory=False, max_new_tokens=base_budget)
            got = extract_answer(ans.text)
            base_rows.append({"question": p.problem, "expected": str(p.answer), "answer": ans.text,
                              "answer_value": got, "correct": got == p.answer,
                              "tokens_decoded": ans.report.tokens_decoded, "seconds": ans.seconds,
                              "stopped_by": ans.stopped_by})

        # 2. remember the verified solutions
        entries, entry_rows = [], []
        for p in tqdm(problems, desc="remember", unit="entry", disable=not progress):
            t0 = time.perf_counter()
            e = mem.remember(p.problem, p.solution, str(p.answer), verifier="arithmetic")
            entries.append(e)
            entry_rows.append({"id": e.id, "verifier": e.verifier["name"], "verified": e.verified,
                               "verifier_detail": e.verifier["detail"], "tokens": len(e.token_ids),
                               "blocks": len(e.chain), "seconds": time.perf_counter() - t0})

        # 3. the reworded questions with memory, each also recomputed from scratch for TTFT
        rows = []
        for p, e in tqdm(list(zip(problems, entries)), desc="with memory", **bar):
            if answer_mode == "choices":
                ans = mem.answer(p.reworded, answer_prefix=ANSWER_PREFIX, choices="numbers")
            else:
                ans = mem.answer(p.reworded, answer_prefix=ANSWER_PREFIX, max_new_tokens=answer_budget,
                                 stop=["\n"])
            r = ans.report
            got = extract_answer(ans.text)
            # Time to first token for the prompt the answer was computed from: its stored chain read,
            # verified and grafted, the rest computed, against the same prompt recomputed from scratch.
            # Wall clock around each whole call, interleaved, the median of `ttft_repeats` of each
            # (on a busy machine single timings swing several-fold).
            prompt = mem.question_layout(p.reworded, [mem.entry(eid) for eid in ans.entries], ANSWER_PREFIX)
            ids, cuts = prompt.ids, prompt.cuts  # cut where the answer cut it (at each entry's end)
            graft_times, recompute_times = [], []
            for _ in range(ttft_repeats):
                t0 = time.perf_counter()
                _, fr = eng.forward(ids, max_new_tokens=0, logits="last", cuts=cuts)  # as the answer computed it
                graft_times.append(time.perf_counter() - t0)
                if fr.tokens_grafted != r.tokens_grafted:  # the timed graft must be the answer's graft
                    raise RuntimeError(f"timing run grafted {fr.tokens_grafted} tokens, the answer {r.tokens_grafted}")
                t0 = time.perf_counter()
                eng.recompute(ids, max_new_tokens=0, keep_logits=False, logits="last", cuts=cuts)
                recompute_times.append(time.perf_counter() - t0)
            ttft_graft, ttft_recompute = statistics.median(graft_times), statistics.median(recompute_times)
            rows.append({
                "question": p.reworded, "expected": str(p.answer), "answer": ans.text, "answer_value": got,
                "correct": got == p.answer, "entry": ans.entries[0] if ans.entries else None,
                "routed_to_its_entry": ans.entries[:1] == [e.id],
                "route_score": ans.scores[0] if ans.scores else 0.0, "verified": ans.verified,
                "choices": ans.choices, "tokens": r.tokens_total, "grafted": r.tokens_grafted, "cuts": list(cuts),
                "computed": r.tokens_computed, "decoded": r.tokens_decoded, "scored": r.tokens_scored,
                "bytes_read": r.bytes_read, "ttft_graft_s": ttft_graft, "ttft_recompute_s": ttft_recompute,
                "ttft_speedup": ttft_recompute / ttft_graft, "ttft_graft_runs_s": graft_times,
                "ttft_recompute_runs_s": recompute_times,
                "answer_seconds": ans.seconds,
            })

        # 4. the proof
        verify = mem.verify(progress=progress).to_json()
        verify.pop("entries")
        tg, tr = sum(q["ttft_graft_s"] for q in rows), sum(q["ttft_recompute_s"] for q in rows)
        result = {
            "model": eng.loaded.source, "model_name": ("SmolLM2-135M-Instruct (embedded)" if eng.loaded.source == DEFAULT_MODEL
                                                 else eng.loaded.source),
            "profile_id": eng.profile_id, "chunk": eng.chunk,
            "device": eng.profile.to_dict().get("device_name", ""), "store": store_path,
            "temporary_store": tmp is not None, "answer_mode": answer_mode,
            "answer_prefix": ANSWER_PREFIX, "base_budget": base_budget, "ttft_repeats": ttft_repeats,
            "answer_budget": answer_budget if answer_mode == "free" else None,
            "load_seconds": load_s,
            "base": {"questions": base_rows, "right": sum(b["correct"] for b in base_rows),
                     "tokens_decoded": sum(b["tokens_decoded"] for b in base_rows),
                     "seconds": sum(b["seconds"] for b in base_rows)},
            "entries": entry_rows,
            "questions": rows,
            "totals": {"right": sum(q["correct"] for q in rows), "prompt_tokens": sum(q["tokens"] for q in rows),
                       "grafted": sum(q["grafted"] for q in rows), "computed": sum(q["computed"] for q in rows),
                       "decoded": sum(q["decoded"] for q in rows), "ttft_graft_s": tg, "ttft_recompute_s": tr,
                       "ttft_speedup": tr / tg,
                       "answer_seconds": sum(q["answer_seconds"] for q in rows)},
            "verify": verify,
            "stats": mem.stats(),
        }
        result["ok"] = verify["checked"] == len(problems) and verify["bit_identical"] == verify["checked"]
        result["all_right"] = result["totals"]["right"] == len(rows)
        result["seconds"] = time.perf_counter() - t_start
        result["table"] = _report(result)
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()
