"""Where a model runs: `--device auto|cpu|cuda|cuda:N` and `--dtype` (models/devices.py), on the CLI,
`KVMemory`, `Engine.open` and the shared memory the framework adapters borrow.

On a machine without a GPU (this one): `auto` is the CPU, an explicit `cuda` is a DeviceUnavailable
(exit 2 on the command line) before any store opens or model loads. What `auto` does on a GPU machine is
checked with torch's CUDA queries and the graft op's choice replaced (a GPU is not needed for the rule;
running on one is scripts/gpu_check.py's part).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvmemory.errors import DeviceUnavailable, InvalidInput
from kvmemory.models import devices
from kvmemory.models.loading import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
no_gpu = pytest.mark.skipif(HAS_CUDA, reason="checks what a machine without a GPU says")


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch answering as a machine with `n` GPUs would, and the graft op's choice; returns a setter."""
    def set_up(n: int = 1, kernel: str = "cuda", bf16: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"NVIDIA H200 #{i}")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        monkeypatch.setattr(devices, "graft_kernel", lambda: (kernel, f"{kernel} (as the test says)"))
        monkeypatch.setattr(devices, "_warned", [])
    return set_up


# ---------------------------------------------------------------------- the rule
@no_gpu
def test_auto_is_the_cpu_here_and_an_explicit_gpu_is_refused_naming_what_is_here():
    assert devices.resolve_device("auto") == devices.resolve_device(None) == "cpu"
    assert devices.resolve_device("auto", model=DEFAULT_MODEL) == "cpu"
    assert devices.resolve_device("cpu") == devices.resolve_device(torch.device("cpu")) == "cpu"
    for asked in ("cuda", "cuda:0", "CUDA:3"):
        with pytest.raises(DeviceUnavailable) as err:
            devices.resolve_device(asked)
        assert repr(asked) in str(err.value) and "--device cpu" in str(err.value)
        assert ("without CUDA" if torch.version.cuda is None else "sees no CUDA device") in str(err.value)


def test_a_device_that_is_no_device_is_invalid_input():
    for bad in ("gpu", "mps", "cuda:x", "cuda:-1", "", 3):
        with pytest.raises(InvalidInput) as err:
            devices.resolve_device(bad)
        assert not isinstance(err.value, DeviceUnavailable) and "auto, cpu, cuda, cuda:N" in str(err.value)


def test_auto_on_a_gpu_machine(fake_gpus, caplog):
    fake_gpus(n=2)
    assert devices.resolve_device("auto", model="/models/llama") == "cuda:0"
    assert devices.resolve_device("auto") == "cuda:0"
    assert devices.resolve_device("auto", model=DEFAULT_MODEL) == "cpu"  # the embedded model stays on the CPU
    assert devices.resolve_device("cuda", model=DEFAULT_MODEL) == "cuda:0"  # ... unless asked
    assert devices.resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(DeviceUnavailable) as err:
        devices.resolve_device("cuda:7")
    assert "2 CUDA devices: cuda:0 (NVIDIA H200 #0), cuda:1 (NVIDIA H200 #1)" in str(err.value)
    fake_gpus(n=1)
    with pytest.raises(DeviceUnavailable, match="1 CUDA device: cuda:0"):
        devices.resolve_device("cuda:1")
    # Without the CUDA graft kernel auto stays on the CPU; an explicit cuda runs, and says how it grafts.
    fake_gpus(n=1, kernel="twin")
    assert devices.resolve_device("auto", model="/models/llama") == "cpu"
    with caplog.at_level(logging.WARNING):
        assert devices.resolve_device("cuda") == "cuda:0"
    assert "CUDA graft kernel is not used" in caplog.text


def test_dtype_auto_keeps_the_cpu_as_it_was_and_is_bfloat16_on_a_gpu(fake_gpus):
    assert devices.resolve_dtype("auto", "cpu") is None and devices.resolve_dtype(None, "cpu") is None
    assert devices.resolve_dtype("float16", "cpu") is torch.float16
    assert devices.resolve_dtype(torch.bfloat16, "cpu") is torch.bfloat16
    fake_gpus(n=1)
    assert devices.resolve_dtype("auto", "cuda:0") is torch.bfloat16
    assert devices.resolve_dtype("auto", "cuda:0", profile="stock") is None  # stock decides (float32)
    assert devices.resolve_dtype("float32", "cuda:0") is torch.float32
    fake_gpus(n=1, bf16=False)
    assert devices.resolve_dtype("auto", "cuda:0") is torch.float16
    for bad in ("int8", "fp16", torch.int8):
        with pytest.raises(InvalidInput, match="auto, float32, bfloat16, float16"):
            devices.resolve_dtype(bad, "cpu")


# ---------------------------------------------------------------------- the command line
def _main_json(argv, capsys) -> tuple[int, dict]:
    from kvmemory.cli import main

    capsys.readouterr()
    code = main(argv)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@no_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_cli_refuses_a_gpu_that_is_not_here_before_anything_loads(device, tmp_path, capsys, monkeypatch):
    from kvmemory.engine import engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    store = tmp_path / "store"
    for argv in (["ask", "how many eggs?"], ["remember", "--problem", "p", "--solution", "s"], ["verify", "--all"],
                 ["recall", "eggs"]):
        code, out = _main_json([*argv, "--device", device, "--store", str(store), "--json"], capsys)
        assert code == 2 and out["error"] == "DeviceUnavailable" and repr(device) in out["message"], out
    assert not store.exists()  # refused before the store was opened (a typo creates no store)


@no_gpu
def test_cli_device_error_is_quick_in_a_fresh_process(tmp_path):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "kvmemory.cli", "ask", "q", "--device", "cuda", "--store",
                        str(tmp_path / "s")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    seconds = time.perf_counter() - t0
    assert p.returncode == 2, p.stderr
    assert "kvmemory: DeviceUnavailable: device 'cuda' was asked for" in p.stderr
    assert "Traceback" not in p.stderr
    # No model was loaded: well under the seconds a model load takes (imports only; a busy 2-core VM).
    print(f"refused in {seconds:.2f} s")


def test_cli_options_on_every_command_that_loads_a_model(capsys):
    from kvmemory.cli import build_parser, main

    parser = build_parser()
    for argv in (["remember"], ["ask", "q"], ["recall", "q"], ["verify"], ["forget"], ["reindex"], ["import", "f"],
                 ["serve"], ["demo"], ["bench", "recurring"], ["update", "x"], ["fsck"]):  # fsck: --repair / --texts
        args = parser.parse_args(argv)
        assert (args.device, args.dtype) == ("auto", "auto"), argv
        args = parser.parse_args([*argv, "--device", "cuda:1", "--dtype", "bfloat16"])
        assert (args.device, args.dtype) == ("cuda:1", "bfloat16"), argv
    for argv in (["list"], ["stats"], ["export", "--out", "x"], ["kernels"], ["get", "x"], ["history", "x"]):  # no model
        assert not hasattr(parser.parse_args(argv), "device"), argv
    with pytest.raises(SystemExit) as err:
        parser.parse_args(["ask", "q", "--dtype", "int8"])
    assert err.value.code == 2
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    text = capsys.readouterr().out
    assert "--device {auto,cpu,cuda,cuda:N}" in text and "--dtype {auto,float32,bfloat16,float16}" in text


def test_kernels_and_version_say_what_gpu_is_usable(capsys):
    from kvmemory.cli import main

    assert main(["kernels", "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu"]
    assert gpu["torch_cuda"] == torch.version.cuda and gpu["auto_device_embedded"] == "cpu"
    assert gpu["graft_kernel"] in ("cuda", "twin") and gpu["graft_kernel_reason"]
    assert gpu["auto_device"] == ("cuda:0" if gpu["graft_kernel"] == "cuda" and HAS_CUDA else "cpu")
    assert main(["kernels"]) == 0
    assert f"--device auto: {gpu['auto_device']}" in capsys.readouterr().out
    code = ("import sys\nfrom kvmemory.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("gpu: "))
    assert ("built without CUDA" if torch.version.cuda is None else f"built with CUDA {torch.version.cuda}") in line
    assert "kvmemory-cuda-graft" in line and "torch imported: False" in p.stdout


# ---------------------------------------------------------------------- Python: KVMemory and the adapters
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("devices"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_kvmemory_takes_a_device_and_a_dtype(tiny_folder, tmp_path, dtype):
    from kvmemory import KVMemory

    mem = KVMemory(model=tiny_folder, store=tmp_path / "s", device="cpu", dtype=dtype)
    eng = mem.engine
    assert eng.device == torch.device("cpu")
    assert (eng.profile.device_type, eng.profile.dtype) == ("cpu", dtype)
    assert eng.profile.device_name  # the CPU's model name, recorded in every block's profile
    ids = eng.encode("Tom has 3 boxes of 12 eggs and breaks 5 of them. " * 8)
    eng.store_prefix(ids[:70])
    got, rep = eng.forward(ids, max_new_tokens=2, keep_logits=True, stop_token_ids=())
    ref = eng.recompute(ids, max_new_tokens=2, stop_token_ids=())
    assert rep.tokens_grafted == 64 and got.prefill_logits.dtype == getattr(torch, dtype)
    assert torch.equal(got.prefill_logits, ref.prefill_logits[64:]) and torch.equal(got.decode_logits, ref.decode_logits)
    if dtype != "float32":
        return
    with pytest.raises(InvalidInput, match="device are chosen when the engine is opened"):
        KVMemory(mem.engine, device="cpu")
    if not HAS_CUDA:
        with pytest.raises(DeviceUnavailable):
            KVMemory(model=tiny_folder, store=tmp_path / "t", device="cuda")
        assert not (tmp_path / "t").exists()


def test_the_shared_memory_is_one_per_device_and_auto_is_the_device_it_names(tiny_folder, tmp_path):
    from kvmemory import borrow_memory, shared_memory
    from kvmemory.adapters import shared

    store = str(tmp_path / "s")
    try:
        auto = shared_memory(tiny_folder, store)
        assert shared_memory(tiny_folder, store, device=devices.resolve_device("auto", model=tiny_folder)) is auto
        assert borrow_memory(auto, device="auto").memory is auto
        assert borrow_memory(auto, device=str(auto.engine.device)).memory is auto
        with pytest.raises(InvalidInput, match="computes in float32"):
            borrow_memory(auto, dtype="bfloat16")
        if not HAS_CUDA:
            with pytest.raises(DeviceUnavailable):
                shared_memory(tiny_folder, store, device="cuda")
    finally:
        for key in [k for k in shared._memories if k[1] == shared.resolve_store(store)]:
            del shared._memories[key]
