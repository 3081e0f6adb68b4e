"""A transformers model computed from a GGUF file's own blocks: its linears never become float32 copies.

transformers' GGUF loader dequantizes every tensor to float32 (an 8B Q4_K_M file's 4.9 GB become 32 GB).
Here transformers still reads the file's metadata into a config and a tokenizer (once per file, kept in
the cache folder: `prepare`), and builds the module tree with empty weights; then every tensor of the
file is placed by transformers' own GGUF name map and tensor processors (`get_gguf_hf_weights_map`,
`TENSOR_PROCESSORS`: the llama q/k row order, Gemma's norm offset):
- a linear layer's weight (the output layer included, tied to the embedding or not) becomes a
  `GGUFLinear` over the tensor's blocks re-laid out for the kernel (gguf_blocks.py); its float32
  `weight` stays an empty (meta) tensor, never allocated;
- everything else (norms, biases) is dequantized by gguf-py, as transformers does;
- the token embedding is looked up from its blocks (gguf_embedding.py; the tied output layer shares its
  panels).

Before a layer is used, its first panel (16 rows) is expanded by the kernel and compared, byte for byte,
with gguf-py's `dequantize` of the same rows: a layout mistake cannot pass unseen. The whole-tensor
equality is tests/test_gguf_blocks.py's, on random blocks of every type.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvmemory.errors import KVMemoryError, UnsupportedModel
from kvmemory.kernels import quantized_linear as qlinear
from kvmemory.models import cache_files, file_hashes, gguf_blocks
from kvmemory.models.gguf_embedding import GGUFEmbedding
from kvmemory.models.gguf_file import GGUFFile, inspect
from kvmemory.models.gguf_linear import GGUFLinear
from kvmemory.paths import cache_dir

log = logging.getLogger(__name__)
_TMP = ".gguf-meta-"


def file_digests(model: GGUFFile) -> dict[str, str]:
    """{file name: SHA-256} of the model's file(s) (hashed once per content: file_hashes.py)."""
    return {p.name: file_hashes.sha256_of(p) for p in model.parts}


def _key(model: GGUFFile) -> str:
    import hashlib

    listing = json.dumps(file_digests(model), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def prepare(model: GGUFFile) -> Path:
    """The cache folder holding the config and tokenizer transformers makes of the file's metadata
    (its chat template included), made once per file content and written whole (a temporary folder
    renamed into place, one writer at a time)."""
    target = cache_dir() / "models" / f"gguf-{model.path.stem[:40]}-{_key(model)}"
    if (target / "config.json").is_file():
        return target
    info = inspect(model)  # refuses an architecture or block type kvmemory lacks before transformers reads it
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_files.exclusive(target.parent / ".convert.lock", "the GGUF model's config and tokenizer"):
        if (target / "config.json").is_file():
            return target
        cache_files.remove_leftovers(target.parent, _TMP)
        tmp = Path(tempfile.mkdtemp(prefix=_TMP, dir=target.parent))
        try:
            _write_meta(model, info, tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_meta(model: GGUFFile, info, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    parent, name = str(model.path.parent), model.path.name
    config = AutoConfig.from_pretrained(parent, gguf_file=name)
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    # transformers reads the tie from the first file's tensors; a split file's output layer may be in another
    config.tie_word_embeddings = "output.weight" not in info.tensors
    # transformers' GGUF config map reads no head size for qwen2 / qwen3 / phi3 (the class default, 128,
    # stands): the file says it
    key_length = info.metadata.get(f"{info.architecture}.attention.key_length")
    if key_length and getattr(config, "head_dim", None) not in (None, key_length):
        config.head_dim = int(key_length)
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(parent, gguf_file=name).save_pretrained(folder)
    (folder / "kvmemory_source.json").write_text(json.dumps({"gguf": [p.name for p in model.parts],
                                                              "sha256": file_digests(model)}))


def _check_first_panel(lin: GGUFLinear, raw: np.ndarray, kind: str, gguf_name: str) -> None:
    """The kernel's expansion of the layer's first 16 rows equals gguf-py's, byte for byte."""
    from gguf import GGMLQuantizationType, dequantize

    rows = np.asarray(raw[: qlinear.PANEL])
    ref = dequantize(rows, GGMLQuantizationType[kind]).reshape(qlinear.PANEL, lin.in_features)
    d = lin.d[:1] if lin.d.numel() else lin.d
    m = lin.m[:1] if lin.m.numel() else lin.m
    got = qlinear.dequantize(lin.q[:1], d, m, lin.kind)
    if not torch.equal(got.view(torch.int32), torch.from_numpy(np.array(ref, dtype=np.float32)).view(torch.int32)):
        raise KVMemoryError(f"the kernel's expansion of {gguf_name} ({kind}) differs from gguf-py's: not used")


def _param(array: np.ndarray, like: torch.Tensor) -> torch.nn.Parameter:
    t = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(like.shape)  # a copy: the file stays read-only
    return torch.nn.Parameter(t, requires_grad=False)


def _hf_names(hf: torch.nn.Module, architecture: str) -> dict[str, str]:
    """{GGUF tensor name: the model's parameter name}, by gguf-py's tensor name map, as transformers'
    `get_gguf_hf_weights_map` maps them (the full name first, then without leading module names), with
    the map built once instead of once per submodule (seconds per load)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == architecture), None)
    if arch is None:
        raise UnsupportedModel(f"gguf-py {_gguf_version()} has no tensor names for the {architecture!r} architecture")
    name_map = get_tensor_name_map(arch, hf.config.num_hidden_layers)
    out: dict[str, str] = {}
    for hf_name in hf.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf_name, ""
        parts = base.split(".")
        for i in range(len(parts)):
            g = name_map.get_name(".".join(parts[i:]))
            if g is not None:
                out.setdefault(g + ("." + suffix if suffix else ""), hf_name)
                break
    return out


def _gguf_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("gguf")


def build(model: GGUFFile, folder: Path, attn_implementation: str) -> torch.nn.Module:
    """The model with every linear computing from the file's blocks (see the module docstring)."""
    from gguf import GGMLQuantizationType, dequantize
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    if qlinear.load() is None:
        raise UnsupportedModel(f"a GGUF file computes with the GGUF-block kernel, which cannot run here: "
                               f"{qlinear.why_unavailable()}")
    info = inspect(model)
    config = AutoConfig.from_pretrained(str(folder))
    if getattr(config, "attn_logit_softcapping", None):  # Gemma 2: only transformers' eager attention softcaps
        attn_implementation = "eager"
    with init_empty_weights(include_buffers=False):  # parameters on the meta device; RoPE tables computed
        hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    cfg = config.to_dict()
    processor = TENSOR_PROCESSORS.get(info.architecture, TensorProcessor)(config=cfg)
    names = _hf_names(hf, info.architecture)
    modules = dict(hf.named_modules())

    def processed(values: np.ndarray, name: str) -> np.ndarray:  # transformers' own fix-ups (q/k rows, norms)
        return processor.process(weights=values, name=name, tensor_key_mapping=names,
                                 parsed_parameters={"config": cfg}).weights

    def linear_of(module: torch.nn.Linear, tensor, panels=None) -> GGUFLinear:
        raw = processed(tensor.data(), tensor.name)
        q, d, m, code = panels or gguf_blocks.panels(tensor.type, raw, module.out_features, module.in_features)
        lin = GGUFLinear(module, code, q, d, m)
        _check_first_panel(lin, raw, tensor.type, tensor.name)
        return lin

    def replace(owner: str, new: torch.nn.Module) -> None:
        parent, _, child = owner.rpartition(".")
        setattr(modules[parent] if parent else hf, child, new)
        modules[owner] = new

    embedding_panels = None
    for tensor in info.tensors.values():
        target = names.get(tensor.name)
        if target is None:
            continue  # e.g. rope_freqs: transformers computes it from the config, as its own loader does
        owner, _, attr = target.rpartition(".")
        module = modules.get(owner)
        if isinstance(module, torch.nn.Linear) and attr == "weight" and not isinstance(module, GGUFLinear):
            replace(owner, linear_of(module, tensor))
        elif isinstance(module, torch.nn.Embedding) and attr == "weight" and module.num_embeddings % qlinear.PANEL == 0:
            raw = tensor.data()
            embedding_panels = gguf_blocks.panels(tensor.type, raw, module.num_embeddings, module.embedding_dim)
            emb = GGUFEmbedding(module, *embedding_panels)
            ref = dequantize(np.asarray(raw[: 2 * qlinear.PANEL + 1]), GGMLQuantizationType[tensor.type])
            got = emb.rows(torch.arange(2 * qlinear.PANEL + 1))
            if not torch.equal(got.view(torch.int32), torch.from_numpy(np.array(ref, dtype=np.float32)).view(torch.int32)):
                raise KVMemoryError(f"the lookup of {tensor.name} ({tensor.type}) differs from gguf-py's: not used")
            replace(owner, emb)
        else:
            values = dequantize(tensor.data(), GGMLQuantizationType[tensor.type])
            setattr(module, attr, _param(processed(values, tensor.name), getattr(module, attr)))
    head = hf.get_output_embeddings()
    if not isinstance(head, GGUFLinear):  # tied: the output layer computes from the embedding's blocks
        embedding = info.tensors.get("token_embd.weight")
        if embedding is None:
            raise KVMemoryError(f"{model.name} has neither an output layer nor a token embedding")
        lin = linear_of(head, embedding, embedding_panels)  # the embedding's own panels: one copy for both
        if not isinstance(hf.get_input_embeddings(), GGUFEmbedding):
            lin.weight = hf.get_input_embeddings().weight  # tied, as transformers ties them
        hf.set_output_embeddings(lin)
        modules[next(n for n, mod in hf.named_modules() if mod is lin)] = lin
    missing = [n for n, p in hf.named_parameters() if p.is_meta]
    if missing:
        raise KVMemoryError(f"{model.name} holds no tensor for {', '.join(missing[:5])}"
                            + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    release_freed_memory()
    return hf.eval().requires_grad_(False)


def release_freed_memory() -> None:
    """Hand the unpacking's freed heap back to the system (glibc keeps it otherwise: ~50 MB of resident
    memory for a 1.5B file). A no-op where the C library has no malloc_trim."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
