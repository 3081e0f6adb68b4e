"""LlamaIndex over kvmemory, offline on the embedded SmolLM2: retriever, query engine, memory block.

    python examples/llamaindex_query_engine.py                 # a throw-away store
    python examples/llamaindex_query_engine.py --store ./store # keep what it remembers

1. Remembers kvmemory's seeded recurring problems (each worked solution must pass the arithmetic
   verifier; a wrong one is refused) and scores `KVMemoryRetriever` with LlamaIndex's own
   `RetrieverEvaluator` on rewordings the store never saw (hit rate, MRR).
2. Answers reworded questions with `RetrieverQueryEngine.from_args(retriever, llm=KVGraftLLM)`: with
   LlamaIndex's default synthesizer the retrieved solution's text is pasted into its prompt and read
   again, from scratch, and the model writes its answer out (its steps are re-checked and printed
   with the verifier's verdict: a small model miscopies them); with `KVGraftSynthesizer` the entry's
   stored KV is grafted and, after "The answer is", the model decodes only the answer.
3. Puts `KVMemoryBlock` in a LlamaIndex `Memory`, so a chat gets the verified solution in its
   system message, and the model replies after "The answer is".

Answer modes (a 135M model is unreliable at free decoding): every answer here is decoded greedily,
and only the answer itself where that matters: `KVGraftSynthesizer(answer_prefix="The answer is")`
and, for the memory block, the chat rendered with the assistant's turn opened by the same prefix
(`KVGraftLLM.complete(..., formatted=True)`); a free reply to the memory block's chat copies the
solution's steps and miscopies a product. The LlamaIndex integration has no mode that picks among
the solution's numbers (kvmemory's most reliable one, `KVMemory.answer(choices="numbers")`).
Each printed answer is compared with the verified answer (✓/✗); the exit status is 1 if any is wrong.

Nothing is downloaded and no default model is resolved: the LLM is passed explicitly everywhere and
set as `Settings.llm`; no embedding model is needed (kvmemory routes with its own embedder).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

ANSWER_PREFIX = "The answer is"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="store folder (default: a temporary one, removed at exit)")
    ap.add_argument("--problems", type=int, default=10, help="recurring problems to remember (default 10)")
    ap.add_argument("--max-new-tokens", type=int, default=8,
                    help="tokens decoded per answer after the answer prefix (default 8)")
    ap.add_argument("--default-budget", type=int, default=96,
                    help="tokens the default synthesizer's answer may take (default 96)")
    args = ap.parse_args(argv)

    from kvmemory import ArithmeticVerifier, KVMemory, VerificationFailed, extract_answer, generate_problems
    from llama_index.core import Settings
    from llama_index.core.llms import ChatMessage
    from llama_index.core.memory import Memory
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.llms.kvgraft import KVGraftLLM, KVGraftSynthesizer
    from llama_index.memory.kvmemory import KVMemoryBlock
    from llama_index.retrievers.kvmemory import KVMemoryRetriever, aevaluate_retriever, remember_recurring

    tmp = None if args.store else tempfile.TemporaryDirectory(prefix="kvmemory-li-")
    store = args.store or os.path.join(tmp.name, "store")
    t0 = time.perf_counter()
    mem = KVMemory(store=store, namespace="llamaindex-example")
    llm = KVGraftLLM(memory=mem, max_new_tokens=args.max_new_tokens)
    Settings.llm = llm  # explicit: nothing can fall back to a hosted default
    print(f"model {llm.metadata.model_name}: context window {llm.metadata.context_window} tokens, "
          f"loaded in {time.perf_counter() - t0:.1f} s; store {store}")

    # 1. Remember verified solutions; evaluate the retriever on unseen rewordings.
    t0 = time.perf_counter()
    cases = remember_recurring(mem, n=args.problems, seed=0, rewordings=2)
    print(f"\nremembered {len(cases)} verified solutions in {time.perf_counter() - t0:.1f} s")
    try:
        mem.remember("Ada has 3 bags of 7 pears. How many pears?", "3 * 7 = 22. The answer is 22.", "22",
                     verifier="arithmetic")
    except VerificationFailed as e:
        print(f"refused a wrong solution: {e}".split(". Fix")[0])

    retriever = KVMemoryRetriever(mem, similarity_top_k=3)
    ev = asyncio.run(aevaluate_retriever(retriever, cases))
    print(f"RetrieverEvaluator on {ev.queries} rewordings of {ev.problems} problems: "
          f"hit rate {ev.hit_rate:.3f}, MRR {ev.mrr:.3f}")

    # 2. The query engine. LlamaIndex's default synthesizer pastes the retrieved solution into its
    #    prompt (read again, from scratch) and the model writes its answer out (a budget that lets it
    #    finish); KVGraftSynthesizer puts the entry before the question as it was stored, so its KV is
    #    grafted, and after "The answer is" a few greedy tokens answer.
    problems = generate_problems(args.problems, 0, rewordings=2)
    retriever = KVMemoryRetriever(mem, similarity_top_k=1)
    # The default synthesizer's model writes its answer out; it stops where its answer ends.
    writer = KVGraftLLM(memory=mem, max_new_tokens=args.default_budget, stop=["\n\n", "\n-"])
    plain = RetrieverQueryEngine.from_args(retriever, llm=writer)
    grafted = RetrieverQueryEngine.from_args(
        retriever, llm=llm, response_synthesizer=KVGraftSynthesizer(llm, answer_prefix=ANSWER_PREFIX))
    runs = [("default synthesizer", plain, writer, problems[0]), ("KVGraftSynthesizer", grafted, llm, problems[0]),
            ("KVGraftSynthesizer", grafted, llm, problems[1])]
    right = []
    for label, engine, used, problem in runs:
        query = problem.rewordings[0]
        t0 = time.perf_counter()
        response = engine.query(query)
        rep = used.last_answer.report
        ok = extract_answer(response.response) == problem.answer
        right.append(ok)
        print(f"\n[{label}] {query}")
        print(f"  answer: {response.response.strip()!r}")
        print(f"  verified answer {problem.answer}: {'✓' if ok else '✗'}")
        if used is writer:
            # What the model wrote around its answer is not the verified solution: check it as one.
            steps = ArithmeticVerifier()(query, response.response, None)
            print(f"  the steps it wrote, re-checked by the arithmetic verifier: {steps.detail}")
        if response.source_nodes:
            md = response.source_nodes[0].node.metadata
            print(f"  from entry {md['entry_id']} (score {md['score']:.3f}, verified {md['verified']}, "
                  f"attestation {md['attestation_id'][:16]}...)")
        print(f"  tokens grafted {rep.tokens_grafted}, computed {rep.tokens_computed}, decoded {rep.tokens_decoded} "
              f"({time.perf_counter() - t0:.1f} s)")

    # 3. A LlamaIndex Memory whose block brings in the verified solution for the user's question. The
    #    reply is decoded after "The answer is": the chat is rendered with the model's chat template,
    #    the assistant's turn opened by the prefix, and continued as it is (`formatted=True`).
    tok = mem.engine.tokenizer
    chat_memory = Memory.from_defaults(session_id="example", token_limit=4000,
                                       memory_blocks=[KVMemoryBlock(memory=mem, similarity_top_k=1)],
                                       tokenizer_fn=lambda text: tok(text, add_special_tokens=False)["input_ids"])
    problem = problems[2]
    question = problem.rewordings[0]
    chat_memory.put(ChatMessage(role="user", content=question))
    messages = chat_memory.get()
    turns = [{"role": m.role.value, "content": m.content or ""} for m in messages]
    prompt = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) + ANSWER_PREFIX
    t0 = time.perf_counter()
    reply = llm.complete(prompt, formatted=True, max_new_tokens=8, stop=["\n"])
    text = f"{ANSWER_PREFIX} {reply.text.strip()}"
    ok = extract_answer(text) == problem.answer
    right.append(ok)
    print(f"\n[memory block] {question}")
    print(f"  system message holds the verified solution: {problem.solution in (messages[0].content or '')}")
    print(f"  reply: {text!r}")
    print(f"  verified answer {problem.answer}: {'✓' if ok else '✗'} "
          f"(decoded {reply.additional_kwargs['tokens_decoded']} tokens, {time.perf_counter() - t0:.1f} s)")

    print(f"\n{sum(right)}/{len(right)} answers right")
    if tmp is not None:
        tmp.cleanup()
    return 0 if all(right) else 1


if __name__ == "__main__":
    sys.exit(main())
