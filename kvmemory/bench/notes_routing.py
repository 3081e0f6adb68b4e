"""How questions about facts score against the facts' statements: where `memory/notes.NOTE_THRESHOLDS`
comes from.

A note holds a statement ("Alice has a cat named Tom."); it is asked about with a question ("What pet
does Alice have?"), which is not a rewording of it and scores lower than a rewording scores against a
stored problem. `measure` embeds 24 hand-written (fact, question) pairs and reports, for each question,
the score of its own fact and the best score among the other 23 facts (what would route when its fact is
not stored), plus generic questions against every fact.

Run as `python -m kvmemory.bench.notes_routing [--embedder NAME] [--threshold T]`; prints JSON.
all-MiniLM-L6-v2: own fact 0.546-0.897 (median 0.743; 22 of 24 below the 0.83 that routes solutions);
best other fact 0.109-0.649 (the highest three 0.530, 0.533, 0.649: the last is another fact about the
same person, "What pet does Alice have?" against Alice's food); generic questions at most 0.347; the top
hit is the question's own fact for all 24. Hence 0.54: all 24 questions route to their fact, 1 of 24
would route to another fact when its own is not stored, and no generic question routes. A small,
hand-written set: the figure is a measured starting point, not a guarantee.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

PAIRS: list[tuple[str, str]] = [
    ("Alice has a cat named Tom.", "What pet does Alice have?"),
    ("Alice likes tea.", "What does Alice like to drink?"),
    ("Bob lives in Paris.", "Where does Bob live?"),
    ("My favourite colour is green.", "What is my favourite colour?"),
    ("I am allergic to peanuts.", "Do I have any allergies?"),
    ("Carol works as a nurse at the city hospital.", "What is Carol's job?"),
    ("The project deadline is March 3.", "When is the project due?"),
    ("Dave's birthday is on June 12.", "When is Dave's birthday?"),
    ("I prefer window seats on flights.", "Which seat do I like on planes?"),
    ("Eve speaks French and German.", "What languages does Eve speak?"),
    ("The wifi password is hunter2.", "What's the wifi password?"),
    ("My daughter plays the violin.", "What instrument does my daughter play?"),
    ("Frank drives a red Toyota.", "What car does Frank drive?"),
    ("I am vegetarian.", "Do I eat meat?"),
    ("Grace's phone number is 555-0101.", "What is Grace's phone number?"),
    ("The meeting room is on the third floor.", "Where is the meeting room?"),
    ("Henry is afraid of spiders.", "What is Henry scared of?"),
    ("I usually wake up at 6 am.", "What time do I get up?"),
    ("Ivy studied physics at MIT.", "Where did Ivy go to university?"),
    ("Our dog Rex is five years old.", "How old is Rex?"),
    ("Alice loves spicy ramen and hates olives.", "What food does Alice dislike?"),
    ("Jack's favourite football team is Arsenal.", "Which team does Jack support?"),
    ("The server runs Ubuntu 22.04.", "What OS is on the server?"),
    ("I take my coffee black.", "How do I like my coffee?"),
]
GENERIC = ["What is the capital of France?", "How many eggs are left if Tom had 12 and ate 3?",
           "Explain quantum entanglement.", "Write a poem about the sea.", "What is 1234 * 56?"]


def measure(embedder=None, threshold: float = 0.54) -> dict:
    """Scores of `PAIRS` and `GENERIC` with `embedder` (anything `KVMemory(embedder=...)` takes; None:
    all-MiniLM-L6-v2), and how many route at `threshold`."""
    from kvmemory.routing.embedders import resolve_embedder

    emb = resolve_embedder(embedder or "minilm")
    facts = np.asarray(emb.embed([f for f, _ in PAIRS]), dtype=np.float64)
    questions = np.asarray(emb.embed([q for _, q in PAIRS]), dtype=np.float64)
    generic = np.asarray(emb.embed(GENERIC), dtype=np.float64)
    s = questions @ facts.T
    own = np.diag(s)
    other = np.where(np.eye(len(PAIRS), dtype=bool), -np.inf, s).max(axis=1)
    gen = (generic @ facts.T).max(axis=1)
    return {
        "embedder": emb.name, "pairs": len(PAIRS), "threshold": threshold,
        "own_fact": {"min": round(float(own.min()), 3), "median": round(float(np.median(own)), 3),
                     "max": round(float(own.max()), 3), "routed": int((own >= threshold).sum())},
        "best_other_fact": {"min": round(float(other.min()), 3), "max": round(float(other.max()), 3),
                            "routed": int((other >= threshold).sum())},
        "generic_best": round(float(gen.max()), 3),
        "top1_is_own_fact": int((s.argmax(axis=1) == np.arange(len(PAIRS))).sum()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmemory.bench.notes_routing", description=__doc__.splitlines()[0])
    p.add_argument("--embedder", default=None)
    p.add_argument("--threshold", type=float, default=0.54)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.embedder, a.threshold), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
