"""`kvmemory bench serve`: `kvmemory serve` under load, side by side with llama.cpp's own server.

What is compared. Up to three HTTP servers of the same model, each started by the bench as a subprocess on
a free port and driven only through the OpenAI chat completions API (streaming):

- **kvmemory**: `kvmemory serve` (the CLI, so the bench never imports the server layer) over a fresh
  temporary store, the default profile, `--threads` torch threads (default 2): the embedded
  SmolLM2-135M-Instruct. Every call routes its last user turn to verified entries of its scope and
  grafts the longest stored chain of its prompt's blocks; up to `--batch-slots N` requests' forwards
  share each step (continuous batching, engine/scheduler.py: every answer the bits of the request
  alone; 16 by default, the server's own), or with `--batch-slots 1` one compute worker serves requests
  one at a time. `--linears` is passed on (q8: 8-bit activations, as llama.cpp computes).
- **llama.cpp**: llama-cpp-python's `python -m llama_cpp.server` on the very GGUF file the embedded
  model is converted from (`loading.embedded_gguf_path()`), `--n_threads` / `--n_threads_batch` equal to
  kvmemory's threads, its prompt cache on (`--cache true`: a RAM cache of saved states, looked up by
  the longest token prefix, on top of its own reuse of the previous request's KV prefix). It also
  serves one request at a time (one model behind a lock); `--interrupt_requests false`, else it cuts a
  stream short whenever another request waits. Needs the optional `llamacpp` extra; without it the
  report says the side was not run, and why.
- **llama-server**: llama.cpp's C++ server (`llama-server`, built from the llama.cpp sources that
  llama-cpp-python's sdist vendors: scripts/build_llama_server.sh), only when its binary is given
  (`--llama-server PATH` or the environment variable `KVMEMORY_LLAMA_SERVER`; else the report says the
  side was not run, and why). On the same GGUF, `-t` / `-tb` equal to kvmemory's threads, started
  afresh for every run with one parallel slot per client (`-np N`, `-c` = N x 4096 so that every slot
  has the llamacpp side's context) and continuous batching (its default, `-cb`): its N slots' forwards
  share each step. Its own prompt reuse stays at its defaults (each slot's KV prefix, and its RAM prompt
  cache, `--cache-ram`). Its requests carry no extra field (its `repeat_penalty` is off by default), so
  its request bodies are byte-identical to kvmemory's.

How. For each number of concurrent clients N (default 1, 4, 16) and each repeat, a fixed workload is
generated from the seed, N and the repeat (problems.py): every client sends, one after another in a
seeded order, `per_kind` requests of each of three kinds:

- **recurring**: a reworded arithmetic word problem whose verified worked solution was remembered
  first (`POST /v1/memory/remember` on kvmemory, untimed, in the run's own scope); kvmemory routes the
  question to it and grafts the entry's blocks. Clients share the problems, so the same rewording also
  recurs across clients. llama.cpp has no memory: it gets the same request and answers from scratch
  (or from its prompt cache, when the same prompt was seen before);
- **new**: a question that routes to nothing (`unrelated_questions`), different for every client;
- **conversation**: turn k of the client's own conversation, whose messages repeat turns 1..k-1 (the
  assistant turns are a fixed script, not the model's replies, so that both sides get byte-identical
  requests). Turn k's prompt starts with turn k-1's: kvmemory grafts the blocks turn k-1 stored;
  llama.cpp reuses its cached prefix.

Every side gets the same requests (the JSON bodies' SHA-256 are in the report) in the same order per
client: greedy (`temperature` 0; llama.cpp's requests also carry `repeat_penalty` 1.0, which it applies
before its greedy pick otherwise, and which kvmemory's server refuses as a field OpenAI's API lacks), the same `max_tokens`, `stream` on. The scope goes in the `X-KVMemory-User-Id` header
(one per run, so runs do not see each other's entries; llama.cpp ignores it). Each run's content is
new (seeded by N and the repeat) and each side runs right after the other, interleaved, so drift in a
shared machine's speed hits all of them. One untimed warm-up request per side comes first (for
llama-server, whose server starts per run, before each run).

Reported per side and N (median [min-max] over the repeats, every request's record kept): requests/s
(requests / the run's wall time), aggregate decode tokens/s (the completion tokens of all requests / the
run's wall time; completion tokens as each response's `usage` reports them, so n/a for a server whose
stream reports no usage: llama-cpp-python's), p50 / p99 of time to first token (the first non-empty
content delta) and to the last token (the end of the stream), tokens computed per request, errors.
Tokens computed:
kvmemory's from each response's `kvmemory` object (prompt tokens computed, not grafted); llama.cpp's API
reports no cached tokens, so they come from its own log (`--verbose`): per request, the prompt tokens
left to evaluate after its prefix match ("remaining M prompt tokens to eval"), else its `prompt eval`
count; with concurrent clients its log cannot be matched to requests, so only their distribution is
reported. llama-server's from each response's `usage` (`prompt_tokens` less
`prompt_tokens_details.cached_tokens`, the prompt tokens its slot or prompt cache already held).

Why the exactness check. A faster server is only interesting if its answers are still the canonical
computation's. The chat route does not return logits, so for a seeded sample of kvmemory's answers
(`check_per_kind` per kind and run) the bench rebuilds the exact prompt the server decoded (the routed
entries it names, `KVMemory.chat_ids`), sends it as raw text to `/v1/completions` after the timed runs
(it returns the SHA-256 of every logit it computed from its graft point on; it grafts the longest chain
stored by then, which includes the blocks the chat call itself stored, so its graft point can be past
the chat call's), checks that the completion has the chat answer's prompt length and as many tokens, checks
the chat answer served under load against this process's recompute of the chat prompt with the chat's own
cuts (a chat's chunks end at its turns' ends, runner.py; a raw-text completion's do not, so its text may
differ from the chat's where two tokens are nearly tied), then recomputes the prompt from scratch in this process under the same profile (same
model files, kernels, threads: the profile ids are compared) and compares the logits' bytes. Any error
or any mismatch makes the report `ok: false` (and the CLI exit non-zero). A streamed text that differs
from the answer's text only because it shows U+FFFD (a character whose bytes span two tokens, streamed
half-decoded) is reported (`stream_text_differs`, and per run `answers_with_replacement_char`), not
counted as a mismatch: the tokens and logits are the same, the stream's rendering of them is not.
A chat answer to a recurring problem (memory/recurrence.py: "The answer is 31.", chosen among the verified
working's numbers after the answer's own prompt) is checked on that prompt instead: the answer is chosen
again in this process and must be the served one, and the prompt with the chosen tokens appended goes
through `/v1/completions` (one decode step) and the recompute as above.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmemory.errors import InvalidInput, KVMemoryError

DEFAULT_CLIENTS = (1, 4, 16)
KINDS = ("recurring", "new", "conversation")
SERVED_MODEL = "kvmemory"  # the model name both sides are asked for (llama.cpp serves its one model under any name)
START_TIMEOUT_S = 600.0  # a server start on a loaded 2-core machine (the model load, a cold conversion cache)
REQUEST_TIMEOUT_S = 1800.0  # one request may wait behind 15 others on a slow, shared machine
SCOPE_HEADER = "X-KVMemory-User-Id"
WARMUP = [{"role": "user", "content": "Say hello in one short sentence."}]

# The conversations' fixed script: user follow-ups and the assistant turns the next request repeats.
FOLLOW_UPS = (
    "Can you check each step of that again?",
    "What would the answer be if the first number were twice as large?",
    "Explain the second step in plain words.",
    "Write the final answer as a word instead of digits.",
    "Which step was the hardest, and why?",
    "Summarise the whole solution in one sentence.",
)
REPLIES = (
    "Checking each step again: every operation uses the numbers given in the problem, and the results carry "
    "over from one step to the next, so the final answer stays the same.",
    "If the first number were twice as large, the first step would change and every later step would use "
    "the new result, so the final answer would change too.",
    "The second step takes the result of the first one and applies the next operation from the problem.",
    "Written as a word, the answer is spelled out in full instead of with digits.",
    "The hardest step is the one with the multiplication, because the numbers there are the largest.",
    "The solution combines the given quantities step by step until only the asked-for total remains.",
)


# ---------------------------------------------------------------------- the workload
@dataclass(slots=True)
class Request:
    client: int
    seq: int  # its place in the client's order
    kind: str
    index: int  # the i-th request of its kind for this client (a conversation's turn - 1)
    messages: list[dict]

    def body(self, max_tokens: int) -> dict:
        return {"model": SERVED_MODEL, "messages": self.messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}


@dataclass(slots=True)
class Workload:
    tag: str  # the run's name and scope (user id)
    library: list[dict]  # what is remembered first: {problem, solution, answer}
    clients: list[list[Request]]


def _run_seed(seed: int, clients: int, repeat: int) -> int:
    return seed * 1_000_003 + clients * 1009 + repeat


def make_workload(clients: int, per_kind: int, seed: int, repeat: int) -> Workload:
    """The run's requests: per client `per_kind` of each kind in a seeded order (module docstring)."""
    from kvmemory.bench.problems import generate_problems, unrelated_questions

    rs = _run_seed(seed, clients, repeat)
    library = generate_problems(per_kind, rs, rewordings=3)
    talks = generate_problems(clients, rs + 500_000, rewordings=0)
    new = unrelated_questions(clients * per_kind, rs)
    out = []
    for c in range(clients):
        rng = random.Random(f"bench-serve/{rs}/{c}")
        kinds = [k for k in KINDS for _ in range(per_kind)]
        rng.shuffle(kinds)
        seen = dict.fromkeys(KINDS, 0)
        reqs = []
        for seq, kind in enumerate(kinds):
            i = seen[kind]
            seen[kind] += 1
            if kind == "recurring":
                p = library[i]
                msgs = [{"role": "user", "content": p.rewordings[c % len(p.rewordings)]}]
            elif kind == "new":
                msgs = [{"role": "user", "content": new[c * per_kind + i]}]
            else:
                p = talks[c]
                msgs = [{"role": "user", "content": p.text}]
                for j in range(i):
                    reply = p.solution if j == 0 else REPLIES[(j - 1) % len(REPLIES)]
                    msgs += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": FOLLOW_UPS[j % len(FOLLOW_UPS)]}]
            reqs.append(Request(c, seq, kind, i, msgs))
        out.append(reqs)
    lib = [{"problem": p.text, "solution": p.solution, "answer": str(p.answer)} for p in library]
    return Workload(f"bench-serve-n{clients}-r{repeat}-s{seed}", lib, out)


def body_sha256(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


# ---------------------------------------------------------------------- the servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server subprocess: its command, where it listens and logs."""

    name: str
    cmd: list[str]
    port: int
    log: Path
    ready_path: str
    proc: subprocess.Popen | None = None
    started_s: float = 0.0
    info: dict = field(default_factory=dict)
    body_extra: dict = field(default_factory=dict)  # fields only this server takes, added to every request

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import httpx

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"}
        env.pop("KVMEMORY_API_KEY", None)  # the bench's servers listen on loopback without keys
        t = time.perf_counter()
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=err, stderr=err, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KVMemoryError(f"{self.name} server exited {self.proc.returncode} at start: "
                                    f"{' '.join(self.cmd)}\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    self.started_s = time.perf_counter() - t
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise KVMemoryError(f"{self.name} server did not answer {self.ready_path} in {START_TIMEOUT_S:.0f} s\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self, timeout: float = 120.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def kvmemory_server(tmp: Path, threads: int, clients: int, batch_slots: int = 16, linears: str = "auto") -> Server:
    port = free_port()
    # the default queue depth (32) unless more clients could be waiting at once than that
    cmd = [sys.executable, "-m", "kvmemory.cli", "serve", "--store", str(tmp / "store"), "--port", str(port),
           "--threads", str(threads), "--queue-depth", str(max(32, clients)), "--log-level", "warning", "--no-mcp",
           "--batch-slots", str(batch_slots), "--linears", linears]
    return Server("kvmemory", cmd, port, tmp / "kvmemory-serve.log", "/healthz")


def llamacpp_missing() -> str | None:
    """Why llama.cpp's server cannot run here (None when it can)."""
    missing = [m for m in ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
               if importlib.util.find_spec(m) is None]
    if missing:
        return (f"not run: llama.cpp's server needs {', '.join(missing)} (pip install 'kvmemory[llamacpp]'; "
                "llama-cpp-python builds llama.cpp from source)")
    return None


def llamacpp_server(tmp: Path, gguf: str, threads: int, n_ctx: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", SERVED_MODEL,
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
           "--cache", "true", "--cache_type", "ram", "--verbose", "true", "--host", "127.0.0.1", "--port", str(port),
           # its default ends a stream early (with [DONE], no finish reason) as soon as another request waits:
           # every request is served in full here, as kvmemory serves them
           "--interrupt_requests", "false"]
    return Server("llamacpp", cmd, port, tmp / "llamacpp-server.log", "/v1/models",
                  body_extra={"repeat_penalty": 1.0})


LLAMA_SERVER_ENV = "KVMEMORY_LLAMA_SERVER"  # the llama-server binary, when --llama-server is not given
LLAMA_SERVER_CTX_PER_SLOT = 4096  # each slot's context: the llamacpp side's n_ctx


def resolve_llama_server(path: str | None) -> str | None:
    """The llama-server binary to run: `path`, else $KVMEMORY_LLAMA_SERVER, else None (the side is not run).
    Raises InvalidInput when the one named is not an executable file (checked before any model loads)."""
    path = path or os.environ.get(LLAMA_SERVER_ENV) or None
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidInput(f"--llama-server: {path} is not a file (build it with scripts/build_llama_server.sh OUTDIR)")
    if not os.access(p, os.X_OK):
        raise InvalidInput(f"--llama-server: {path} is not executable")
    return str(p.resolve())


def llama_server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
        return " ".join((out.stdout + out.stderr).split()) or f"exit {out.returncode}, no output"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"


def llama_server_process(tmp: Path, binary: str, gguf: str, threads: int, clients: int, tag: str) -> Server:
    """llama.cpp's C++ server with one slot per client and continuous batching (module docstring)."""
    port = free_port()
    cmd = [binary, "-m", gguf, "--alias", SERVED_MODEL, "-np", str(clients),
           "-c", str(clients * LLAMA_SERVER_CTX_PER_SLOT), "-t", str(threads), "-tb", str(threads),
           "-cb", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    return Server("llama-server", cmd, port, tmp / f"llama-server-{tag}.log", "/health")


# ---------------------------------------------------------------------- one request, one run
def send(client, url: str, req: Request, max_tokens: int, headers: dict, t0: float,
         extra: dict | None = None) -> dict:
    """One streamed chat completion: when it started (from the run's start), its time to first token
    and to the last, the text, and what the server reported about it. Never raises: errors are data.
    `extra`: the server's own fields (Server.body_extra), added after the request's SHA-256 is taken."""
    body = req.body(max_tokens)
    rec = {"client": req.client, "seq": req.seq, "kind": req.kind, "index": req.index,
           "request_sha256": body_sha256(body), "ok": False, "error": None}
    body = {**body, **(extra or {})}
    start = time.perf_counter()
    rec["start_s"] = start - t0
    text, first = [], None
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                rec["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
                return rec
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments (llama.cpp's pings), blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return rec
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter() - start
                        text.append(piece)
                    if ch.get("finish_reason"):
                        rec["finish_reason"] = ch["finish_reason"]
                if chunk.get("kvmemory"):
                    rec["kvmemory"] = chunk["kvmemory"]
                if chunk.get("usage"):
                    rec["usage"] = chunk["usage"]
        total = time.perf_counter() - start
    except Exception as exc:  # a dropped connection, a timeout, a malformed chunk: counted, reported
        rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec
    if "finish_reason" not in rec:
        rec["error"] = "the stream ended without a finish reason"
        return rec
    rec.update(ok=True, ttft_s=first if first is not None else total, total_s=total, text="".join(text),
               empty=first is None)
    return rec


def run_load(url: str, workload: Workload, max_tokens: int, headers: dict,
             extra: dict | None = None) -> tuple[list[dict], float]:
    """Every client in its own thread, all released together; returns the records and the wall time."""
    import httpx

    n = len(workload.clients)
    records: list[list[dict]] = [[] for _ in range(n)]
    barrier = threading.Barrier(n + 1)
    t0 = [0.0]

    def client(c: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=60.0)) as http:
            barrier.wait()
            for req in workload.clients[c]:
                records[c].append(send(http, url, req, max_tokens, headers, t0[0], extra))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(n)]
    for t in threads:
        t.start()
    t0[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0[0]
    return [r for rs in records for r in rs], wall


def percentile(xs: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def spread(xs: list[float]) -> dict | None:
    import statistics

    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


_PEVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
_PREFIX = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
_TOTAL = re.compile(r"llama_perf_context_print:\s+total time =")


def llamacpp_tokens_from_log(text: str) -> list[dict]:
    """Per request llama.cpp served (in the order it served them), from its verbose log: the prompt
    tokens it evaluated (after a prefix match: the remaining ones; else its `prompt eval` count) and
    the prefix it reused. Each request's log ends with its timings' `total time` line."""
    out, reused, remaining, peval = [], None, None, None
    for line in text.splitlines():
        if m := _PREFIX.search(line):
            reused, remaining = int(m[1]), int(m[2])
        elif m := _PEVAL.search(line):
            peval = int(m[1])
        elif _TOTAL.search(line):
            computed = remaining if remaining is not None else peval
            out.append({"tokens_computed": computed, "prefix_reused": reused or 0,
                        "prompt_tokens": (reused + remaining) if reused is not None else peval})
            reused, remaining, peval = None, None, None
    return out


def summarize_run(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft, total = [r["ttft_s"] for r in ok], [r["total_s"] for r in ok]
    # aggregate decode: every completion token the run streamed over its wall time (n/a unless every
    # answer's usage reports its completion tokens)
    comp = [r["usage"].get("completion_tokens") for r in ok if isinstance(r.get("usage"), dict)]
    comp_known = bool(ok) and len(comp) == len(ok) and all(isinstance(c, int) for c in comp)
    out = {"requests": len(records), "errors": len(records) - len(ok), "wall_s": wall,
           "requests_per_s": len(records) / wall if wall > 0 else None,
           "completion_tokens": sum(comp) if comp_known else None,
           "decode_tokens_per_s": sum(comp) / wall if comp_known and wall > 0 else None,
           "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "last_token_p50_s": percentile(total, 50), "last_token_p99_s": percentile(total, 99),
           "empty_answers": sum(1 for r in ok if r.get("empty")),
           # streamed answers showing U+FFFD (a character whose bytes span two tokens, shown half-decoded)
           "answers_with_replacement_char": sum(1 for r in ok if "\ufffd" in r["text"]),
           "by_kind": {}}
    for kind in KINDS:
        ks = [r for r in ok if r["kind"] == kind]
        out["by_kind"][kind] = {"requests": sum(1 for r in records if r["kind"] == kind),
                                "ttft_p50_s": percentile([r["ttft_s"] for r in ks], 50),
                                "last_token_p50_s": percentile([r["total_s"] for r in ks], 50)}
    return out


def kvmemory_tokens(records: list[dict], out: dict) -> None:
    """Tokens computed / grafted per request as the kvmemory server reported them."""
    import statistics

    ok = [r for r in records if r["ok"] and "kvmemory" in r]
    comp = [r["kvmemory"]["tokens_computed"] for r in ok]
    prompt = [r["usage"]["prompt_tokens"] for r in ok if "usage" in r]
    graft = [r["kvmemory"]["tokens_grafted"] for r in ok]
    out.update(tokens_computed_mean=statistics.fmean(comp) if comp else None,
               tokens_computed_p50=percentile(comp, 50), prompt_tokens_mean=statistics.fmean(prompt) if prompt else None,
               tokens_grafted_mean=statistics.fmean(graft) if graft else None,
               tokens_source="the kvmemory object of each response (prompt tokens computed, not grafted)")
    for kind in KINDS:
        ks = [r for r in ok if r["kind"] == kind]
        out["by_kind"][kind].update(
            tokens_computed_mean=statistics.fmean([r["kvmemory"]["tokens_computed"] for r in ks]) if ks else None,
            tokens_grafted_mean=statistics.fmean([r["kvmemory"]["tokens_grafted"] for r in ks]) if ks else None,
            routed=sum(1 for r in ks if r["kvmemory"].get("entries")))


def llamacpp_tokens(log_text: str, records: list[dict], out: dict) -> None:
    import statistics

    served = llamacpp_tokens_from_log(log_text)
    comp = [s["tokens_computed"] for s in served if s["tokens_computed"] is not None]
    prompt = [s["prompt_tokens"] for s in served if s["prompt_tokens"] is not None]
    matched = len(served) == len(records)
    out.update(tokens_computed_mean=statistics.fmean(comp) if comp and matched else None,
               tokens_computed_p50=percentile(comp, 50) if matched else None,
               prompt_tokens_mean=statistics.fmean(prompt) if prompt and matched else None,
               tokens_grafted_mean=None, log_requests=len(served), log_tokens=served,
               tokens_source=("llama.cpp's verbose log: per request, the prompt tokens left to evaluate after its "
                              "prefix match (else its prompt eval count); its API reports no cached tokens"
                              if matched else f"not reported: its log shows {len(served)} requests for "
                              f"{len(records)} sent, so it cannot be read per request"))


def llama_server_tokens(records: list[dict], out: dict) -> None:
    """Tokens computed per request as llama-server's usage reports them: prompt tokens less cached ones."""
    import statistics

    ok = [r for r in records if r["ok"] and isinstance(r.get("usage"), dict)]

    def computed(r: dict) -> int | None:
        cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        p = r["usage"].get("prompt_tokens")
        return p - cached if isinstance(p, int) and isinstance(cached, int) else None

    comp = [c for c in map(computed, ok) if c is not None]
    prompt = [r["usage"]["prompt_tokens"] for r in ok if isinstance(r["usage"].get("prompt_tokens"), int)]
    out.update(tokens_computed_mean=statistics.fmean(comp) if comp else None,
               tokens_computed_p50=percentile(comp, 50), prompt_tokens_mean=statistics.fmean(prompt) if prompt else None,
               tokens_grafted_mean=None,
               tokens_source="llama-server's usage of each response: prompt_tokens less "
                             "prompt_tokens_details.cached_tokens (reused from its slot or prompt cache)")
    for kind in KINDS:
        ks = [c for c in (computed(r) for r in ok if r["kind"] == kind) if c is not None]
        out["by_kind"][kind].update(tokens_computed_mean=statistics.fmean(ks) if ks else None)


# ---------------------------------------------------------------------- the exactness sample
def pick_checks(records: list[dict], per_kind: int, rng: random.Random) -> list[dict]:
    out = []
    for kind in KINDS:
        ks = [r for r in records if r["ok"] and r["kind"] == kind and "kvmemory" in r]
        out += rng.sample(ks, min(per_kind, len(ks)))
    return out


def check_exactness(url: str, store: Path, threads: int, samples: list[dict], progress: bool,
                    linears: str = "auto") -> dict:
    """For each sampled kvmemory answer (module docstring): the prompt it decoded, rebuilt here; its
    logits through /v1/completions (the server's SHA-256); a recompute from scratch in this process
    under the same profile; the bytes compared."""
    import httpx
    import torch

    from kvmemory.engine.engine import Engine
    from kvmemory.memory.facade import KVMemory
    from kvmemory.store.local import LocalStore

    saved_threads = torch.get_num_threads()
    engine = Engine.open(store=LocalStore(store, readonly=True), threads=threads, linears=linears)
    try:
        mem = KVMemory(engine=engine)
        eos = set(engine.eos_token_ids)
        rows = []
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            for s in samples:
                row = {"kind": s["kind"], "client": s["client"], "seq": s["seq"], "run": s["run"],
                       "request_sha256": s["request_sha256"], "entries": [e["id"] for e in s["kvmemory"]["entries"]]}
                rows.append(row)
                try:
                    ns = s["kvmemory"]["namespace"]
                    entries = [mem.store.get_entry(e, ns) for e in row["entries"]]
                    recurrence = s["kvmemory"].get("recurrence")
                    if recurrence:
                        ids, tail = _recurrence_prompt(mem, s, entries, recurrence, row)
                    else:
                        layout = mem.chat_layout(s["messages"], entries)
                        ids, tail = layout.ids, []
                        # the chat answer itself: its prompt recomputed with the chat's own cuts (its turns'
                        # ends), which a raw-text completion does not have
                        chat = engine.recompute(ids, max_new_tokens=s["usage"]["completion_tokens"],
                                                stop_token_ids=(), cuts=layout.cuts, logits="last", keep_logits=False)
                        row["chat_cuts"] = list(layout.cuts)
                        row["chosen_text"] = engine.decode([t for t in chat.generated if t not in eos])
                    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
                    row["prompt_tokens"] = len(ids)
                    row["served_prompt_tokens"] = s["usage"]["prompt_tokens"] + len(tail)
                    if engine.encode(text) != ids:
                        row.update(equal=None, why="the prompt's text does not re-encode to its ids: not checkable "
                                   "through /v1/completions")
                        continue
                    # a recurrence's answer was chosen, not decoded: its prompt with the chosen answer appended
                    # is checked with one decode step (its logits cover every chosen token)
                    r = http.post(url + "/v1/completions", headers={SCOPE_HEADER: s["user_id"]},
                                  json={"model": SERVED_MODEL, "prompt": text,
                                        "max_tokens": 1 if recurrence else s["max_tokens"], "temperature": 0})
                    r.raise_for_status()
                    c = r.json()
                    k = c["kvmemory"]
                    row.update(graft_point=k["graft_point"], tokens_grafted=k["tokens_grafted"],
                               completion_tokens=c["usage"]["completion_tokens"],
                               served_logits_sha256=k["logits_sha256"],
                               profile_equal=k["profile_id"] == engine.profile_id,
                               same_tokens_as_served=(len(tail) if recurrence else c["usage"]["completion_tokens"])
                               == s["usage"]["completion_tokens"],
                               streamed_text_equal=row["chosen_text"].strip() == s["text"].strip())
                    # kvmemory's stream can show U+FFFD where a character's bytes span two tokens, and then
                    # differ from the answer's text (a defect of the stream's text, not of what was computed)
                    stream_defect = not row["streamed_text_equal"] and "\ufffd" in s["text"]
                    if stream_defect:
                        row["stream_defect"] = ("the streamed text holds U+FFFD (a character split across tokens) "
                                                "and differs from the answer's text")
                    ref = engine.recompute(ids, max_new_tokens=c["usage"]["completion_tokens"], stop_token_ids=())
                    g = k["graft_point"]
                    logits = torch.cat([ref.prefill_logits[g:], ref.decode_logits], 0).contiguous()
                    row["recompute_logits_sha256"] = hashlib.sha256(logits.numpy().tobytes()).hexdigest()
                    row["recompute_text_equal"] = engine.decode([t for t in ref.generated if t not in eos]) == \
                        c["choices"][0]["text"]
                    row["equal"] = bool(row["profile_equal"] and row["recompute_logits_sha256"] == k["logits_sha256"]
                                        and row["recompute_text_equal"] and row["same_tokens_as_served"]
                                        and (row["streamed_text_equal"] or stream_defect)
                                        and row["prompt_tokens"] == row["served_prompt_tokens"])
                except Exception as exc:  # reported as a failed check, never skipped silently
                    row.update(equal=False, why=f"{type(exc).__name__}: {exc}")
                if progress:
                    print(f"  exactness {len(rows)}/{len(samples)}: {row.get('equal')}", file=sys.stderr)
        profile_id = engine.profile_id
    finally:
        engine.store.close()
        torch.set_num_threads(saved_threads)
    equal = sum(1 for r in rows if r.get("equal") is True)
    return {"checked": len(rows), "equal": equal, "not_checkable": sum(1 for r in rows if r.get("equal") is None),
            "stream_text_differs": sum(1 for r in rows if "stream_defect" in r),
            "ok": bool(rows) and equal == len(rows), "profile_id": profile_id, "samples": rows,
            "how": "the prompt each sampled chat answer decoded (its routed entries + messages, KVMemory.chat_ids; "
                   "for a recurrence's chosen answer, the answer's prompt and the answer chosen again here, appended) "
                   "sent as raw text to /v1/completions (same greedy max_tokens); it must decode as many tokens as "
                   "the chat answer, whose text must be this process's recompute of the chat prompt with the chat's "
                   "own cuts (its turns' ends, chat_cuts; unless the stream's text shows U+FFFD: stream_defect), its "
                   "logits' SHA-256 (from the graft point: prefill rows, then every decode step) must equal this "
                   "process's recompute from scratch under the same profile, whose text must be the completion's"}


def _recurrence_prompt(mem, sample: dict, entries: list, recurrence: dict, row: dict) -> tuple[list[int], list[int]]:
    """A chat answer to a recurring problem (memory/recurrence.py) was chosen among the verified working's
    numbers after the answer's own prompt (the entry, the question, "The answer is"), not decoded after
    the chat's. Rebuilt here: that prompt, and the answer chosen again in this process (`answer_from` on
    the same entry); the prompt with the chosen tokens appended is what is checked. Returns (ids, the
    chosen tokens), and records the choice in `row`."""
    from kvmemory.memory.recurrence import ANSWER_PREFIX
    from kvmemory.memory.routing import Recalled

    question = next(m["content"] for m in reversed(sample["messages"]) if m["role"] == "user")
    entry = next(e for e in entries if e.id == recurrence["entry"])
    local = mem.answer_from(question, [Recalled(entry, 1.0, entry.problem)], answer_prefix=ANSWER_PREFIX,
                            choices="numbers")
    row["recurrence"] = {"served": recurrence["answer"], "chosen_here": local.text}
    row["chosen_text"] = local.text
    prompt = mem.question_layout(question, [entry], ANSWER_PREFIX).ids
    return list(prompt) + list(local.token_ids), list(local.token_ids)


# ---------------------------------------------------------------------- the bench
def machine_and_software() -> dict:
    from kvmemory.bench.graft import machine_info

    m = machine_info()
    m["load_average"] = list(os.getloadavg())
    return m


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_serve_bench(clients=DEFAULT_CLIENTS, *, per_kind: int = 3, repeats: int = 3, max_tokens: int = 32,
                    threads: int = 2, seed: int = 0, check_per_kind: int = 1, llamacpp: bool = True,
                    progress: bool = True, batch_slots: int = 16, llama_server: str | None = None,
                    linears: str = "auto") -> dict:
    """The load test (module docstring). Returns the report; `ok` is false if any request failed or
    any sampled answer's logits differ from the recompute. `llama_server`: the llama-server binary
    (else $KVMEMORY_LLAMA_SERVER; neither: that side is not run). `linears`: kvmemory serve's (and the
    recompute's) --linears."""
    from kvmemory.engine.profile import kvmemory_version
    from kvmemory.models.loading import DEFAULT_MODEL, embedded_gguf_path

    missing = [m for m in ("httpx", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise KVMemoryError(f"kvmemory bench serve needs the serve extra (missing {', '.join(missing)}): "
                            "pip install 'kvmemory[serve]'")
    import httpx

    clients = [int(n) for n in clients]
    if not clients or any(n < 1 for n in clients):
        raise InvalidInput(f"clients must be positive counts, got {clients}")
    for name, v, lo in (("per_kind", per_kind, 1), ("repeats", repeats, 1), ("max_tokens", max_tokens, 1),
                        ("threads", threads, 1), ("check_per_kind", check_per_kind, 0)):
        if v < lo:
            raise InvalidInput(f"{name} must be at least {lo}, got {v}")
    llama_server_bin = resolve_llama_server(llama_server)

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    report: dict = {
        "bench": "serve", "model": DEFAULT_MODEL, "kvmemory_version": kvmemory_version(), "commit": git_commit(),
        "settings": {"clients": clients, "per_kind": per_kind, "repeats": repeats, "max_tokens": max_tokens,
                     "threads": threads, "seed": seed, "check_per_kind": check_per_kind, "greedy": True,
                     "batch_slots": batch_slots, "llama_server": llama_server_bin, "linears": linears,
                     "stream": True, "kinds": list(KINDS)},
        "machine": machine_and_software(), "started_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    gguf = str(embedded_gguf_path())
    why_not = None if llamacpp else "not run: switched off (--no-llamacpp)"
    why_not = why_not or llamacpp_missing()
    tmp = tempfile.TemporaryDirectory(prefix="kvmemory-bench-serve-")
    tmp_path = Path(tmp.name)
    servers: dict[str, Server] = {"kvmemory": kvmemory_server(tmp_path, threads, max(clients), batch_slots, linears)}
    if why_not is None:
        servers["llamacpp"] = llamacpp_server(tmp_path, gguf, threads, n_ctx=4096)
    sides: dict = {name: {"ran": True, "command": s.cmd, "runs": []} for name, s in servers.items()}
    if why_not is not None:
        sides["llamacpp"] = {"ran": False, "reason": why_not}
        say(f"llama.cpp side {why_not}")
    sides["kvmemory"]["server"] = {"profile": "default", "threads": threads, "store": "a fresh temporary folder"}
    if "llamacpp" in servers:
        import llama_cpp

        sides["llamacpp"]["server"] = {
            "gguf": gguf, "gguf_bytes": os.path.getsize(gguf), "threads": threads, "n_ctx": 4096,
            "prompt_cache": "ram (llama_cpp.server --cache true --cache_type ram, default cache_size)",
            "build": f"llama-cpp-python {llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode().strip()}"}
    if llama_server_bin is None:
        sides["llama-server"] = {"ran": False, "reason": "not run: no llama-server binary given (--llama-server PATH "
                                 f"or ${LLAMA_SERVER_ENV}; build one with scripts/build_llama_server.sh OUTDIR)"}
        say(f"llama-server side {sides['llama-server']['reason']}")
    else:
        sides["llama-server"] = {
            "ran": True, "command": llama_server_process(tmp_path, llama_server_bin, gguf, threads, 1, "n1").cmd, "runs": [],
            "server": {"binary": llama_server_bin, "gguf": gguf, "gguf_bytes": os.path.getsize(gguf),
                       "threads": threads, "slots": "one per client (-np N), started afresh per run",
                       "n_ctx": f"N x {LLAMA_SERVER_CTX_PER_SLOT} (-c)", "continuous_batching": True,
                       "prompt_cache": "its defaults (slot KV prefix reuse, --cache-ram)",
                       "build": llama_server_version(llama_server_bin)}}
    samples: list[dict] = []
    errors = 0
    live: list[Server] = []  # a llama-server running now, stopped in `finally` should a run raise
    try:
        for name, s in servers.items():
            say(f"starting the {name} server: {' '.join(s.cmd)}")
            s.start()
            sides[name]["start_s"] = s.started_s
            with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:  # one untimed warm-up request
                warm = send(http, s.url, Request(-1, 0, "warmup", 0, WARMUP), max_tokens, {SCOPE_HEADER: "bench-warmup"},
                            time.perf_counter(), s.body_extra)
            if not warm["ok"]:
                raise KVMemoryError(f"the {name} server's warm-up request failed: {warm['error']}\n{s.tail()}")
        for repeat in range(repeats):
            for n in clients:
                wl = make_workload(n, per_kind, seed, repeat)
                headers = {SCOPE_HEADER: wl.tag}
                for name, s in servers.items():
                    run: dict = {"clients": n, "repeat": repeat, "tag": wl.tag}
                    if name == "kvmemory":  # the recurring questions' verified solutions, remembered first (untimed)
                        t = time.perf_counter()
                        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
                            got = [http.post(s.url + "/v1/memory/remember", json=e, headers=headers) for e in wl.library]
                        bad = [f"HTTP {r.status_code}: {r.text[:200]}" for r in got if r.status_code != 200]
                        run["remembered"] = {"entries": [r.json().get("id") for r in got if r.status_code == 200],
                                             "verified": sum(1 for r in got if r.status_code == 200 and r.json().get("verified")),
                                             "errors": bad, "seconds": time.perf_counter() - t}
                        errors += len(bad)
                    offset = s.log_size()
                    say(f"[repeat {repeat + 1}/{repeats}] {name}: {n} client(s), "
                        f"{sum(len(c) for c in wl.clients)} requests")
                    records, wall = run_load(s.url, wl, max_tokens, headers, s.body_extra)
                    run.update(summarize_run(records, wall))
                    if name == "kvmemory":
                        kvmemory_tokens(records, run)
                        rng = random.Random(f"bench-serve-check/{_run_seed(seed, n, repeat)}")
                        for r in pick_checks(records, check_per_kind, rng):
                            msgs = wl.clients[r["client"]][r["seq"]].messages
                            samples.append({**r, "messages": msgs, "user_id": wl.tag, "max_tokens": max_tokens,
                                            "run": f"n{n}-r{repeat}"})
                    else:
                        time.sleep(0.5)  # let its last timings reach the log
                        llamacpp_tokens(s.log_since(offset), records, run)
                    run["records"] = records
                    errors += run["errors"]
                    say(f"    {run['requests_per_s']:.3f} req/s, TTFT p50 {run['ttft_p50_s'] or float('nan'):.3f} s, "
                        f"errors {run['errors']}")
                    sides[name]["runs"].append(run)
                if llama_server_bin is not None:
                    errors += _llama_server_run(tmp_path, llama_server_bin, gguf, threads, n, repeat, wl, max_tokens,
                                                headers, sides["llama-server"], live, say)
        report["load_average_after_load"] = list(os.getloadavg())
        if "llamacpp" in servers:
            servers["llamacpp"].stop()
        if check_per_kind and samples:
            say(f"exactness: {len(samples)} sampled answers, recomputed here")
            report["exactness"] = check_exactness(servers["kvmemory"].url, tmp_path / "store", threads, samples,
                                                  progress, linears)
        else:
            report["exactness"] = {"checked": 0, "ok": check_per_kind == 0, "samples": [],
                                   "how": "not checked (check_per_kind 0)" if check_per_kind == 0 else "no answers"}
    finally:
        for name, s in servers.items():
            rc = s.stop()
            if name in sides and sides[name].get("ran"):
                sides[name]["exit_code"] = rc
        for s in live:
            s.stop()
        tmp.cleanup()
    report["sides"] = sides
    report["summary"] = summary(sides, clients)
    report["errors"] = errors
    report["load_average_after"] = list(os.getloadavg())
    report["ok"] = errors == 0 and bool(report["exactness"]["ok"])
    return report


def _llama_server_run(tmp: Path, binary: str, gguf: str, threads: int, n: int, repeat: int, wl: Workload,
                      max_tokens: int, headers: dict, side: dict, live: list, say) -> int:
    """One run against a llama-server started for it (-np n), warmed up, then stopped; returns its errors."""
    import httpx

    s = llama_server_process(tmp, binary, gguf, threads, n, f"n{n}-r{repeat}")
    live.append(s)
    run: dict = {"clients": n, "repeat": repeat, "tag": wl.tag, "command": s.cmd}
    try:
        say(f"starting the llama-server server: {' '.join(s.cmd)}")
        s.start()
        run["start_s"] = s.started_s
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:  # one untimed warm-up request
            warm = send(http, s.url, Request(-1, 0, "warmup", 0, WARMUP), max_tokens, {SCOPE_HEADER: "bench-warmup"},
                        time.perf_counter(), s.body_extra)
        if not warm["ok"]:
            raise KVMemoryError(f"the llama-server server's warm-up request failed: {warm['error']}\n{s.tail()}")
        say(f"[repeat {repeat + 1}] llama-server: {n} client(s), {sum(len(c) for c in wl.clients)} requests")
        records, wall = run_load(s.url, wl, max_tokens, headers, s.body_extra)
        run.update(summarize_run(records, wall))
        llama_server_tokens(records, run)
        run["records"] = records
        say(f"    {run['requests_per_s']:.3f} req/s, TTFT p50 {run['ttft_p50_s'] or float('nan'):.3f} s, "
            f"errors {run['errors']}")
    finally:
        run["exit_code"] = s.stop()
        live.remove(s)
    side["runs"].append(run)
    return run["errors"]


_METRICS = ("requests_per_s", "decode_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "last_token_p50_s", "last_token_p99_s",
            "tokens_computed_mean", "prompt_tokens_mean", "tokens_grafted_mean")


def summary(sides: dict, clients: list[int]) -> list[dict]:
    """Per side and N: each metric's median [min-max] over the repeats, and the errors summed."""
    out = []
    for name, side in sides.items():
        if not side.get("ran"):
            continue
        for n in clients:
            runs = [r for r in side["runs"] if r["clients"] == n]
            row = {"side": name, "clients": n, "repeats": len(runs), "requests": sum(r["requests"] for r in runs),
                   "errors": sum(r["errors"] for r in runs)}
            for m in _METRICS:
                row[m] = spread([r.get(m) for r in runs])
            row["tokens_source"] = runs[0].get("tokens_source") if runs else None
            out.append(row)
    return out


def _fmt(sp: dict | None, digits: int = 3) -> str:
    if sp is None:
        return "n/a"
    if sp["n"] < 2:
        return f"{sp['median']:.{digits}f}"
    return f"{sp['median']:.{digits}f} [{sp['min']:.{digits}f}-{sp['max']:.{digits}f}]"


def format_table(r: dict) -> str:
    s = r["settings"]
    head = ("| clients | server | requests/s | decode tokens/s | TTFT p50 s | TTFT p99 s | last token p50 s | last token p99 s | "
            "tokens computed / request | prompt tokens / request | errors |")
    out = [f"{r['model']}: {s['per_kind']} requests of each kind ({', '.join(s['kinds'])}) per client, "
           f"max_tokens {s['max_tokens']}, greedy, streamed, {s['threads']} threads per server; "
           f"median [min-max] over {s['repeats']} repeat(s)", "", head, "|" + "---|" * (head.count("|") - 1)]
    for row in r["summary"]:
        out.append(f"| {row['clients']} | {row['side']} | {_fmt(row['requests_per_s'])} | "
                   f"{_fmt(row['decode_tokens_per_s'], 1)} | {_fmt(row['ttft_p50_s'])} | "
                   f"{_fmt(row['ttft_p99_s'])} | {_fmt(row['last_token_p50_s'])} | {_fmt(row['last_token_p99_s'])} | "
                   f"{_fmt(row['tokens_computed_mean'], 1)} | {_fmt(row['prompt_tokens_mean'], 1)} | {row['errors']} |")
    out.append("")
    for name, side in r["sides"].items():
        if not side.get("ran"):
            out.append(f"{name}: {side['reason']}")
        elif name == "llamacpp":
            out.append(f"llama.cpp: {side['server']['build']}")
        elif name == "llama-server":
            out.append(f"llama-server: {side['server']['binary']}: {side['server']['build']}")
    e = r["exactness"]
    out.append(f"exactness: {e.get('equal', 0)} of {e['checked']} sampled kvmemory answers' logits equal a recompute "
               f"here ({e.get('not_checkable', 0)} not checkable; {e.get('stream_text_differs', 0)} whose streamed text "
               "showed U+FFFD and differed from the answer's text)")
    for name, side in r["sides"].items():
        if side.get("ran"):
            n = sum(run.get("answers_with_replacement_char", 0) for run in side["runs"])
            out.append(f"{name}: {n} of {sum(run['requests'] for run in side['runs'])} streamed answers show U+FFFD")
    out.append(f"errors: {r['errors']}; ok: {r['ok']}; load average before {r['machine']['load_average']}, "
               f"after {r['load_average_after']}")
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("requests_per_s", "requests / s"), ("decode_tokens_per_s", "aggregate decode tokens / s"),
              ("ttft_p50_s", "time to first token, p50 (s)"),
              ("last_token_p50_s", "time to last token, p50 (s)"), ("tokens_computed_mean", "prompt tokens computed / request"))
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 4))
    labels = {"kvmemory": "kvmemory serve", "llamacpp": "llama-cpp-python server (prompt cache on)",
              "llama-server": "llama.cpp llama-server (-np N, continuous batching)"}
    for ax, (key, title) in zip(axes, panels):
        for side, marker in (("kvmemory", "D-"), ("llamacpp", "^-"), ("llama-server", "s-")):
            rows = [x for x in r["summary"] if x["side"] == side and x[key] is not None]
            if not rows:
                continue
            ns = [x["clients"] for x in rows]
            med = [x[key]["median"] for x in rows]
            err = [[m - x[key]["min"] for m, x in zip(med, rows)], [x[key]["max"] - m for m, x in zip(med, rows)]]
            ax.errorbar(ns, med, yerr=err, fmt=marker, capsize=3, label=labels[side])
        ax.set_xscale("log", base=2)
        ax.set_xticks(r["settings"]["clients"], [str(n) for n in r["settings"]["clients"]])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    m = r["machine"]
    fig.suptitle(f"kvmemory serve vs llama.cpp's servers, {r['model']}; {m['cpu']} ({m.get('cpu_isa', '?')}), "
                 f"{r['settings']['threads']} threads each; median, bars min-max over {r['settings']['repeats']} repeats",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
