"""Test data shared by the langchain-kvmemory tests (a module, not fixtures, because the standard
suites read their constructor parameters from properties).

`seeded_store()` is a throw-away kvmemory store holding a few verified arithmetic solutions, made once
per process; `tiny_model_path()` is a random-init Llama with SmolLM2's tokenizer saved as a local HF
folder, the "other model" of the model-override tests (any local path works as a model).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path

from kvmemory import generate_problems

PROBLEMS = generate_problems(4, seed=11)
_lock = threading.Lock()
_made: dict[str, str] = {}


def _tmp(name: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"lc-kvmemory-{name}-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def seeded_store() -> str:
    """A store with PROBLEMS remembered (verifier "arithmetic"), in the default namespace."""
    with _lock:
        if "store" not in _made:
            from kvmemory import borrow_memory

            path = str(_tmp("store"))
            sm = borrow_memory(None, None, path)
            with sm.lock:
                for p in PROBLEMS:
                    sm.memory.remember(p.text, p.solution, str(p.answer), verifier="arithmetic")
            _made["store"] = path
        return _made["store"]


def fresh_store() -> str:
    return str(_tmp("fresh"))


def tiny_model_path() -> str:
    """A 2-layer random-init Llama (SmolLM2's vocabulary and tokenizer) saved as an HF folder."""
    with _lock:
        if "tiny" not in _made:
            import torch
            from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

            from kvmemory.models.loading import resolve_model_path

            tok = AutoTokenizer.from_pretrained(resolve_model_path())
            cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
            path = _tmp("tiny-llama") / "tiny-llama-kvmemory-test"
            model.save_pretrained(path)
            tok.save_pretrained(path)
            _made["tiny"] = str(path)
        return _made["tiny"]
