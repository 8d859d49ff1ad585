"""Devices and dtypes: --device / --dtype reach every linear, auto is the protocol's CPU
float32 without a GPU, a device the machine lacks is one line."""

from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import FP4SENSE
from fp4sense.diagnosis import analyze
from fp4sense.runtime import devices
from helpers import family_model, random_windows


# --- devices and dtypes -----------------------------------------------------------------
def test_dtype_reaches_every_linear_in_both_modes(tmp_path):
    """bfloat16 asked, bfloat16 computed: every linear's weight and input in both modes
    (and the device of each is the analysis device)."""
    model = family_model(tmp_path / "m", "llama", torch.bfloat16)
    seen: set = set()

    def check(module, args):
        seen.add((args[0].dtype, module.weight.dtype, args[0].device.type,
                  module.weight.device.type))

    handles = [m.register_forward_pre_hook(check) for m in model.modules()
               if isinstance(m, torch.nn.Linear)]
    try:
        report = analyze(model, random_windows(2, 32), schemes=["NVFP4"], views=["component"],
                         modes=["measured", "estimated"], progress=False, log=lambda m: None,
                         device="cpu")
    finally:
        for h in handles:
            h.remove()
    assert seen == {(torch.bfloat16, torch.bfloat16, "cpu", "cpu")}
    assert {e.mode for e in report.entries} == {"measured", "estimated"}


def test_auto_is_the_cpu_in_float32_without_a_gpu_and_the_default_is_the_protocol(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # any machine
    for asked in ("auto", "cpu", None):
        p = devices.resolve(asked)
        assert (p.device, p.dtype) == (torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("asked, message", [
    ("cuda", r"--device cuda: this machine has no CUDA GPU .* use --device cpu \(or auto\)"),
    ("cuda:7", r"--device cuda:7: this machine has no CUDA GPU"),
    ("tpu", r"--device tpu: unknown device; choose auto, cpu, cuda or cuda:N"),
    ("cpu:1", r"--device cpu:1: unknown device"),
])
def test_a_device_this_machine_lacks_is_one_line(asked, message):
    with pytest.raises(devices.DeviceError, match=message):
        devices.resolve(asked)


def test_a_gpu_index_beyond_the_machine_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(devices.DeviceError, match=r"--device cuda:7: this machine has 1 CUDA "
                       r"GPU\(s\) \(cuda:0–cuda:0\); choose one of them"):
        devices.resolve("cuda:7")
    assert devices.resolve("auto").dtype == torch.bfloat16  # a GPU: bf16 by default
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert devices.resolve("cuda").device == torch.device("cuda", 0)


def test_bf16_on_a_cpu_without_native_bf16_says_it_is_slow(monkeypatch):
    notes: list[str] = []
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    assert devices.resolve("cpu", "bfloat16", log=notes.append).dtype == torch.bfloat16
    assert len(notes) == 1 and "runs several times slower than float32" in notes[0]


def test_cli_refuses_a_missing_gpu_in_one_line(tiny_llama, tmp_path):
    for command in (["analyze", str(tiny_llama), "--out", str(tmp_path / "a")],
                    ["eval", str(tmp_path / "none")]):
        out = subprocess.run([FP4SENSE, *command, "--device", "cuda:1"], capture_output=True,
                             text=True)
        if command[0] == "eval":  # the checkpoint is checked first: a missing one is named
            assert out.returncode == 1
            continue
        assert out.returncode == 1, out.stderr
        assert out.stderr.strip().splitlines() == [
            "fp4sense: error: --device cuda:1: this machine has no CUDA GPU that torch "
            f"{torch.__version__} can use; use --device cpu (or auto)"]
    bad = subprocess.run([FP4SENSE, "analyze", "--device", "gpu0"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--device: 'gpu0': choose auto, cpu, cuda or cuda:N" \
        in bad.stderr
