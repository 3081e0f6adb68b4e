"""A user's own GGUF file (models/gguf_file.py, gguf_model.py, gguf_embedding.py): opened by path, computed
from its blocks, exact.

Files are written by the tests (tests/gguf_files.py: every architecture of the matrix, every block type).
Checked: each architecture's logits agree with transformers' own GGUF reader (which dequantizes to float32:
a reference sharing none of kvmemory's loading; the sums' order differs, so close, not equal) and argmax
agrees; no linear or embedding holds a float32 matrix; a graft equals its recompute byte for byte for every
architecture and block type; split files and folders open; what kvmemory cannot compute is refused by name
before a weight is read; the CLI and `kvmemory serve` take `--model FILE.gguf`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf
from tiny_models import ARCHS, assert_graft_equals_recompute

from kvmemory.errors import UnknownModel, UnsupportedModel
from kvmemory.kernels import native
from kvmemory.models import gguf_blocks, gguf_file
from kvmemory.models.gguf_embedding import GGUFEmbedding
from kvmemory.models.gguf_linear import GGUFLinear
from kvmemory.models.loading import load_model

pytestmark = pytest.mark.skipif(native.choose("qlinear")[0] is None,
                                reason="GGUF files compute with the GGUF-block kernel (AVX-512 or AVX2 CPUs)")
TEXT = "Hello there, the world is a wide place and the sea is deep. " * 3


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEMORY_CACHE", str(tmp_path / "cache"))


def _reference_logits(path, ids, folder, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                               config=AutoConfig.from_pretrained(folder),
                                               attn_implementation="eager").eval()
    with torch.inference_mode():
        return ref(ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_agrees_with_transformers_own_gguf_reader(arch, tmp_path):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, linear_type="Q8_0")[0]
    loaded = load_model(str(path))
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, GGUFLinear) and m.weight is None for m in linears)  # no float32 copies
    assert isinstance(model.get_input_embeddings(), GGUFEmbedding)
    assert not any(p.is_meta for p in model.parameters())
    ids = torch.tensor([loaded.tokenizer(TEXT)["input_ids"]])
    with torch.inference_mode():
        mine = model(ids).logits
    ref = _reference_logits(path, ids, loaded.path, arch)
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()
    # the chat template comes from the file's own metadata
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True) == "<|user|>hi<|end|><|assistant|>"


def _graft_check(path, tmp_path):
    from kvmemory.engine.engine import Engine

    eng = Engine.open(str(path), tmp_path / "store", chunk=16)
    assert eng.profile.to_dict()["model_sha256"].startswith("files:")
    ids = eng.loaded.tokenizer(TEXT)["input_ids"]
    assert len(ids) > 70
    assert_graft_equals_recompute(eng, ids, 48, 4)


@pytest.mark.parametrize("kind", gguf_blocks.TYPES)
def test_graft_equals_recompute_for_every_block_type(kind, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", linear_type=kind, embedding_type=kind,
                           tied=kind != "Q6_K", seed=1)[0]
    _graft_check(path, tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_graft_equals_recompute_for_every_architecture(arch, tmp_path):
    """K-quant blocks (Q4_K linears, a Q6_K embedding) under every architecture."""
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, linear_type="Q4_K", embedding_type="Q6_K", seed=2)[0]
    _graft_check(path, tmp_path)


def test_split_files_and_folders_open_as_one_model(tmp_path):
    one = write_tiny_gguf(tmp_path / "one" / "m.gguf", "qwen2", tied=False)[0]
    parts = write_tiny_gguf(tmp_path / "split" / "m.gguf", "qwen2", tied=False, split=3)
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    ref = load_model(str(one))
    ids = torch.tensor([ref.tokenizer(TEXT)["input_ids"]])
    with torch.inference_mode():
        want = ref.model(ids).logits
    for name in (str(parts[0]), str(parts[2]), str(tmp_path / "split"), str(tmp_path / "one")):
        got = load_model(name)
        with torch.inference_mode():
            assert torch.equal(got.model(ids).logits, want), name
    assert gguf_file.find(str(parts[1])).parts == tuple(parts)
    parts[1].unlink()
    with pytest.raises(UnknownModel, match="m-00002-of-00003.gguf"):
        load_model(str(parts[0]))
    write_tiny_gguf(tmp_path / "one" / "other.gguf", "llama")
    with pytest.raises(UnknownModel, match="several GGUF models"):
        load_model(str(tmp_path / "one"))


def test_what_kvmemory_cannot_compute_is_refused_by_name_before_loading(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModel, match="'gpt2' architecture"):
        load_model(str(tmp_path / "gpt2.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 144), dtype=np.uint8),  # 256 weights a row
                 raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModel, match=r"blk.0.attn_q.weight \(IQ4_NL\)"):
        load_model(str(tmp_path / "iq.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(UnsupportedModel, match="not a readable GGUF"):
        load_model(str(tmp_path / "junk.gguf"))
    truncated = write_tiny_gguf(tmp_path / "t" / "cut.gguf", "llama")[0]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    with pytest.raises(UnsupportedModel, match="past the end of the file"):
        load_model(str(truncated))


def test_the_cli_remembers_and_answers_with_a_gguf_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama")[0]
    env = {**os.environ, "KVMEMORY_CACHE": str(tmp_path / "cache")}
    base = [sys.executable, "-m", "kvmemory.cli"]
    store = str(tmp_path / "store")
    r = subprocess.run(base + ["remember", "--model", str(path), "--store", store, "--problem",
                               "Tom has 3 boxes of 12 eggs. How many eggs?", "--solution",
                               "3 * 12 = 36. The answer is 36.", "--answer", "36", "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(base + ["verify", "--model", str(path), "--store", store, "--all", "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["bit_identical"] >= 1


def test_serve_answers_the_openai_api_with_a_gguf_file_and_caches_turn_one(tmp_path):
    """`kvmemory serve --model FILE.gguf`: turn 2 of a chat reads turn 1's prompt from the store."""
    from server_process import start_server

    path = write_tiny_gguf(tmp_path / "m.gguf", "qwen2")[0]
    srv = start_server(tmp_path / "serve", "--model", str(path), keys={"admin": "k-admin"})
    try:
        first = {"role": "user", "content": "The sea is deep and the world is wide. " * 8 + "Where is the sea?"}
        with srv.client("k-admin") as c:
            models = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert str(path) in models
            r1 = c.post("/v1/chat/completions", json={"model": "kvmemory", "messages": [first], "max_tokens": 4})
            assert r1.status_code == 200, r1.text
            n1 = r1.json()["usage"]["prompt_tokens"]
            turn2 = [first, {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And the world?"}]
            r2 = c.post("/v1/chat/completions", json={"model": "kvmemory", "messages": turn2, "max_tokens": 4})
            assert r2.status_code == 200, r2.text
            assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n1
    finally:
        srv.stop()


def test_bench_gguf_runs_on_a_synthetic_file(tmp_path):
    """`kvmemory bench gguf --synthetic tiny`: writes the file, measures every kvmemory side, says why
    llama.cpp was left out, and reports the floor and resident memory."""
    env = {**os.environ, "KVMEMORY_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "kvmemory.cli", "bench", "gguf", "--synthetic", "tiny", "--lengths",
                        "64", "--repeats", "1", "--no-llamacpp", "--json"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["synthetic"] == "tiny" and rep["llamacpp_skipped"]
    assert rep["kvmemory"]["decode_tokens_s"]["median"] > 0 and rep["kvmemory"]["64"]["graft_ttft_s"]["median"] > 0
    assert rep["kvmemory"]["64"]["graft_ttft_s"]["n"] == 3  # TTFT_PER_ROUND grafts in the one round
    assert rep["panel_bytes"] > 0 and rep["decode_floor_tokens_s"] > 0 and rep["file_bytes"] > 0


def test_the_langchain_chat_model_runs_a_gguf_file(tmp_path):
    """`ChatKVGraft(model_name=FILE.gguf)`: LangChain's chat model on a user's GGUF file."""
    pytest.importorskip("langchain_kvmemory")
    from langchain_kvmemory import ChatKVGraft

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama")[0]
    chat = ChatKVGraft(model_name=str(path), store=str(tmp_path / "store"), max_tokens=3)
    out = chat.invoke("Hello there, the world")
    assert isinstance(out.content, str)
    assert out.response_metadata["kvmemory"]["tokens_decoded"] >= 1
