"""Plain transformers decode tokens/s (no kvmemory): the converted float32 folder, sdpa, greedy."""
import json, os, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvmemory.models.loading import resolve_model_path
name, steps = sys.argv[1], int(sys.argv[2])
path = resolve_model_path(name)
tok = AutoTokenizer.from_pretrained(path); model = AutoModelForCausalLM.from_pretrained(path).eval()
ids = tok("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Explain step by step.", return_tensors="pt").input_ids
out = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        for r in range(2):
            l0 = os.getloadavg()[0]
            t0 = time.perf_counter(); model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False); t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=1 + steps, min_new_tokens=1 + steps, do_sample=False); t2 = time.perf_counter()
            d = (t2 - t1) - (t1 - t0)
            row = {"threads": threads, "rep": r, "tokens_per_s": round(steps / d, 2), "load1": round(l0, 2)}
            out.append(row); print(row, file=sys.stderr, flush=True)
print(json.dumps({"model": name, "steps": steps, "runs": out}))
