"""A tool-using agent that talks to `kvmemory serve` with the official `openai` client only.

    .venv/bin/python examples/openai_agent_server.py                      # starts a server on a free port
    .venv/bin/python examples/openai_agent_server.py --base-url http://127.0.0.1:8765/v1 --api-key KEY

Without `--base-url` the example starts `kvmemory serve` itself (the embedded SmolLM2-135M-Instruct, a
throw-away store, a random API key, a free port on 127.0.0.1) and stops it at the end.

The agent's loop is plain OpenAI tool calling (`tools`, `tool_choice`, `role: tool` messages); its
memory is the server's, reached through the same client (`client.post` on the memory API, the scope
in `extra_body={"kvmemory": {"user_id": ...}}`):

1. First encounter: the agent asks the server's memory (`/v1/memory/recall`): nothing. It asks the
   model with a calculator tool (`tool_choice="required"`: a 135M model does not decide on its own
   when to use a tool), runs the call the model wrote, gives the result back (`tool_choice="none"`)
   and the model answers. The solved problem (question, calculator step, result) is remembered on the
   server, whose arithmetic verifier re-checks it before storing it with its exact KV cache.
2. The problem recurs, worded differently: recall finds the verified entry, so the agent asks the
   model without tools; the server routes the question to that entry and grafts its stored KV
   (`usage.prompt_tokens_details.cached_tokens`), and the model answers from it. The provenance is
   printed: entry id, attestation id, tokens grafted / computed / decoded.

Every answer is checked against 1234 * 56, computed here, and printed with ✓/✗; the exit status is 0
when both are right and the recurring one came from a verified entry with grafted prompt tokens.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

FIRST = "What is 1234 * 56?"
RECURRING = "What is 1234 multiplied by 56?"
EXPECTED = 1234 * 56  # the answers are checked against this, computed here, not against a tool's output
USER = "openai-agent-demo"  # the memory scope this agent uses on the server
SCOPE = {"kvmemory": {"user_id": USER}}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as '12 * 8 + 3'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("not arithmetic")


def calculator(expression: str) -> str:
    """The tool: arithmetic only (no eval of arbitrary code); an error goes back to the model as text."""
    try:
        value = _eval(ast.parse(expression.split("=")[0].replace("×", "*").strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"Error: cannot evaluate {expression!r} ({exc})"
    return str(int(value) if float(value).is_integer() else value)


def answer_of(text: str) -> int | None:
    """The last integer an answer writes (digits may be grouped with commas)."""
    found = re.findall(r"-?\d[\d,]*", text or "")
    return int(found[-1].replace(",", "")) if found else None


def check(text: str) -> bool:
    ok = answer_of(text) == EXPECTED
    print(f"  answer : {text!r}, expected {EXPECTED}: {'✓' if ok else '✗'}")
    return ok


def recall(client: openai.OpenAI, question: str) -> list[dict]:
    """The server's memory, through the openai client's generic POST (the base URL ends in /v1)."""
    out = client.post("/memory/recall", body={"query": question, "k": 1, "user_id": USER}, cast_to=object)
    return out["results"]


def solve_with_calculator(client: openai.OpenAI, model: str, question: str) -> tuple[str, str, str]:
    """The tool loop: the model writes a calculator call, the agent runs it, the model answers."""
    messages = [{"role": "user", "content": question}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], tool_choice="required",
                                       max_tokens=32, extra_body=SCOPE)
    call = r.choices[0].message.tool_calls[0]
    expression = json.loads(call.function.arguments)["expression"]
    result = calculator(expression)
    print(f"  model  : calls calculator({expression!r})")
    print(f"  tool   : {result!r}")
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], tool_choice="none",
                                       max_tokens=24, extra_body=SCOPE)
    return r.choices[0].message.content, expression, result


def run(client: openai.OpenAI, model: str) -> int:
    t0 = time.perf_counter()
    print(f"1. First encounter: {FIRST}")
    hits = recall(client, FIRST)
    print(f"  memory : {len(hits)} verified entr{'y' if len(hits) == 1 else 'ies'}")
    text, expression, result = solve_with_calculator(client, model, FIRST)
    first_ok = check(text)
    # Keep the solved problem: the server's arithmetic verifier re-checks the step before storing it.
    entry = client.post("/memory/remember", cast_to=object, body={
        "problem": FIRST, "solution": f"{expression} = {result}. The answer is {result}.", "answer": result,
        "verifier": "arithmetic", "user_id": USER})
    print(f"  stored : entry {entry['id']} (verified {entry['verified']}, graft bit-identical {entry['bit_identical']},"
          f" attestation {entry['attestation_id'][:16]}...)")

    print(f"\n2. The problem recurs, reworded: {RECURRING}")
    hits = recall(client, RECURRING)
    print(f"  memory : {[(h['id'], round(h['score'], 3), h['verified']) for h in hits]}")
    if hits and hits[0]["verified"]:  # a verified solution: answer from it, no tool needed
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": RECURRING}],
                                           max_tokens=48, extra_body=SCOPE)
        text, kv = r.choices[0].message.content, r.model_extra["kvmemory"]
        cached = r.usage.prompt_tokens_details.cached_tokens
    else:
        text, _, _ = solve_with_calculator(client, model, RECURRING)
        kv, cached = {"entries": []}, 0
    recurring_ok = check(text)
    print("\nProvenance of the final answer:")
    print(json.dumps({"entries": kv["entries"], "cached_tokens": cached,
                      **{k: kv.get(k) for k in ("tokens_grafted", "tokens_computed", "tokens_decoded")}}, indent=2))
    used = kv["entries"][0] if kv["entries"] else None
    ok = bool(used) and used["verified"] and cached > 0 and recurring_ok
    print(f"\nrecurring problem answered right from verified entry {used and used['id']} with {cached} prompt "
          f"tokens grafted: {'yes' if ok else 'NO'} ({time.perf_counter() - t0:.1f} s in all)")
    print(f"{first_ok + recurring_ok}/2 answers right")
    return 0 if ok and first_ok else 1


# ---------------------------------------------------------------------- a server of our own
def start_server(store: str, key: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVMEMORY_API_KEY": key}
    proc = subprocess.Popen([sys.executable, "-m", "kvmemory.cli", "serve", "--store", store, "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvmemory serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                return proc, f"{url}/v1"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("kvmemory serve did not start in time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="a running server's OpenAI base URL, e.g. http://127.0.0.1:8765/v1 "
                                       "(default: start one here)")
    ap.add_argument("--api-key", default=os.environ.get("KVMEMORY_API_KEY", "none"), help="its API key")
    ap.add_argument("--model", default="kvmemory", help="the served model name")
    args = ap.parse_args(argv)
    proc = store = None
    base_url, key = args.base_url, args.api_key
    if base_url is None:
        store, key = tempfile.mkdtemp(prefix="kvmemory-serve-"), secrets.token_urlsafe(24)
        print("starting kvmemory serve (the embedded model loads once) ...", flush=True)
        proc, base_url = start_server(store, key)
    try:
        return run(openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300), args.model)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)  # graceful: in-flight requests finish, the store is closed
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
