"""Hit rate and MRR of `KVMemoryRetriever` on kvmemory's recurring-problems set, by LlamaIndex's own
`RetrieverEvaluator`.

The set (`kvmemory.generate_problems`) is seeded: each problem's worked solution is
remembered (it must pass the arithmetic verifier), and each of its rewordings, which the store never
saw verbatim, is a query whose one expected id is that problem's entry id.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvmemory import KVMemory, generate_problems
from llama_index.core.evaluation import RetrieverEvaluator

from .base import KVMemoryRetriever

METRICS = ("hit_rate", "mrr")


@dataclass(slots=True)
class RecurringEval:
    """Mean metrics over all queries, and each query's own result."""

    hit_rate: float
    mrr: float
    queries: int
    problems: int
    per_query: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"hit_rate": self.hit_rate, "mrr": self.mrr, "queries": self.queries, "problems": self.problems}


def remember_recurring(memory: KVMemory, n: int = 10, seed: int = 0, rewordings: int = 2,
                       namespace: str | None = None) -> list[tuple[str, list[str]]]:
    """Remember `n` seeded problems; return (entry id, rewordings) per problem."""
    out = []
    for p in generate_problems(n, seed, rewordings=rewordings):
        entry = memory.remember(p.text, p.solution, str(p.answer), verifier="arithmetic", namespace=namespace)
        out.append((entry.id, list(p.rewordings)))
    return out


async def aevaluate_retriever(retriever: KVMemoryRetriever, cases: list[tuple[str, list[str]]]) -> RecurringEval:
    """Run `RetrieverEvaluator` (hit rate, MRR) over (expected entry id, queries) cases."""
    evaluator = RetrieverEvaluator.from_metric_names(list(METRICS), retriever=retriever)
    per_query = []
    for entry_id, queries in cases:
        for q in queries:
            # One query at a time: the retriever already runs in a worker thread, and the router's
            # embedder gains nothing from concurrent calls on two cores.
            try:
                res = await evaluator.aevaluate(query=q, expected_ids=[entry_id])
            except ValueError:
                # LlamaIndex's metrics refuse an empty retrieval; here that means no entry scored above
                # the router's threshold, which is a miss (hit 0, reciprocal rank 0), not an error.
                if await retriever.aretrieve(q):
                    raise
                per_query.append({"query": q, "expected": entry_id, "retrieved": [], **dict.fromkeys(METRICS, 0.0)})
                continue
            per_query.append({"query": q, "expected": entry_id, "retrieved": list(res.retrieved_ids),
                              **{k: float(v.score) for k, v in res.metric_dict.items()}})
    n = len(per_query)
    mean = {m: (sum(r[m] for r in per_query) / n if n else 0.0) for m in METRICS}
    return RecurringEval(hit_rate=mean["hit_rate"], mrr=mean["mrr"], queries=n, problems=len(cases),
                         per_query=per_query)


def evaluate_recurring(memory: KVMemory, n: int = 10, seed: int = 0, rewordings: int = 2,
                       namespace: str | None = None, similarity_top_k: int = 5,
                       cases: list[tuple[str, list[str]]] | None = None) -> RecurringEval:
    """Remember the recurring-problems set (unless `cases` are given) and evaluate the retriever on it."""
    if cases is None:
        cases = remember_recurring(memory, n, seed, rewordings, namespace)
    retriever = KVMemoryRetriever(memory, similarity_top_k=similarity_top_k, namespace=namespace)
    return asyncio.run(aevaluate_retriever(retriever, cases))
