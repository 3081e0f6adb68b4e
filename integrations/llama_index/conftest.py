"""Shared fixtures of the LlamaIndex integration tests: the embedded SmolLM2 behind one `KVMemory`
(loaded once per session, on a throw-away store), the recurring-problems set remembered once, and a
guard that fails any test in which LlamaIndex resolves a default model from `Settings`.

Without the guard a component built without `llm=` would quietly reach for OpenAI (or, with
IS_TESTING set, a MockLLM), and a test could pass without ever running our model.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# LlamaIndex answers "default" with a MockLLM when IS_TESTING is set: that would hide a missing llm=.
os.environ.pop("IS_TESTING", None)

from dataclasses import dataclass

import pytest

# Model outputs are kept short: SmolLM2 decodes ~15-20 tokens/s on a 2-core CPU (less when shared).
TEST_MAX_NEW_TOKENS = 16
RECURRING_NAMESPACE = "recurring"


class DefaultModelTouched(AssertionError):
    """A LlamaIndex component fell back to Settings' default LLM or embedding model."""


def _guarded(prop: property, attr: str, what: str) -> property:
    def get(self):
        if getattr(self, attr) is None:
            raise DefaultModelTouched(
                f"LlamaIndex asked Settings for its default {what} (it would resolve OpenAI or a mock); "
                f"pass the model explicitly (llm=..., embed_model=...) or set Settings.{what} yourself")
        return prop.fget(self)

    return property(get, prop.fset)


@pytest.fixture(autouse=True)
def no_default_models(monkeypatch):
    """Every test here runs with Settings.llm / Settings.embed_model refusing to resolve a default."""
    from llama_index.core.settings import Settings, _Settings

    monkeypatch.setattr(_Settings, "llm", _guarded(_Settings.llm, "_llm", "llm"))
    monkeypatch.setattr(_Settings, "embed_model", _guarded(_Settings.embed_model, "_embed_model", "embed_model"))
    was_llm, was_embed = Settings._llm, Settings._embed_model
    yield
    # Nothing may have been resolved (or set globally) behind the test's back either.
    assert Settings._llm is was_llm, "Settings.llm was set or resolved during the test"
    assert Settings._embed_model is was_embed, "Settings.embed_model was set or resolved during the test"


@pytest.fixture(scope="session")
def li_memory(tmp_path_factory):
    """The embedded SmolLM2 and a fresh store, shared by every LlamaIndex test (loading takes seconds)."""
    from kvmemory import KVMemory

    # probe_tokens=1: each remembered entry's attestation decodes one token instead of four. The graft
    # is still proven bit-identical over the whole prompt; it halves the fixture's model time.
    return KVMemory(store=tmp_path_factory.mktemp("li-store") / "store", probe_tokens=1)


@dataclass(frozen=True)
class Recurring:
    """The remembered recurring-problems set: per problem its entry id and its (unseen) rewordings."""

    cases: list[tuple[str, list[str]]]
    problems: list
    namespace: str = RECURRING_NAMESPACE

    def entry_for(self, i: int):
        return self.cases[i][0]


@pytest.fixture(scope="session")
def li_recurring(li_memory) -> Recurring:
    """10 seeded word problems x 2 rewordings, each solution remembered (arithmetic-verified) once."""
    from kvmemory import generate_problems
    from llama_index.retrievers.kvmemory import remember_recurring

    problems = generate_problems(10, 0, rewordings=2)
    cases = remember_recurring(li_memory, n=10, seed=0, rewordings=2, namespace=RECURRING_NAMESPACE)
    return Recurring(cases=cases, problems=problems)


@pytest.fixture(scope="session")
def li_llm(li_memory):
    from llama_index.llms.kvgraft import KVGraftLLM

    return KVGraftLLM(memory=li_memory, max_new_tokens=TEST_MAX_NEW_TOKENS, namespace=RECURRING_NAMESPACE)


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> str:
    """A 1-layer random-init Llama with SmolLM2's tokenizer, saved as a Hugging Face folder (the device
    tests open their own memories on it: seconds, not the embedded model's gigabyte)."""
    import torch
    import transformers as T

    from kvmemory.models.loading import resolve_model_path

    root = tmp_path_factory.mktemp("li-tiny") / "model"
    tok = T.AutoTokenizer.from_pretrained(resolve_model_path())
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, head_dim=16,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)
