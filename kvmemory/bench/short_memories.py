"""How much of a short memory is grafted, and what it saves (issue 41, item 3).

Notes of several lengths (16 to 200 tokens: a preference, a fact, a paragraph) are remembered on the
embedded model, then each is asked about (`KVMemory.ask`: the entry, then a question, cut at the entry's
end, memory/layout.py). Per entry it reports the entry's tokens, the tokens the answer grafted, their
share, and the grid-only rule's share for comparison (what a graft could cover before cuts: the entry's
whole blocks of C, `n // C * C`, computed, not measured). Time to first token of the asked prompt, a
graft against a recompute of the same prompt with the same cuts, interleaved, medians of `repeats`.
A second part: a two-turn chat whose first turn is short, and the cached tokens turn 2 reports.

    python -m kvmemory.bench.short_memories --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

QUESTION = "Say it again, briefly."

NOTES = [  # (statement as the problem, what it says as the solution): a spread of lengths
    ("Alice's pet?", "A cat."),
    ("Which tea does Alice like?", "Alice likes green tea, no sugar."),
    ("When does the team meet?", "The team meets every Tuesday at 10 am in room 4B."),
    ("Where is the spare key?", "The spare key is in the blue box on the top shelf of the garage, behind the "
     "paint cans, and the box is locked with the code 4471."),
    ("How is the weekly report sent?", "The weekly report is exported from the dashboard as a PDF every Friday "
     "afternoon, checked by the team lead, then sent to the finance and operations lists with the week's "
     "numbers in the body of the mail, so that people on phones can read them without opening the file."),
    ("What is the capital of Australia?", "Canberra is the capital of Australia. It was chosen as a compromise "
     "between Sydney and Melbourne and became the seat of government in 1927, when Parliament moved there "
     "from Melbourne. It lies in the Australian Capital Territory, and its lake, Lake Burley Griffin, is "
     "named after the American architect who designed the city with his wife, Marion Mahony Griffin, "
     "after an international competition held in 1911 and 1912."),
]


def run(*, repeats: int = 5, progress: bool = True) -> dict:
    from tqdm import tqdm

    from kvmemory.bench.serve import git_commit, machine_and_software
    from kvmemory.memory.facade import KVMemory

    with tempfile.TemporaryDirectory(prefix="kvmemory-short-") as tmp:
        mem = KVMemory(store=tmp, device="cpu")
        eng = mem.engine
        C = eng.chunk
        rows = []
        for problem, solution in tqdm(NOTES, desc="notes", disable=not progress, file=sys.stderr):
            e = mem.remember(problem, solution, verifier="none", allow_unverified=True)
            ans = mem.ask(e.id, QUESTION, max_new_tokens=4)
            n = len(e.token_ids)
            prompt = mem.question_layout(QUESTION, [e])
            graft_s, recompute_s = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                _, rep = eng.forward(prompt.ids, max_new_tokens=0, logits="last", cuts=prompt.cuts)
                graft_s.append(time.perf_counter() - t0)
                if rep.tokens_grafted != ans.report.tokens_grafted:
                    raise RuntimeError(f"timing run grafted {rep.tokens_grafted}, the answer {ans.report.tokens_grafted}")
                t0 = time.perf_counter()
                eng.recompute(prompt.ids, max_new_tokens=0, keep_logits=False, logits="last", cuts=prompt.cuts)
                recompute_s.append(time.perf_counter() - t0)
            g, r = statistics.median(graft_s), statistics.median(recompute_s)
            rows.append({"entry_tokens": n, "prompt_tokens": len(prompt.ids), "grafted": ans.report.tokens_grafted,
                         "grafted_share": ans.report.tokens_grafted / n, "grid_only_share": (n // C * C) / n,
                         "blocks": len(e.chain), "ttft_graft_s": g, "ttft_recompute_s": r,
                         "ttft_graft_spread_s": [min(graft_s), max(graft_s)],
                         "ttft_recompute_spread_s": [min(recompute_s), max(recompute_s)],
                         "recompute_over_graft": r / g if g else None})
        chat = _two_turn_chat(mem)
        summary = mem.verify()
    return {"bench": "short_memories", "chunk": C, "repeats": repeats, "question": QUESTION,
            "commit": git_commit(), "machine": machine_and_software(), "entries": rows, "chat": chat,
            "verify": {"checked": summary.checked, "bit_identical": summary.bit_identical,
                       "unproven": summary.unproven},
            "min_grafted_share": min(r["grafted_share"] for r in rows)}


def _two_turn_chat(mem) -> dict:
    """Turn 1 short (a few dozen tokens), turn 2 starts with it: what turn 2 reads from the store, each
    call storing its prompt's blocks as the server does (`kvmemory.cache`, on by default there)."""
    from kvmemory.adapters.chat import ChatRequest, run_chat
    from kvmemory.adapters.messages import Message, to_turns
    from kvmemory.adapters.shared import borrow_memory

    shared = borrow_memory(mem)
    first = [Message("user", "My name is Ada and I work on compilers.")]
    one = run_chat(shared, ChatRequest(turns=to_turns(first), max_tokens=8, route=False, store_blocks=True))
    second = first + [Message("assistant", one.text), Message("user", "What do I work on?")]
    two = run_chat(shared, ChatRequest(turns=to_turns(second), max_tokens=8, route=False, store_blocks=True))
    return {"turn1_prompt_tokens": one.stats.prompt_tokens, "turn2_prompt_tokens": two.stats.prompt_tokens,
            "turn2_cached_tokens": two.stats.prompt_grafted}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmemory.bench.short_memories", description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    out = run(repeats=args.repeats, progress=not args.no_progress)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in out["entries"]:
            print(f"{r['entry_tokens']:4d} tokens: grafted {r['grafted']} ({r['grafted_share']:.0%}; grid only "
                  f"{r['grid_only_share']:.0%}), TTFT graft {r['ttft_graft_s'] * 1e3:.1f} ms vs recompute "
                  f"{r['ttft_recompute_s'] * 1e3:.1f} ms")
        c = out["chat"]
        print(f"two-turn chat: turn 1 {c['turn1_prompt_tokens']} tokens; turn 2 read {c['turn2_cached_tokens']} "
              f"of {c['turn2_prompt_tokens']} from the store")
        print(f"verify: {out['verify']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
