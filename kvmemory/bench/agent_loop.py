"""`kvmemory bench agent-loop`: time to first token per turn of a tool-using agent loop.

Agent frameworks re-send the whole conversation on every model call. The workload is a fixed,
deterministic conversation (`conversation`): a system prompt describing four tools, then user
questions, each answered by a tool call, the tool's result and a final answer. A *turn* is one model
call: its prompt is the whole history so far, chat-rendered, with the assistant's turn opened. The
assistant's messages are fixed texts (not what the model decodes), so every side sees exactly the same
prompt ids at every turn; each side decodes one token (greedy) per turn and we time its arrival.

In-process sides (one process, the model loaded once, the same GGUF file for llama.cpp, the same
threads), each turn run by every side once per repeat, the order rotated per turn:

- **kvmemory**: `KVMemory.chat_prompt(messages, route=False)` under `block_policy="always"` (what a
  framework adapter / `kvmemory serve` does with `store_new_blocks` / `cache_prefixes`: the blocks a
  call computes are stored), then `Engine.forward`: turn k grafts the full blocks turns 1..k-1 stored
  and computes the rest; the new full blocks are stored after the first token (timed apart: `call_s`);
  `logits="last"`, as `KVMemory.generate` answers (the lm_head on the prompt's last position only);
- **kvmemory recompute**: the canonical runner from scratch over the same prompt (no store), in the same mode;
- **llama.cpp RAM cache**: `Llama.set_cache(LlamaRAMCache())`, `create_completion(ids, max_tokens=1,
  temperature=0, stream=True)`; the cache saves each call's state after it (not in the TTFT). The
  Llama object is `reset()` before each call, so its state comes from the cache, not from the live
  context of its previous call (as in a server whose context served other conversations in between);
- **llama.cpp disk cache**: the same with `LlamaDiskCache` (a folder per repeat);
- **llama.cpp live context**: one Llama object kept for this conversation alone, no cache: its
  `generate` reuses the longest common prefix of what its context holds (llama-cpp-python's default;
  the best llama.cpp can do for one conversation in one process, and what a restart loses).

llama.cpp runs with llama-cpp-python's default settings unless `llamacpp_setting` (`--llamacpp-setting`)
names flash attention with an F16 or Q8_0 K/V cache (`bench graft`'s LLAMACPP_CONFIGS); the report names
the one used. kvmemory runs its default profile.

After a **process restart** (at `restart_turns`, before the in-process sides run that turn, so the
state is the one turns 1..k-1 left): a fresh `python -m kvmemory.bench.agent_loop --worker` process
(its pid is reported) opens the model, runs one untimed unrelated warm-up, then times turn k for
kvmemory reopening the store folder, llama.cpp with a new (empty: the old one died with its process)
LlamaRAMCache, i.e. from scratch, and llama.cpp with the persisted LlamaDiskCache folder. The worker
writes nothing (kvmemory with `store_new_blocks=False`; llama.cpp's disk cache is a copy made before
the worker starts, because `LlamaDiskCache` pops the entry it reads), so the in-process sides' turn k
sees the state it would have without the restart. Model loading is timed apart (`open_s`), not in the
TTFT. The OS page cache survives a process restart, so the store's and the disk cache's files are hot
on both sides, as they are on a machine whose agent process restarts.

Every sample is kept in the JSON. The whole loop is repeated `repeats` times from fresh state (a new
store folder, new caches); per turn, medians [min-max] over the repeats. Exactness is checked by
equality, never timed: kvmemory's first token equals its recompute's at every turn; turn k grafts at
least the full blocks it shares with turn k-1's prompt (`expected_min_grafted`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvmemory.bench import llamacpp
from kvmemory.bench.answer import leading_equal
from kvmemory.bench.graft import machine_info, spread

IN_PROCESS = ("kvmemory", "recompute", "llamacpp_ram", "llamacpp_disk", "llamacpp_live")
RESTART = ("kvmemory", "llamacpp_ram", "llamacpp_disk")
LABELS = {"kvmemory": "kvmemory (stores each turn's blocks, grafts them)", "recompute": "kvmemory recompute",
          "llamacpp_ram": "llama.cpp LlamaRAMCache", "llamacpp_disk": "llama.cpp LlamaDiskCache",
          "llamacpp_live": "llama.cpp live context (prefix reuse)"}
RESTART_LABELS = {"kvmemory": "kvmemory (store reopened)", "llamacpp_ram": "llama.cpp RAM cache (gone: from scratch)",
                  "llamacpp_disk": "llama.cpp disk cache (persisted)"}

SYSTEM = """You are an assistant that answers with the help of tools. To call a tool, write one line
<tool_call>{"name": NAME, "arguments": {...}}</tool_call> and wait for its result in a tool message.
You may call these tools:
<tools>
{"name": "get_weather", "description": "Current weather and the next three days' forecast for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name, e.g. Lisbon"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}
{"name": "calculator", "description": "Evaluate an arithmetic expression exactly.", "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}}, "required": ["expression"]}}
{"name": "search_docs", "description": "Search the team's internal documentation; returns the three best passages.", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
{"name": "get_time", "description": "The current local time in a time zone.", "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "description": "IANA name, e.g. Europe/Paris"}}, "required": ["timezone"]}}
</tools>
Answer in one or two sentences once you have what you need."""

# (user question, tool call, tool result, final answer): fixed texts, so every side sees the same prompts.
SCENARIOS = [
    ("What's the weather in Lisbon tomorrow?", '{"name": "get_weather", "arguments": {"city": "Lisbon"}}',
     '{"city": "Lisbon", "now": {"temp_c": 19, "sky": "clear"}, "forecast": [{"day": "Tue", "high_c": 22, '
     '"low_c": 15, "sky": "sunny"}, {"day": "Wed", "high_c": 21, "low_c": 14, "sky": "cloudy"}, {"day": "Thu", '
     '"high_c": 18, "low_c": 13, "sky": "rain"}]}', "Tomorrow in Lisbon: sunny, 22 °C high and 15 °C low."),
    ("How much is 1284 times 37, minus 912?", '{"name": "calculator", "arguments": {"expression": "1284 * 37 - 912"}}',
     '{"expression": "1284 * 37 - 912", "result": 46596}', "1284 × 37 − 912 = 46,596."),
    ("How do I rotate the API keys of the staging cluster?",
     '{"name": "search_docs", "arguments": {"query": "rotate API keys staging cluster"}}',
     '[{"title": "Key rotation runbook", "passage": "Staging keys are rotated with `ops keys rotate --env staging`. '
     'The command issues new keys, keeps the old ones valid for 24 hours and posts the new fingerprints to '
     '#ops-alerts."}, {"title": "Access policy", "passage": "Only members of the platform group may rotate keys; '
     'every rotation is logged with the operator\'s name."}, {"title": "FAQ", "passage": "If a service fails after '
     'a rotation, restart it: services read keys at start-up only."}]',
     "Run `ops keys rotate --env staging` (platform group only); old keys stay valid 24 hours, and restart any "
     "service that fails."),
    ("What time is it in Tokyo right now?", '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}',
     '{"timezone": "Asia/Tokyo", "local_time": "2024-05-14T21:42:07+09:00", "utc_offset": "+09:00"}',
     "It is 21:42 in Tokyo."),
    ("And the weather in Oslo, in fahrenheit?",
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}',
     '{"city": "Oslo", "now": {"temp_f": 48, "sky": "overcast"}, "forecast": [{"day": "Tue", "high_f": 52, '
     '"low_f": 41, "sky": "showers"}, {"day": "Wed", "high_f": 55, "low_f": 43, "sky": "cloudy"}, {"day": "Thu", '
     '"high_f": 57, "low_f": 44, "sky": "sunny"}]}', "Oslo is 48 °F and overcast now; showers tomorrow, 52 °F high."),
    ("Split a bill of 318.60 between 7 people: how much each?",
     '{"name": "calculator", "arguments": {"expression": "318.60 / 7"}}',
     '{"expression": "318.60 / 7", "result": 45.5142857}', "About 45.51 each."),
    ("Where is the on-call schedule documented?",
     '{"name": "search_docs", "arguments": {"query": "on-call schedule"}}',
     '[{"title": "On-call", "passage": "The schedule lives in the Rotations calendar; swaps are agreed in '
     '#oncall and recorded there by the person taking the shift."}, {"title": "Escalation", "passage": "Page '
     'the secondary after 15 minutes without acknowledgement; the engineering manager after 30."}, {"title": '
     '"Handover", "passage": "Each Monday at 10:00 the outgoing engineer writes a handover note in the '
     'incident channel."}]', "In the Rotations calendar; swaps are agreed in #oncall and recorded there."),
    ("What's 15% of 2,480 plus 96?", '{"name": "calculator", "arguments": {"expression": "0.15 * 2480 + 96"}}',
     '{"expression": "0.15 * 2480 + 96", "result": 468}', "15 % of 2,480 plus 96 is 468."),
    ("Is it daytime in Sydney now?", '{"name": "get_time", "arguments": {"timezone": "Australia/Sydney"}}',
     '{"timezone": "Australia/Sydney", "local_time": "2024-05-14T22:42:07+10:00", "utc_offset": "+10:00"}',
     "No: it is 22:42 in Sydney, night time."),
    ("How do we request a new staging database?",
     '{"name": "search_docs", "arguments": {"query": "request new staging database"}}',
     '[{"title": "Databases", "passage": "Open a ticket in the PLAT queue with the template \\"New database\\"; '
     'staging databases are provisioned within one working day and deleted after 90 days without '
     'connections."}, {"title": "Sizes", "passage": "Staging databases default to 2 vCPU and 20 GB; larger '
     'sizes need the team lead\'s approval in the ticket."}, {"title": "Backups", "passage": "Staging is '
     'backed up nightly and kept for 7 days."}]',
     "Open a PLAT ticket with the \"New database\" template; it is ready within a working day (2 vCPU, 20 GB "
     "by default)."),
]


def conversation(turns: int) -> list[list[dict]]:
    """The messages of each turn's prompt (turn k = index k - 1): the history so far, the last message
    a user question (odd turns) or a tool result (even turns). Scenarios repeat after 20 turns."""
    history = [{"role": "system", "content": SYSTEM}]
    out = []
    for k in range(turns):
        user, call, result, answer = SCENARIOS[(k // 2) % len(SCENARIOS)]
        if k % 2 == 0:
            history.append({"role": "user", "content": user})
            out.append(list(history))
            history.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
            history.append({"role": "tool", "content": result})
        else:
            out.append(list(history))
            history.append({"role": "assistant", "content": answer})
    return out


def turn_prompts(mem, turns: int) -> list[list[int]]:
    """Each turn's prompt ids, as `KVMemory.chat` lays them out with routing off; under
    `block_policy="always"` every call stores the blocks it computes."""
    prompts = [mem.chat_prompt(msgs, route=False) for msgs in conversation(turns)]
    assert all(p.store_new_blocks for p in prompts), "the bench's memory must store every turn's blocks"
    return [p.ids for p in prompts]


# ---------------------------------------------------------------------------------------------------
# One turn of each side; each returns {"ttft_s": ..., "call_s": ..., "first_token": ...} (+ side's own)
# ---------------------------------------------------------------------------------------------------

def _kvmemory_turn(mem, ids: list[int], store: bool) -> dict:
    eng = mem.engine
    marks: list[float] = []

    def on_token(tok: int) -> bool:
        marks.append(time.perf_counter())
        return False

    t0 = time.perf_counter()
    # logits="last", as the adapters' and the server's chat answers run (KVMemory.generate)
    res, rep = eng.forward(ids, max_new_tokens=1, stop_token_ids=(), store_new_blocks=store, on_token=on_token,
                           logits="last")
    t1 = time.perf_counter()
    return {"ttft_s": marks[0] - t0, "call_s": t1 - t0, "first_token": res.generated[0],
            "tokens_grafted": rep.tokens_grafted, "tokens_computed": rep.tokens_computed,
            "blocks_stored": rep.blocks_stored}


def _recompute_turn(eng, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    res = eng.recompute(ids, max_new_tokens=1, keep_logits=False, logits="last")
    t = time.perf_counter() - t0
    return {"ttft_s": t, "call_s": t, "first_token": res.generated[0]}


def _llama_turn(llm, ids: list[int], reset: bool) -> dict:
    """One streamed completion of one token; the first chunk is the first token (the cache's save, if
    any, happens after it)."""
    import numpy as np

    if reset:
        llm.reset()
    t0 = time.perf_counter()
    ttft = None
    # LlamaDiskCache prints each save to stderr; kept off the bench's output.
    with contextlib.redirect_stderr(io.StringIO()):
        for _ in llm.create_completion(ids, max_tokens=1, temperature=0.0, stream=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    n = len(ids)
    if not np.array_equal(llm.input_ids[:n], np.asarray(ids)):  # what llama.cpp evaluated is our prompt
        raise RuntimeError("llama.cpp evaluated other tokens than the prompt's")
    # temperature 0 is greedy: the token is the argmax of the prompt's last logits, still in the context
    return {"ttft_s": ttft, "call_s": t1 - t0, "first_token": llamacpp.last_argmax(llm)}


# ---------------------------------------------------------------------------------------------------
# The restart worker: a fresh process, JSON on stdout
# ---------------------------------------------------------------------------------------------------

WARM_TEXT = "Warm-up text, unrelated to the conversation, so that first-call allocations are not timed."


def worker(args: dict) -> dict:
    """Turn `args['turn']` in this fresh process: kvmemory reopening `args['store']`, llama.cpp with an
    empty RAM cache and with the disk cache folder `args['disk_cache']`."""
    t_start = time.perf_counter()
    from kvmemory.engine.engine import Engine
    from kvmemory.memory.facade import KVMemory
    from kvmemory.models.loading import DEFAULT_MODEL

    out: dict = {"pid": os.getpid(), "turn": args["turn"]}
    eng = Engine.open(DEFAULT_MODEL, args["store"], threads=args["threads"])
    mem = KVMemory(engine=eng, block_policy="always")
    out["kvmemory_open_s"] = time.perf_counter() - t_start  # imports + model load + store open
    out["profile_id"] = eng.profile_id
    ids = turn_prompts(mem, args["turn"])[-1]
    warm = eng.encode(WARM_TEXT)
    eng.forward(warm, max_new_tokens=1, stop_token_ids=())  # nothing stored: it routes nowhere, stores nothing
    llm = None
    if args.get("gguf"):
        from llama_cpp import LlamaDiskCache, LlamaRAMCache

        t = time.perf_counter()
        llm = llamacpp.open_llama(args["gguf"], args["n_ctx"], args["threads"], args.get("setting", "default"))
        out["llamacpp_open_s"] = time.perf_counter() - t
        llm.eval(warm)
        llm.reset()
    sides = {"kvmemory": lambda: _kvmemory_turn(mem, ids, store=False)}
    if llm is not None:
        def ram():
            llm.set_cache(LlamaRAMCache())  # a new process: the old RAM cache is gone
            return _llama_turn(llm, ids, reset=True)

        def disk():
            llm.set_cache(LlamaDiskCache(args["disk_cache"]))  # persisted by the process before
            return _llama_turn(llm, ids, reset=True)

        sides["llamacpp_ram"], sides["llamacpp_disk"] = ram, disk
    order = [s for s in args.get("order", RESTART) if s in sides]
    for name in order:
        out[name] = sides[name]()
    out["order"] = order
    return out


def _restart(args: dict, timeout: float) -> dict:
    """Run the worker in a new Python process and read its JSON (the last line of its stdout)."""
    cmd = [sys.executable, "-m", "kvmemory.bench.agent_loop", "--worker", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"restart worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])


# ---------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------

def run_agent_loop_bench(turns: int = 20, *, repeats: int = 5, restart_turns=None, threads: int | None = None,
                         llamacpp_sides: bool = True, llamacpp_setting: str = "default", progress: bool = True,
                         worker_timeout: float = 900) -> dict:
    """Run the bench (see the module docstring); `llamacpp_setting` names llama.cpp's settings
    (llamacpp.config: its defaults, or flash attention with an F16 / Q8_0 K/V cache)."""
    import torch

    from kvmemory.engine.engine import Engine, graft_point_for
    from kvmemory.errors import InvalidInput
    from kvmemory.memory.facade import KVMemory
    from kvmemory.models.loading import DEFAULT_MODEL, embedded_gguf_path
    from kvmemory.store.open import open_store

    if turns < 1:
        raise InvalidInput(f"turns must be at least 1, got {turns}")
    if repeats < 1:
        raise InvalidInput(f"repeats must be at least 1, got {repeats}")
    restart_turns = sorted(set(range(5, turns + 1, 5)) if restart_turns is None else {int(t) for t in restart_turns})
    if any(not 1 <= t <= turns for t in restart_turns):
        raise InvalidInput(f"restart turns must be between 1 and {turns}, got {restart_turns}")
    llamacpp.config(llamacpp_setting)
    threads = threads or torch.get_num_threads()
    tmp = tempfile.TemporaryDirectory(prefix="kvmemory-bench-agent-loop-")
    try:
        eng = Engine.open(DEFAULT_MODEL, f"{tmp.name}/warm-store", threads=threads)
        C = eng.chunk
        prompts = turn_prompts(KVMemory(engine=eng, block_policy="always"), turns)
        n_ctx = max(map(len, prompts)) + 64
        warm = eng.encode(WARM_TEXT)
        skip = None if llamacpp_sides else "not requested (--no-llamacpp)"
        skip = skip or llamacpp.available()
        gguf = None if skip else str(embedded_gguf_path())
        llms = {}
        if gguf:
            # One Llama object per llama.cpp side, so that no side's live context serves another's turn.
            llms = {name: llamacpp.open_llama(gguf, n_ctx, threads, llamacpp_setting)
                    for name in ("llamacpp_ram", "llamacpp_disk", "llamacpp_live")}
        # Warm every side once on an unrelated prompt (first calls allocate), before any cache exists.
        eng.forward(warm, max_new_tokens=1, stop_token_ids=())
        eng.recompute(warm, max_new_tokens=1, keep_logits=False)
        for llm in llms.values():
            llm.eval(warm)
            llm.reset()

        # Expected grafts: the full blocks turn k shares with turn k-1's prompt (all of which turn k-1 stored).
        expected = [0] + [min(leading_equal(prompts[k - 1], prompts[k]) // C * C, graft_point_for(len(prompts[k]), C))
                          for k in range(1, turns)]
        samples = {name: [[] for _ in range(turns)] for name in IN_PROCESS}
        restarts: dict[int, list[dict]] = {t: [] for t in restart_turns}
        bar = tqdm(total=repeats * turns, desc="turns", disable=not progress)
        for r in range(repeats):
            # Fresh state per repeat: a new store folder for the same engine (same profile), new caches.
            store_dir = Path(tmp.name) / f"r{r}" / "store"
            eng.store = open_store(str(store_dir))
            eng.store.put_profile(eng.profile_id, eng.profile.to_dict())
            mem = KVMemory(engine=eng, block_policy="always")
            disk_dir = Path(tmp.name) / f"r{r}" / "llama-disk-cache"
            sides = {"kvmemory": lambda ids: _kvmemory_turn(mem, ids, store=True),  # block_policy "always"
                     "recompute": lambda ids: _recompute_turn(eng, ids)}
            if llms:
                from llama_cpp import LlamaDiskCache, LlamaRAMCache

                llms["llamacpp_ram"].set_cache(LlamaRAMCache())
                llms["llamacpp_disk"].set_cache(LlamaDiskCache(str(disk_dir)))
                llms["llamacpp_live"].reset()
                sides["llamacpp_ram"] = lambda ids: _llama_turn(llms["llamacpp_ram"], ids, reset=True)
                sides["llamacpp_disk"] = lambda ids: _llama_turn(llms["llamacpp_disk"], ids, reset=True)
                sides["llamacpp_live"] = lambda ids: _llama_turn(llms["llamacpp_live"], ids, reset=False)
            names = list(sides)
            for k, ids in enumerate(prompts, start=1):
                if k in restart_turns:
                    copy = None
                    if gguf:  # the worker reads a copy: LlamaDiskCache pops what it reads
                        copy = Path(tmp.name) / f"r{r}" / f"disk-cache-restart-{k}"
                        if disk_dir.exists():
                            shutil.copytree(disk_dir, copy)
                        else:
                            copy.mkdir(parents=True)
                    rot = RESTART[r % len(RESTART):] + RESTART[: r % len(RESTART)]
                    got = _restart({"store": str(store_dir), "disk_cache": str(copy) if copy else None, "turn": k,
                                    "threads": threads, "n_ctx": n_ctx, "gguf": gguf, "order": list(rot),
                                    "setting": llamacpp_setting},
                                   worker_timeout)
                    if got["profile_id"] != eng.profile_id:
                        raise RuntimeError("the restarted process opened another execution profile")
                    got["expected_min_grafted"] = expected[k - 1]
                    restarts[k].append(got)
                    if copy is not None:
                        shutil.rmtree(copy, ignore_errors=True)
                for name in names[k % len(names):] + names[: k % len(names)]:  # rotated per turn
                    samples[name][k - 1].append(sides[name](ids))
                bar.update()
            # This repeat's store and disk cache are done with (llama.cpp's saved states are ~100 MB each).
            shutil.rmtree(Path(tmp.name) / f"r{r}", ignore_errors=True)
        bar.close()

        rows = []
        for k in range(1, turns + 1):
            s = {name: samples[name][k - 1] for name in names}
            kv = s["kvmemory"]
            row = {"turn": k, "prompt_tokens": len(prompts[k - 1]),
                   "shared_with_previous": leading_equal(prompts[k - 2], prompts[k - 1]) if k > 1 else 0,
                   "expected_min_grafted": expected[k - 1],
                   "tokens_grafted": [x["tokens_grafted"] for x in kv],
                   "tokens_computed": [x["tokens_computed"] for x in kv],
                   "blocks_stored": [x["blocks_stored"] for x in kv],
                   # exact: the grafted first token is the recompute's, every repeat
                   "first_token_equal_recompute": [a["first_token"] == b["first_token"]
                                                   for a, b in zip(kv, s["recompute"])],
                   "ttft_s": {name: {**spread([x["ttft_s"] for x in xs]), "samples": [x["ttft_s"] for x in xs]}
                              for name, xs in s.items()},
                   "call_s": {name: {**spread([x["call_s"] for x in xs]), "samples": [x["call_s"] for x in xs]}
                              for name, xs in s.items()},
                   "first_tokens": {name: [x["first_token"] for x in xs] for name, xs in s.items()}}
            if k in restarts:
                rs = restarts[k]
                row["restart"] = {
                    "pids": [x["pid"] for x in rs],
                    "ttft_s": {name: {**spread([x[name]["ttft_s"] for x in rs]),
                                      "samples": [x[name]["ttft_s"] for x in rs]}
                               for name in RESTART if name in rs[0]},
                    "tokens_grafted": [x["kvmemory"]["tokens_grafted"] for x in rs],
                    "first_token_equal_recompute": [x["kvmemory"]["first_token"] == s["recompute"][0]["first_token"]
                                                    for x in rs],
                    "kvmemory_open_s": [x["kvmemory_open_s"] for x in rs],
                    "llamacpp_open_s": [x.get("llamacpp_open_s") for x in rs],
                    "workers": rs}
            rows.append(row)
        totals = {name: sum(row["ttft_s"][name]["median"] for row in rows) for name in names}
        measured = rows[restart_turns[0] - 1]["restart"]["ttft_s"] if restart_turns else {}
        restart_totals = {name: sum(rows[k - 1]["restart"]["ttft_s"][name]["median"] for k in restart_turns)
                          for name in RESTART if name in measured}
        return {"bench": "agent-loop", "model": eng.loaded.source, "profile_id": eng.profile_id,
                "dtype": eng.profile.dtype, "kv_dtype": eng.profile.kv_dtype,
                "attn_implementation": eng.profile.attn_implementation, "linear_impl": eng.profile.linear_impl,
                "chunk": C, "threads": threads, "turns": turns, "repeats": repeats, "restart_turns": restart_turns,
                "sides_measured": names, "restart_sides_measured": [n for n in RESTART if n in sides],
                "llamacpp": skip or (f"{llamacpp.build()}, on the same GGUF file ({Path(gguf).name}), {threads} "
                                     f"threads, setting {llamacpp_setting} {llamacpp.config(llamacpp_setting)}"),
                "llamacpp_setting": llamacpp_setting,
                "bench_pid": os.getpid(), "machine": machine_info(), "rows": rows,
                "total_ttft_s": totals, "restart_total_ttft_s": restart_totals,
                "what": {name: LABELS[name] for name in names}}
    finally:
        tmp.cleanup()


def _cell(s: dict) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def format_table(r: dict) -> str:
    names = r["sides_measured"]
    out = [f"profile: {r['dtype']} compute, {r['kv_dtype']} K/V, {r['attn_implementation']}, linears "
           f"{r['linear_impl']}; {r['threads']} threads; {r['turns']} turns, whole history re-sent each turn; "
           f"time to first token, median [min-max] over {r['repeats']} repeats from fresh state", ""]
    head = "| turn | prompt tokens | grafted | " + " | ".join(LABELS[n] for n in names) + " |"
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    for x in r["rows"]:
        out.append(f"| {x['turn']} | {x['prompt_tokens']} | {min(x['tokens_grafted'])} | "
                   + " | ".join(_cell(x["ttft_s"][n]) for n in names) + " |")
    out.append("| total | | | " + " | ".join(f"{r['total_ttft_s'][n]:.3f}" for n in names) + " |")
    if r["restart_turns"]:
        rn = [n for n in RESTART if n in r["restart_total_ttft_s"]]
        out += ["", "after a process restart (a fresh process per sample; model load not in the TTFT):", ""]
        head = ("| turn | grafted | " + " | ".join(RESTART_LABELS[n] for n in rn)
                + " | model load s (kvmemory / llama.cpp) |")
        out += [head, "|" + "---|" * (head.count("|") - 1)]
        for t in r["restart_turns"]:
            x = r["rows"][t - 1]["restart"]
            lo = [v for v in x["llamacpp_open_s"] if v is not None]
            out.append(f"| {t} | {min(x['tokens_grafted'])} | " + " | ".join(_cell(x["ttft_s"][n]) for n in rn)
                       + f" | {min(x['kvmemory_open_s']):.1f} / {min(lo) if lo else float('nan'):.2f} |")
        out.append("| total | | " + " | ".join(f"{r['restart_total_ttft_s'][n]:.3f}" for n in rn) + " | |")
    exact = all(all(x["first_token_equal_recompute"]) for x in r["rows"])
    out += ["", f"kvmemory's first token equal to its recompute's at every turn: {'yes' if exact else 'NO'}",
            f"llama.cpp: {r['llamacpp']}"]
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [x["turn"] for x in r["rows"]]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, marker in zip(r["sides_measured"], "Dos^v"):
        ax.plot(turns, [x["ttft_s"][name]["median"] for x in r["rows"]], marker + "-", label=LABELS[name], ms=4)
    marks = {"kvmemory": "D", "llamacpp_ram": "o", "llamacpp_disk": "^"}
    for name in r["restart_total_ttft_s"]:
        ts = r["restart_turns"]
        ax.scatter(ts, [r["rows"][t - 1]["restart"]["ttft_s"][name]["median"] for t in ts], marker=marks[name],
                   s=70, facecolors="none", edgecolors="k", label=f"after a restart: {RESTART_LABELS[name]}")
    ax.set_yscale("log")
    ax.set_xlabel("turn (the whole history re-sent)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"Agent loop, {r['model']}; {r['machine']['cpu']}, {r['threads']} threads (median of "
                 f"{r['repeats']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    # `python -m kvmemory.bench.agent_loop --worker JSON`: the restart side (a fresh process), JSON on stdout.
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        result = worker(json.loads(sys.argv[2]))
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.exit("usage: python -m kvmemory.bench.agent_loop --worker JSON (the bench: kvmemory bench agent-loop)")
