"""One device story (vitlab.common.device): --device in every command, autocast choices, timing and memory on the
device; the GPU paths (CUDA event timing, GPU peak memory, GEMM probe, fused AdamW, fp16 with a gradient
scaler, NCCL) run where CUDA is present and are skipped otherwise."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

import vitlab
from vitlab.cli import main as cli_main
from vitlab.common.device import amp_dtype, device_memory, resolve_device, set_tf32, time_call
from vitlab.common.options import device as parse_device
from vitlab.engine.optim import create_optimizer
from vitlab.measure.gemm import measure_gemm

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
TINY_RUN = [
    "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32",
    "--train-limit", "64", "--holdout", "100", "--batch-size", "16", "--threads", "1", "--no-progress",
]  # fmt: skip


def test_device_names_are_checked_once_for_every_command():
    assert [parse_device(s) for s in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    for bad in ("gpu", "cuda:", "cuda:x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="must be auto, cpu, mps, cuda or cuda:N"):
            parse_device(bad)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if CUDA else torch.device("cpu"))
    with pytest.raises(ValueError, match="--device must be auto, cpu, mps, cuda or cuda:N"):
        resolve_device("tpu")


@pytest.mark.skipif(CUDA, reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["train", *TINY_RUN, "--device", "cuda"],
        ["bench-mixers", "--quick", "--device", "cuda:0"],
        ["bench", "deit_mini", "--device", "cuda"],
        ["lm", "bench", "--quick", "--device", "cuda"],
        ["analyze", "deit_mini", "--device", "cuda"],
        ["compare", "--models", "deit_mini", "--device", "cuda"],
    ],
    ids=lambda argv: argv[0] + ("_" + argv[1] if argv[0] == "lm" else ""),
)
def test_asking_for_a_missing_gpu_is_one_line(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "asked for a GPU, but CUDA is not available" in err and "--device cpu" in err


def test_every_command_takes_the_same_device_option(capsys):
    for argv in (["eval"], ["analyze"], ["lm", "eval"], ["lm", "sample"], ["lm", "train"], ["bench"], ["compare"]):
        try:
            assert cli_main([*argv, "--help"]) == 0
        except SystemExit as e:  # argparse's own exit, where the command lets it through
            assert e.code == 0
        assert "auto (this process's GPU when CUDA is present, else the CPU), cpu, cuda or cuda:N (or mps)" in " ".join(
            capsys.readouterr().out.split()
        ), argv
    assert cli_main(["bench-mixers", "--device", "gpu"]) == 2
    assert "must be auto, cpu, mps, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


def test_autocast_choices():
    cpu = torch.device("cpu")
    assert [amp_dtype(a, cpu) for a in ("auto", "none", "bf16")] == [None, None, torch.bfloat16]
    with pytest.raises(ValueError, match="fp16 autocast needs a GPU; use --amp bf16"):
        amp_dtype("fp16", cpu)
    with pytest.raises(ValueError, match="--amp must be one of"):
        amp_dtype("fp8", cpu)
    if CUDA:
        assert amp_dtype("auto", torch.device("cuda")) == torch.float16


def test_the_tf32_switch_leaves_the_flags_readable():
    """torch.export (and other code) reads cuDNN's TF32 flag; a switch that set only some of PyTorch's newer
    per-backend flags made that read an error, on any machine."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for enabled in (True, False):
            set_tf32(enabled)
            assert torch.backends.cuda.matmul.allow_tf32 is enabled and torch.backends.cudnn.allow_tf32 is enabled
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_cpu_timing_and_memory():
    calls = []
    assert time_call(lambda: calls.append(1), torch.device("cpu")) >= 0 and calls == [1]
    assert device_memory(torch.device("cpu")) is None  # the CPU's memory is the process's RSS
    rate = measure_gemm("fp32", shapes=((64, 32, 48),), min_calls=2, min_time=0.0)
    assert rate.device == "cpu" and rate.flops_per_s > 0


# --------------------------------------------------------------------------- GPU only


@needs_cuda
def test_cuda_timing_waits_for_the_kernels():
    dev = torch.device("cuda")
    torch.cuda._sleep(1000)  # warm
    t = time_call(lambda: torch.cuda._sleep(50_000_000), dev)  # tens of ms of GPU time, launched in microseconds
    assert t > 5e-3


@needs_cuda
def test_cuda_peak_memory_after_a_reset():
    from vitlab.common.device import reset_peak_memory

    dev = torch.device("cuda")
    reset_peak_memory(dev)
    base = device_memory(dev)["allocated"]
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
    del x
    mem = device_memory(dev)
    assert mem["peak"] - base >= 64 * 2**20 and mem["allocated"] == base


@needs_cuda
def test_gemm_probe_runs_on_the_gpu():
    rate = measure_gemm("fp16", shapes=((1024, 1024, 1024),), min_calls=3, min_time=0.01, device="cuda")
    assert rate.device.startswith("cuda") and rate.flops_per_s > 1e12  # any recent GPU: > 1 TFLOP/s in fp16


@needs_cuda
def test_fused_adamw_on_cuda_matches_the_foreach_update():
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", num_classes=10).cuda()
    twin = vitlab.create_model("deit_mini", num_classes=10).cuda()
    twin.load_state_dict(model.state_dict())
    fused, plain = create_optimizer(model, 1e-3), create_optimizer(twin, 1e-3, fused=False)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    x = torch.randn(4, 3, 32, 32, device="cuda")
    for m, opt in ((model, fused), (twin, plain)):
        m(x).square().mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_training_on_a_gpu_with_autocast(amp, tmp_path):
    """fp16 runs with the gradient scaler (its state in the checkpoint), bf16 without one."""
    out = tmp_path / amp
    assert cli_main(["train", *TINY_RUN, "--epochs", "1", "--device", "cuda", "--amp", amp, "--out", str(out)]) == 0
    ckpt = vitlab.checkpoint.load_checkpoint(out / "last.pt")
    assert ckpt["config"]["amp"] == amp and ckpt["scaler"].get("scale", 1.0) > 0
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
def test_ddp_over_nccl_on_two_gpus(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "vitlab.cli"]
    cmd += ["train", *TINY_RUN, "--epochs", "1", "--device", "cuda", "--out", str(tmp_path / "nccl")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and "on 2 processes (DDP)" in done.stdout, done.stderr[-2000:]
