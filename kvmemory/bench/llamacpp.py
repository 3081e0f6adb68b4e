"""llama.cpp as the answer and agent-loop benches run it: the same GGUF, the same threads, greedy.

Through llama-cpp-python (the optional extra `kvmemory[llamacpp]`). `bench graft` has its own save /
restore class (graft.py `_LlamaCpp`), built on these same calls; these benches also decode after the
restore. `LLAMACPP_CONFIGS` names the settings every bench can run llama.cpp in.

Greedy decoding here is llama.cpp's last logits row's argmax, one `eval` per token, with no end-of-text
check: every side decodes exactly the same number of tokens (kvmemory's runner is called with no stop
tokens). `llama_cpp.Llama.eval` is llama-cpp-python's own batched `llama_decode` loop (n_batch 512).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

MISSING = "llama-cpp-python not installed (pip install 'kvmemory[llamacpp]')"

# llama.cpp's settings measured: llama-cpp-python's defaults (n_batch 512, flash attention off, F16 K/V),
# and the fastest it offers for a CPU prefill (flash attention, with an F16 or a Q8_0 K/V cache: Q8_0
# halves the state a restore reads). GGML type ids: 1 = F16, 8 = Q8_0.
LLAMACPP_CONFIGS = {
    "default": {},
    "flash-f16": {"flash_attn": True, "type_k": 1, "type_v": 1},
    "flash-q8_0": {"flash_attn": True, "type_k": 8, "type_v": 8},
}


def available() -> str | None:
    """None when llama-cpp-python imports, else the reason a bench states for skipping its sides."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return MISSING
    return None


def config(name: str) -> dict:
    """The `Llama` settings called `name` in LLAMACPP_CONFIGS ("default": llama-cpp-python's own;
    "flash-f16" / "flash-q8_0": flash attention with an F16 / Q8_0 K/V cache, its fastest on a CPU)."""
    from kvmemory.errors import InvalidInput

    if name not in LLAMACPP_CONFIGS:
        raise InvalidInput(f"llama.cpp setting must be one of {', '.join(LLAMACPP_CONFIGS)}, got {name!r}")
    return dict(LLAMACPP_CONFIGS[name])


def open_llama(gguf: str, n_ctx: int, threads: int, setting: str = "default"):
    """A `llama_cpp.Llama` on `gguf` with `threads` for prompt and decode alike, its default batch (512),
    no per-position logits kept (as `bench graft` opens it), with the settings `setting` (`config`)."""
    from llama_cpp import Llama

    return Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False, logits_all=False, **config(setting))


def build() -> str:
    """Which llama.cpp ran: llama-cpp-python's version and the SIMD its build uses."""
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode().strip()}"


def save_state_file(llm, ids: list[int], path: Path) -> None:
    """Evaluate `ids` from scratch and write llama.cpp's state of them (`llama_state_save_file`)."""
    import llama_cpp

    llm.reset()
    llm.eval(ids)
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    if not llama_cpp.llama_state_save_file(llm._ctx.ctx, str(path).encode(), arr, len(ids)):
        raise RuntimeError(f"llama.cpp could not save its state to {path}")


def load_state_file(llm, path: Path) -> int:
    """Restore a state written by `save_state_file` (`llama_state_load_file`); returns its token count."""
    import llama_cpp
    import numpy as np

    n_ctx = llm.n_ctx()
    tokens = (llama_cpp.llama_token * n_ctx)()
    count = ctypes.c_size_t(0)
    llm.reset()
    if not llama_cpp.llama_state_load_file(llm._ctx.ctx, str(path).encode(), tokens, n_ctx, ctypes.byref(count)):
        raise RuntimeError(f"llama.cpp could not load its state from {path}")
    n = count.value
    llm.input_ids[:n] = np.ctypeslib.as_array(tokens)[:n]
    llm.n_tokens = n
    return n


def last_argmax(llm) -> int:
    """Greedy: the argmax of the logits of the last token evaluated."""
    import numpy as np

    return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())


def prefill_and_decode(llm, tail: list[int], new_tokens: int, t0: float) -> dict:
    """Evaluate `tail` after whatever the context holds, then decode `new_tokens` greedily (no stop).
    Times are from `t0` (the caller's clock start, before any restore): `ttft_s` to the first new token,
    `decode_s` from that point to the last new token (new_tokens - 1 evals), `total_s` to the end."""
    llm.eval(tail)
    out = [last_argmax(llm)]
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([out[-1]])
        out.append(last_argmax(llm))
    t2 = time.perf_counter()
    return {"tokens": out, "ttft_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}
