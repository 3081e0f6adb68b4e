"""Decode cost per token of an embedded model: wall and process CPU seconds, 1 and 2 threads, with the
load average. On a shared VM the wall rate is what this moment allows; the CPU seconds per token at 1
thread is the work a decode step takes (inflated, not deflated, by contention for caches and memory)."""
import json, os, resource, sys, tempfile, time
from kvmemory.engine.engine import Engine
from kvmemory.models import loading

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime

model, reps, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Explain step by step.")
out = {"model": model, "steps": steps, "runs": []}
with tempfile.TemporaryDirectory() as tmp:
    for threads in (1, 2):
        e = Engine.open(model, f"{tmp}/{threads}", threads=threads)
        out["linear_impl"] = loading.linear_implementation(e.model)
        ids = e.encode(prompt)
        e.forward(ids, graft=False, max_new_tokens=2, stop_token_ids=(), logits="last")
        for r in range(reps):
            l0 = os.getloadavg()[0]
            c0, w0 = cpu(), time.perf_counter()
            _, short = e.forward(ids, graft=False, max_new_tokens=1, stop_token_ids=(), logits="last")
            c1, w1 = cpu(), time.perf_counter()
            _, long = e.forward(ids, graft=False, max_new_tokens=1 + steps, stop_token_ids=(), logits="last")
            c2, w2 = cpu(), time.perf_counter()
            dc = (c2 - c1) - (c1 - c0)
            row = {"threads": threads, "rep": r, "decode_tokens": long.tokens_decoded - short.tokens_decoded,
                   "decode_wall_s": round(long.decode_seconds - short.decode_seconds, 3),
                   "wall_tokens_per_s": round(steps / (long.decode_seconds - short.decode_seconds), 2),
                   "cpu_s_per_token": round(dc / steps, 4), "tokens_per_cpu_s": round(steps / dc, 2) if dc > 0 else None,
                   "load1": round(l0, 2)}
            out["runs"].append(row); print(row, file=sys.stderr, flush=True)
        del e
print(json.dumps(out, indent=1))
