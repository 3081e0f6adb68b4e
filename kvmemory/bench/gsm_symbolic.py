"""Math word problems nobody at kvmemory wrote: GSM-Symbolic, as shipped by the `reasoning-gym` package.

GSM-Symbolic (Mirzadeh et al., 2024) turned GSM8K test problems into templates whose names and numbers
are drawn at random; `reasoning-gym` (Apache-2.0, on PyPI) ships 100 of them as Python generators,
each giving a question, its GSM8K-style worked solution ("... #### answer") and the exact answer.
Nothing is downloaded: the templates are code inside the wheel (`pip install kvmemory[datasets]`).

`load_problems(n, seed)` takes `n` distinct templates (those reasoning-gym marks as correct) and draws
one problem from each: the original that memory will hold. Each comes with a **sibling**: the same
template drawn again with other numbers and another answer, the question memory must *not* answer
with the original's solution. `draw_solutions(n, seed)` draws `n` problems from all usable templates
in turn (several per template when `n` is larger than their number): the verifier bench's material.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

from kvmemory.errors import KVMemoryError
from kvmemory.memory.verifiers import extract_value, numbers_in

NAME = "gsm-symbolic"
SOURCE = "reasoning-gym gsm_symbolic (GSM-Symbolic templates of GSM8K test problems)"
# Draws tried per sibling before giving up on one whose answer and numbers differ from the original's.
_SIBLING_TRIES = 50


@dataclass(frozen=True, slots=True)
class OutsideProblem:
    id: str  # "<template>:<seed>"
    template: int
    question: str
    solution: str  # the dataset's worked solution, ending "#### <answer>"
    answer: str  # as the dataset writes it
    value: Fraction  # the answer's exact value


@dataclass(frozen=True, slots=True)
class ProblemPair:
    original: OutsideProblem
    sibling: OutsideProblem  # same template, other numbers, another answer


def _generators() -> tuple[dict, list[int]]:
    try:
        import reasoning_gym
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok
    except ImportError as e:
        raise KVMemoryError("the gsm-symbolic dataset comes from the reasoning-gym package: "
                            "pip install 'kvmemory[datasets]' (or reasoning-gym)") from e
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=1, seed=0)
    return ds.generators, list(tasks_ok)


def _draw(gen, template: int, seed: int) -> OutsideProblem:
    x = gen(random.Random(seed))
    value = Fraction(str(x["metadata"]["answer_value"]))
    solution = x["metadata"]["answer_cot"]
    # The worked solution must end in the stated answer, or it is not a verified solution to store.
    if extract_value(solution) != value:
        raise KVMemoryError(f"gsm-symbolic template {template} seed {seed}: its worked solution does not "
                            f"end in its answer {x['answer']}")
    return OutsideProblem(f"{template}:{seed}", template, x["question"], solution, str(x["answer"]), value)


def load_problems(n: int, seed: int = 0) -> list[ProblemPair]:
    """`n` originals from distinct templates, each with a sibling (other numbers, another answer)."""
    generators, ok = _generators()
    if not 1 <= n <= len(ok):
        raise KVMemoryError(f"gsm-symbolic has {len(ok)} usable templates; asked for {n}")
    rng = random.Random(seed)
    pairs = []
    for template in rng.sample(ok, n):
        gen = generators[template]
        draw_seed = rng.randrange(1 << 30)
        original = _draw(gen, template, draw_seed)
        for i in range(1, _SIBLING_TRIES + 1):
            sibling = _draw(gen, template, draw_seed + i)
            if sibling.value != original.value and sorted(numbers_in(sibling.question)) != sorted(numbers_in(original.question)):
                break
        else:
            continue  # a template whose draws all give the same answer has no sibling: left out
        pairs.append(ProblemPair(original, sibling))
    return pairs


def draw_solutions(n: int, seed: int = 0) -> list[OutsideProblem]:
    """`n` problems with their worked solutions, drawn from the usable templates in a seeded order,
    round after round (so `n` may exceed the 85 templates); every draw has its own seed."""
    generators, ok = _generators()
    if n < 1:
        raise KVMemoryError(f"asked for {n} gsm-symbolic problems")
    rng = random.Random(seed)
    out: list[OutsideProblem] = []
    while len(out) < n:
        for template in rng.sample(ok, len(ok))[: n - len(out)]:
            out.append(_draw(generators[template], template, rng.randrange(1 << 30)))
    return out
