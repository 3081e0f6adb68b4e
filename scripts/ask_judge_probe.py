"""Can the model itself tell a rewording from another ask? (issue 48, item 2: "the model judging the pair")

For the first N problems of the calibration set, the model is asked whether a rewording (the "words" one)
and the other ask (bench/rewordings_other_asks.CALIBRATION) ask for the same quantity as the stored
problem; the score is log P(yes) - log P(no) (`Engine.choose` over " yes"/" no", either capitalisation).
A usable judge puts every rewording above every other ask: the AUC (1.0 perfect, 0.5 chance) says how
far from that it is. Two prompts: "pair" (both questions whole) and "asks" (the situation once, then the
two ask sentences).

    .venv/bin/python scripts/ask_judge_probe.py --model embedded:qwen2.5-coder-1.5b-instruct --n 20 --prompt pair

Prints one JSON object: the scores and the AUC. A measurement for the record, not part of `answer`.
"""

from __future__ import annotations

import argparse
import json

from kvmemory.bench import rewordings_calibration as calibration
from kvmemory.bench import rewordings_other_asks as other_asks
from kvmemory.engine.engine import Engine
from kvmemory.memory.asks import _ask_sentence


def _message(prompt: str, question: str, problem: str) -> str:
    if prompt == "pair":
        return (f"Question A: {problem}\nQuestion B: {question}\nDo question A and question B ask for the same "
                "number, so that they have the same answer? Reply yes or no.")
    text = " ".join(problem.split())
    ask = _ask_sentence(text)
    situation = text[: text.rfind(ask)].strip()
    return (f"{situation}\n\nQuestion 1: {ask}\nQuestion 2: {_ask_sentence(' '.join(question.split()))}\n\n"
            "Is Question 2 asking for exactly the same quantity as Question 1? Answer yes or no.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=20, help="problems of the calibration set (default 20)")
    ap.add_argument("--prompt", choices=["pair", "asks"], default="pair")
    args = ap.parse_args()
    eng = Engine.open(args.model)
    tok = eng.tokenizer

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    answers = [ids(w) for w in ("yes", "no", "Yes", "No")]

    def judge(question: str, problem: str) -> float:
        chat = [{"role": "user", "content": _message(args.prompt, question, problem)}]
        prompt = ids(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        _, s, _ = eng.choose(prompt, answers, graft=False)
        return max(s[0], s[2]) - max(s[1], s[3])

    problems = calibration.PROBLEMS[: args.n]
    rewordings = [judge(p[3]["words"], p[0]) for p in problems]
    others = [judge(q, calibration.PROBLEMS[i][0]) for i, q, _ in other_asks.CALIBRATION[: args.n]]
    pairs = [(r > o) + 0.5 * (r == o) for r in rewordings for o in others]
    print(json.dumps({"model": args.model, "prompt": args.prompt, "n": args.n, "auc": round(sum(pairs) / len(pairs), 3),
                      "rewordings": rewordings, "other_asks": others}, indent=1))


if __name__ == "__main__":
    main()
