"""Agent tools over kvmemory: remember a verified solution, recall stored ones with their provenance.

`remember_solution` runs kvmemory's verifier before anything is stored ("arithmetic" by default:
every equation of the solution is re-computed and the answer must follow), so an agent can only add
solutions that check out; a refusal comes back to the agent as the tool's error text. `recall_solution`
returns the stored solutions closest to a question, each with its entry id, score, verified flag and
attestation id (the same fields as `KVMemoryRetriever`'s Document metadata, which is the artifact).
"""

from __future__ import annotations

import json

from langchain_core.tools import BaseTool, StructuredTool, ToolException
from pydantic import BaseModel, Field

from kvmemory import (DEFAULT_MODEL, InvalidInput, KVMemory, VerificationFailed, borrow_memory, env_store, resolve_device,
                      resolve_dtype)

from .retrievers import KVMemoryRetriever


class RememberSolution(BaseModel):
    """A solved problem to keep: it is verified first, then stored with its exact KV cache."""

    problem: str = Field(description="The problem as it was asked.")
    solution: str = Field(description="The worked solution, one equation per step, e.g. '3 * 12 = 36'.")
    answer: str = Field(description="The final answer, e.g. '31'.")


class RecallSolution(BaseModel):
    """A question to look up among stored verified solutions."""

    query: str = Field(description="The question to look up, copied word for word from the user.")


def create_remember_tool(*, memory: KVMemory | None = None, store: str | None = None, model: str = DEFAULT_MODEL,
                         namespace: str = "default", verifier: str = "arithmetic",
                         name: str = "remember_solution", device: str = "auto", dtype: str = "auto") -> BaseTool:
    """A tool that verifies a solution and stores it (content: a short receipt; artifact: the entry's
    id, namespace, verified flag and attestation id). `device` / `dtype`: where and in what `model`
    runs when the tool opens it (as `ChatKVGraft`'s)."""
    store = store or env_store()
    if memory is None:  # a device that is not here is refused now, not at the first call
        resolve_dtype(dtype, resolve_device(device, model=model))

    def remember(problem: str, solution: str, answer: str) -> tuple[str, dict]:
        sm = borrow_memory(memory, model, store, device=device, dtype=dtype)
        try:
            with sm.lock:
                entry = sm.memory.remember(problem, solution, answer, verifier=verifier, namespace=namespace)
        except (VerificationFailed, InvalidInput) as exc:
            raise ToolException(f"not stored: {exc}") from exc
        receipt = {"entry_id": entry.id, "namespace": entry.namespace, "verified": entry.verified,
                   "attestation_id": entry.attestation.get("attestation_id"), "answer": entry.answer}
        return f"Stored verified solution {entry.id} (answer {entry.answer}).", receipt

    return StructuredTool.from_function(
        func=remember, name=name, args_schema=RememberSolution, response_format="content_and_artifact",
        handle_tool_error=True,
        description="Store a solved problem for later. The solution is verified first (each step must be a "
                    "correct equation leading to the answer); a wrong one is refused.")


def create_recall_tool(retriever: KVMemoryRetriever | None = None, *, name: str = "recall_solution",
                       **retriever_kwargs) -> BaseTool:
    """A tool that returns the stored verified solutions closest to a question (content: the solutions
    with their provenance; artifact: the Documents' metadata)."""
    retriever = retriever or KVMemoryRetriever(**retriever_kwargs)

    def recall(query: str) -> tuple[str, list[dict]]:
        docs = retriever.invoke(query)
        if not docs:
            return "No stored verified solution matches this question.", []
        parts = []
        for d in docs:
            m = d.metadata
            head = {"entry_id": m["entry_id"], "score": round(m["score"], 4), "verified": m["verified"],
                    "attestation_id": m["attestation_id"], "answer": m["answer"]}
            parts.append(f"{json.dumps(head)}\n{d.page_content}")
        return "\n\n".join(parts), [d.metadata for d in docs]

    return StructuredTool.from_function(
        func=recall, name=name, args_schema=RecallSolution, response_format="content_and_artifact",
        description="Look up stored, verified solutions of problems like this one (with their answers).")
