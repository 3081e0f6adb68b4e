"""`kvmemory bench rewordings` (kvmemory/cli.py parses its options): does `answer` find natural rewordings?

Two hand-written sets, by different authors (bench/rewordings_calibration.py, bench/rewordings_heldout.py):
40 stored problems each, every problem with three rewordings of the same problem and numbers
("words": numbers as words; "units": notation, units and symbols; "reordered": clauses reordered),
a sibling (one number changed: the stored answer is wrong for it) and 100 unrelated questions.
Routing thresholds are calibrated on the calibration set only (`--calibrate`); the report set is
what the figures in BENCHMARKS.md ("Routing rewordings") come from.

The bench stores each problem with its own worked solution (`remember`, default verifier: the
solution must conclude with the given answer), then asks every question as an agent does:
`answer(q, answer_prefix="The answer is", choices="numbers")`, and reports

- rewordings: routed to their own entry (the first entry used), answered right (the value the
  answer gives equals the stored answer), per kind and overall;
- unrelated questions: routed to any entry (should be none);
- siblings: routed to the original's entry, and answered with the original's stored answer through
  memory (a leak: must be 0); siblings that got the original's answer with no memory are counted
  beside it (the model's own decode landing on that number);
- other asks (bench/rewordings_other_asks.py, a third author): the same numbers as a stored problem,
  asking for another quantity: routed to the entry (the number check cannot tell them apart), answered
  with the stored answer through memory (wrong for them; and beside it without memory), answered right.

Each rewording, sibling and unrelated question is also routed as `chat` routes a one-message
conversation (no decode): the figure for the server's chat completions and the framework chat models,
where a routed entry is a worked example in the conversation, so other numbers refuse nothing there.

A question no entry routes to is answered by the model alone (free decode, `--budget` tokens; one token
for unrelated questions, whose route alone is scored).
"""

from __future__ import annotations

import math
import re
import time
from fractions import Fraction

from tqdm import tqdm

ANSWER_PREFIX = "The answer is"
KINDS = ("words", "units", "reordered")
SETS = ("report", "calibration", "fresh", "fresh2")


def load_set(which: str):
    """What holds PROBLEMS and UNRELATED for `which` ("report", "calibration", or "fresh" / "fresh2": the
    asks sets written apart from the ask check, `fresh_set`)."""
    from kvmemory.errors import InvalidInput

    if which == "report":
        from kvmemory.bench import rewordings_heldout as s
    elif which == "calibration":
        from kvmemory.bench import rewordings_calibration as s
    elif which in ("fresh", "fresh2"):
        return fresh_set(f"data/asks_{which}.json")
    else:
        raise InvalidInput(f"set must be one of {SETS}, got {which!r}")
    return s


def fresh_set(path: str = "data/asks_fresh.json"):
    """bench/data/asks_fresh.json (issue 48, item 2: written by an author who saw neither the ask check,
    memory/asks.py, nor the other sets, after the check's rules were fixed) or asks_fresh2.json (a second
    such author, a day later, after the rules had been revised with the first set in view): 40 problems
    with three rewordings each (words, units, reordered) and one other ask each; no siblings, no
    unrelated questions."""
    import json
    from importlib import resources
    from types import SimpleNamespace

    data = json.loads(resources.files("kvmemory.bench").joinpath(path).read_text("utf-8"))
    problems = [(p["problem"], p["solution"], p["answer"], dict(zip(KINDS, p["rewordings"])), None)
                for p in data["problems"]]
    other = [(i, p["other_ask"]["question"], p["other_ask"]["answer"]) for i, p in enumerate(data["problems"])]
    return SimpleNamespace(__name__=f"kvmemory/bench/{path}", PROBLEMS=problems, UNRELATED=[],
                           OTHER_ASKS=other)


def _value(text: str) -> Fraction | None:
    from kvmemory.memory.verifiers import extract_value

    return extract_value(text)


def run_rewordings_bench(mem=None, *, which: str = "report", problems: int | None = None, unrelated: int | None = None,
                         budget: int = 12, prior: float | None = None, chat_siblings: int = 0,
                         progress: bool = True, ask_check: bool = True, chat_answers: int = 0,
                         chat_recurrence: bool = True) -> dict:
    """Run the bench on `mem` (a KVMemory; a temporary one on the embedded model by default). `problems`
    and `unrelated` take the first ones of the set only (a quick look; the figures use the whole set).
    `prior`: `answer`'s (default: its own default). `chat_siblings` > 0: each sibling is also answered by
    `chat` with that many tokens, routed and not (`_chat_siblings`). `ask_check`: `answer`'s (False: a
    routed entry's stored answer is offered whatever the question asks, as before issue 48's item 2).
    `chat_answers` > 0: every rewording and other ask is also answered by `chat` (`_chat_answers`)."""
    import tempfile

    from kvmemory.bench import rewordings_other_asks
    from kvmemory.memory.answers import OTHER_ASK, OTHER_ASK_NO_CHOICES
    from kvmemory.memory.facade import DEFAULT_CONTRAST, DEFAULT_PRIOR, KVMemory
    from kvmemory.memory.inputs import check_prior

    prior = DEFAULT_PRIOR if prior is None else check_prior(prior)
    s = load_set(which)
    probs = s.PROBLEMS[:problems] if problems is not None else s.PROBLEMS
    others = s.UNRELATED[:unrelated] if unrelated is not None else s.UNRELATED
    tmp = None
    if mem is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvmemory-bench-")
        mem = KVMemory(store=f"{tmp.name}/store", namespace=f"bench-rewordings-{which}")
    t0 = time.perf_counter()
    try:
        bar = dict(disable=not progress)
        entry_of = []
        # A store given with the entries already in it (same texts, this namespace) is reused as it is.
        have = {(e.problem, e.solution, e.answer): e.id for e in mem.store.list_entries(mem.namespace)}
        for problem, solution, answer, _, _ in tqdm(probs, desc="remembering", unit="problem", **bar):
            eid = have.get((problem, solution, answer))
            entry_of.append(eid or mem.remember(problem, solution, answer=answer).id)

        def ask(q: str, tokens: int = budget):
            return mem.answer(q, answer_prefix=ANSWER_PREFIX, choices="numbers", max_new_tokens=tokens, stop=["\n"],
                              nothing_to_choose="decode", prior=prior, ask_check=ask_check)

        def chat_route(q: str) -> str | None:
            """The entry `chat` routes a one-message conversation to (what the server and the framework
            chat models graft), without decoding."""
            hits = mem.chat_prompt([{"role": "user", "content": q}]).hits
            return hits[0].entry.id if hits else None

        kinds = {k: {"questions": 0, "routed_right": 0, "answered_right": 0, "used_memory": 0, "routed_in_chat": 0,
                     "taken_as_other_ask": 0} for k in KINDS}
        failures: list[dict] = []
        siblings = {"questions": 0, "routed_to_original": 0, "leaks": 0, "given_original_answer_without_memory": 0,
                    "answered_right": 0, "routed_to_original_in_chat": 0}
        leaks: list[dict] = []
        questions = [(i, k, p[3][k]) for i, p in enumerate(probs) for k in KINDS] + \
                    [(i, "sibling", p[4][0]) for i, p in enumerate(probs) if p[4] is not None]
        for i, kind, q in tqdm(questions, desc="rewordings and siblings", unit="question", **bar):
            problem, _, answer, _, sibling = probs[i]
            ans = ask(q)
            got = _value(ans.text)
            first = ans.entries[0] if ans.entries else None
            if kind == "sibling":
                siblings["questions"] += 1
                on_original = entry_of[i] in ans.entries
                siblings["routed_to_original"] += int(on_original)
                siblings["answered_right"] += int(got == Fraction(sibling[1]))
                siblings["routed_to_original_in_chat"] += int(chat_route(q) == entry_of[i])
                if got == Fraction(answer):
                    if on_original:
                        siblings["leaks"] += 1
                        leaks.append({"question": q, "answer": ans.text, "stored_answer": answer,
                                      "sibling_answer": sibling[1], "scores": ans.scores})
                    elif not ans.entries:
                        siblings["given_original_answer_without_memory"] += 1
                continue
            k = kinds[kind]
            k["questions"] += 1
            k["used_memory"] += int(bool(ans.entries))
            right_route = first == entry_of[i]
            right = got == Fraction(answer)
            k["routed_right"] += int(right_route)
            k["routed_in_chat"] += int(chat_route(q) == entry_of[i])
            k["answered_right"] += int(right)
            k["taken_as_other_ask"] += int(ans.outcome in (OTHER_ASK, OTHER_ASK_NO_CHOICES))
            if not (right_route and right):
                failures.append({"kind": kind, "question": q, "problem": problem, "expected": answer,
                                 "answer": ans.text, "routed": right_route, "entries": ans.entries,
                                 "scores": [round(x, 4) for x in ans.scores],
                                 "refused": ans.refused, "outcome": ans.outcome, "reason": ans.reason})
        other = {"questions": 0, "routed_to_entry": 0, "given_stored_answer": 0,
                 "given_stored_answer_without_memory": 0, "answered_right": 0, "taken_as_other_ask": 0,
                 "answered_from_working": 0, "answered_from_working_right": 0, "nothing_answered": 0}
        other_details = []
        asks = [a for a in getattr(s, "OTHER_ASKS", None) or getattr(rewordings_other_asks, which.upper())
                if a[0] < len(probs)]
        for i, q, right_answer in tqdm(asks, desc="other asks", unit="question", **bar):
            ans = ask(q)
            got = _value(ans.text)
            other["questions"] += 1
            on_entry = entry_of[i] in ans.entries
            other["routed_to_entry"] += int(on_entry)
            stored = got == Fraction(probs[i][2])
            other["given_stored_answer"] += int(stored and on_entry)
            other["given_stored_answer_without_memory"] += int(stored and not ans.entries)
            other["answered_right"] += int(got == Fraction(right_answer))
            other["taken_as_other_ask"] += int(ans.outcome in (OTHER_ASK, OTHER_ASK_NO_CHOICES))
            other["answered_from_working"] += int(ans.outcome == OTHER_ASK)
            other["answered_from_working_right"] += int(ans.outcome == OTHER_ASK and got == Fraction(right_answer))
            other["nothing_answered"] += int(ans.outcome == OTHER_ASK_NO_CHOICES)
            other_details.append({"question": q, "expected": right_answer, "stored_answer": probs[i][2],
                                  "answer": ans.text, "entries": ans.entries, "outcome": ans.outcome,
                                  "reason": ans.reason})
        routed_unrelated = []
        unrelated_in_chat = 0
        for q in tqdm(others, desc="unrelated questions", unit="question", **bar):
            unrelated_in_chat += int(chat_route(q) is not None)
            ans = ask(q, 1)  # only the route is scored: one token decoded when none is found
            if ans.entries:
                routed_unrelated.append({"question": q, "entries": ans.entries,
                                         "scores": [round(x, 4) for x in ans.scores]})
        total = {key: sum(k[key] for k in kinds.values()) for key in ("questions", "routed_right", "answered_right",
                                                                       "used_memory", "routed_in_chat",
                                                                       "taken_as_other_ask")}
        n = max(total["questions"], 1)
        router = mem.router
        return {
            "bench": "rewordings", "set": which, "source": s.__name__,
            "model": mem.engine.loaded.source, "profile_id": mem.engine.profile_id,
            "embedder": router.embedder.name, "threshold": router.threshold,
            "number_threshold": getattr(router, "number_threshold", None),
            "answer": f'answer(q, answer_prefix="{ANSWER_PREFIX}", choices="numbers", max_new_tokens={budget}, '
                      f'prior={prior:g})',
            "contrast": DEFAULT_CONTRAST, "prior": prior, "ask_check": ask_check,
            "problems": len(probs),
            "rewordings": {**total, "recall": total["routed_right"] / n, "accuracy": total["answered_right"] / n,
                           "used_memory_rate": total["used_memory"] / n},
            "kinds": {name: {**k, "recall": k["routed_right"] / max(k["questions"], 1),
                             "accuracy": k["answered_right"] / max(k["questions"], 1)} for name, k in kinds.items()},
            "chat": "chat([{'role': 'user', 'content': q}]): routed with the same numbers lifting (memory/routing.py "
                    "LIFT), other numbers refusing nothing",
            "unrelated": {"questions": len(others), "routed": len(routed_unrelated), "routed_in_chat": unrelated_in_chat,
                          "routed_rate": len(routed_unrelated) / max(len(others), 1), "details": routed_unrelated},
            "siblings": {**siblings, "leak_details": leaks},
            "other_asks": {**other, "details": other_details},
            **({"chat_siblings": _chat_siblings(mem, probs, entry_of, chat_siblings, bar)} if chat_siblings else {}),
            **({"chat_answers": _chat_answers(mem, probs, asks, chat_answers, bar, chat_recurrence)} if chat_answers else {}),
            "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1),
        }
    finally:
        if tmp is not None:
            tmp.cleanup()


def calibrate(which: str = "calibration", embedder=None, *, progress: bool = False) -> dict:
    """Embedding scores on a set (no model, no store): for each rewording its own problem's score and
    rank, each sibling's score against its original, and each unrelated question's best score.

    `number_threshold` is the calibration rule for the gate that `answer` applies to an entry whose
    problem writes the same numbers as the question (memory/routing.py): the best score any unrelated
    question of the set reaches against any stored problem, rounded up to 0.01, so that the topic must
    still be nearer than every unrelated question was; the numbers then tell the problem from its
    siblings. Run it on the calibration set only."""
    import numpy as np

    from kvmemory.memory.quantities import question_numbers
    from kvmemory.routing.embedders import resolve_embedder

    s = load_set(which)
    emb = resolve_embedder(embedder)
    stored = [p[0] for p in s.PROBLEMS]
    P = emb.embed(stored, progress=progress)
    out: dict = {"set": which, "embedder": emb.name, "kinds": {}}
    for kind in KINDS:
        Q = emb.embed([p[3][kind] for p in s.PROBLEMS])
        sc = Q @ P.T
        own = np.diag(sc)
        same = [question_numbers(p[3][kind]) == question_numbers(p[0]) for p in s.PROBLEMS]
        out["kinds"][kind] = {"top1": float(np.mean(sc.argmax(1) == np.arange(len(stored)))),
                              "own_score_min": float(own.min()), "own_score_p10": float(np.percentile(own, 10)),
                              "numbers_agree": float(np.mean(same)),
                              "numbers_disagree": [p[3][kind] for p, ok in zip(s.PROBLEMS, same) if not ok]}
    sib = np.array([float(emb.embed([p[4][0]])[0] @ P[i]) for i, p in enumerate(s.PROBLEMS)])
    out["siblings"] = {"score_min": float(sib.min()),
                       "numbers_agree": sum(question_numbers(p[4][0]) == question_numbers(p[0]) for p in s.PROBLEMS)}
    U = emb.embed(list(s.UNRELATED))
    best = (U @ P.T).max(1)
    out["unrelated"] = {"best_score_max": float(best.max()), "best_score_p99": float(np.percentile(best, 99)),
                        "same_numbers_as_a_stored_problem": sum(
                            any(question_numbers(u) == question_numbers(p) and question_numbers(u) for p in stored)
                            for u in s.UNRELATED)}
    out["number_threshold"] = math.ceil(float(best.max()) * 100) / 100
    return out


def _last_value(text: str) -> Fraction | None:
    """The last number a free-decoded reply writes (its conclusion, as a reader would take it)."""
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return Fraction(nums[-1].replace(",", "")) if nums else None


def _chat_siblings(mem, probs, entry_of, tokens: int, bar: dict) -> dict:
    """Siblings in `chat`: routed there to their original's entry (a worked example with other numbers),
    does the reply give the stored answer (wrong for them) or their own? Against the same chat unrouted."""
    out = {"tokens": tokens, "questions": len(probs)}
    for mode in ("routed", "alone"):
        out[mode] = {"used_the_original": 0, "gave_the_stored_answer": 0, "answered_right": 0}
    for i, (_, _, answer, _, sib) in enumerate(tqdm(probs, desc="siblings in chat", unit="question", **bar)):
        if sib is None:  # a set without siblings (fresh)
            continue
        sibling, sib_answer = sib
        for mode in ("routed", "alone"):
            ans = mem.chat([{"role": "user", "content": sibling}], route=mode == "routed", max_new_tokens=tokens)
            got = _last_value(ans.text)
            row = out[mode]
            row["used_the_original"] += int(entry_of[i] in ans.entries)
            row["gave_the_stored_answer"] += int(got == Fraction(answer))
            row["answered_right"] += int(got == Fraction(sib_answer))
    return out


def _chat_answers(mem, probs, asks, tokens: int, bar: dict, recurrence: bool = True) -> dict:
    """Every rewording and other ask answered by `chat` (a one-message conversation, `tokens` tokens of
    free decode where the reply is not a recurrence's: memory/recurrence.py), read as its last number:
    right, the stored answer (wrong for an other ask), and answered from the verified solution.
    `recurrence=False`: every reply decoded freely, the routed entry grafted (`chat(recurrence=False)`)."""
    out = {"tokens": tokens, "recurrence": recurrence, "rewordings": {"questions": 0, "answered_right": 0, "from_verified_solution": 0},
           "other_asks": {"questions": 0, "answered_right": 0, "given_stored_answer": 0,
                          "from_verified_solution": 0}}
    questions = [("rewordings", p[3][k], p[2], p[2]) for p in probs for k in KINDS] + \
                [("other_asks", q, right, probs[i][2]) for i, q, right in asks]
    for kind, q, right, stored in tqdm(questions, desc="chat answers", unit="question", **bar):
        ans = mem.chat([{"role": "user", "content": q}], max_new_tokens=tokens, recurrence=recurrence)
        got = _last_value(ans.text)
        row = out[kind]
        row["questions"] += 1
        row["answered_right"] += int(got == Fraction(right))
        row["from_verified_solution"] += int(bool(ans.choices))
        if kind == "other_asks":
            row["given_stored_answer"] += int(got == Fraction(stored))
    return out


def format_table(r: dict) -> str:
    lines = [f"set: {r['set']} ({r['problems']} problems); embedder {r['embedder']}, threshold {r['threshold']}, "
             f"number threshold {r['number_threshold']}; choices contrast {r['contrast']:g}, prior {r['prior']:g}", "",
             "| rewording | questions | routed to its entry | answered right | used memory | chat: routed to its entry |",
             "|---|---|---|---|---|---|"]
    for name, k in [*r["kinds"].items(), ("all", r["rewordings"])]:
        n = max(k["questions"], 1)
        lines.append(f"| {name} | {k['questions']} | {k['routed_right']} ({k['routed_right'] / n:.1%}) "
                     f"| {k['answered_right']} ({k['answered_right'] / n:.1%}) | {k['used_memory']} "
                     f"| {k['routed_in_chat']} ({k['routed_in_chat'] / n:.1%}) |")
    u, s = r["unrelated"], r["siblings"]
    lines += ["", f"unrelated questions routed: {u['routed']} of {u['questions']} ({u['routed_rate']:.1%}); "
                  f"in chat: {u['routed_in_chat']}",
              f"siblings routed to the original's entry in chat (a worked example there, not the answer): "
              f"{s['routed_to_original_in_chat']} of {s['questions']}",
              f"siblings routed to the original's entry: {s['routed_to_original']} of {s['questions']}; answered with "
              f"the stored answer through memory: {s['leaks']}; with it without memory: "
              f"{s['given_original_answer_without_memory']}; answered right: {s['answered_right']}",
              f"other asks (same numbers, another quantity): {r['other_asks']['routed_to_entry']} of "
              f"{r['other_asks']['questions']} routed to the entry; given the stored answer (wrong) through memory: "
              f"{r['other_asks']['given_stored_answer']}, without memory: "
              f"{r['other_asks']['given_stored_answer_without_memory']}; answered right: "
              f"{r['other_asks']['answered_right']}; taken as another ask: {r['other_asks']['taken_as_other_ask']} "
              f"(answered from the working: {r['other_asks']['answered_from_working']}, right: "
              f"{r['other_asks']['answered_from_working_right']}; nothing answered: "
              f"{r['other_asks']['nothing_answered']})",
              f"rewordings taken as another ask (wrongly): {r['rewordings']['taken_as_other_ask']} of "
              f"{r['rewordings']['questions']}",
              f"{r['seconds']} s"]
    if "chat_answers" in r:
        c = r["chat_answers"]
        rw, oa = c["rewordings"], c["other_asks"]
        lines[-1:-1] = [f"chat ({c['tokens']} tokens{'' if c['recurrence'] else ', free decoding'}): rewordings answered right {rw['answered_right']} of "
                        f"{rw['questions']} ({rw['from_verified_solution']} from the verified solution); other asks "
                        f"answered right {oa['answered_right']} of {oa['questions']}, given the stored answer "
                        f"{oa['given_stored_answer']}"]
    if "chat_siblings" in r:
        c = r["chat_siblings"]
        lines[-1:-1] = [f"siblings in chat ({c['tokens']} tokens), routed / alone: used the original's entry "
                        f"{c['routed']['used_the_original']} / {c['alone']['used_the_original']}; gave the stored "
                        f"answer {c['routed']['gave_the_stored_answer']} / {c['alone']['gave_the_stored_answer']}; "
                        f"answered right {c['routed']['answered_right']} / {c['alone']['answered_right']} "
                        f"of {c['questions']}"]
    return "\n".join(lines)
