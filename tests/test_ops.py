"""The kernel layer (vitlab.ops): one switch, capabilities decided once by running the primitive, the plain path
on any CPU the primitive does not run on, and every model correct in bf16 with the fast paths on and off."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode

import vitlab
from vitlab import ops
from vitlab.ops import linear as linear_ops
from vitlab.ops import onednn, probe
from vitlab.ops.linear import fused_linear, fuses_linear, trains_linear_in_onednn

SRC = Path(__file__).resolve().parents[1] / "src" / "vitlab"
BF16_UNIT = 2.0**-8


@pytest.mark.usefixtures("fast_path")
def test_the_switch_turns_every_fast_path_off_and_back():
    assert ops.fast_paths_enabled()
    with ops.fast_paths(False):
        assert not ops.fast_paths_enabled()
        lin, x = nn.Linear(8, 8), torch.randn(2, 8)
        with torch.inference_mode():
            assert not fuses_linear(x, lin.weight)
        assert not trains_linear_in_onednn(x.requires_grad_(), lin.weight)
        with ops.fast_paths(True):
            assert ops.fast_paths_enabled()
        assert not ops.fast_paths_enabled()
    assert ops.fast_paths_enabled()


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), ("", True)])
def test_the_environment_sets_the_switch(value, on):
    code = "import vitlab.ops as o; print(o.fast_paths_enabled())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"VITLAB_FAST_PATHS": value}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(on)


def test_a_bad_switch_value_is_one_warning_line_and_the_default():
    """Importing vitlab never fails on the switch (every program importing it would stop): a value that is no
    switch is one warning line, and the fast paths keep their default, on."""
    code = "import vitlab.ops; print(vitlab.ops.fast_paths_enabled())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"VITLAB_FAST_PATHS": "maybe"}, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "VITLAB_FAST_PATHS='maybe' is not a switch: set it to one of 1" in line


def test_decisions_are_made_once_and_reported():
    report = ops.decisions()
    linear = {f"onednn_linear[{d},{m}]" for d in ("float32", "bfloat16") for m in ("infer", "train")}
    assert set(report) == linear | {"stem_channels_last[train]", "aft_full_channel_major[infer]"}
    for decision in report.values():
        assert decision["taken"] <= decision["works"] and decision["reason"]
    assert not report["onednn_linear[bfloat16,train]"]["taken"]  # autocast's precisions, not oneDNN's
    calls = []
    real = probe._probe
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe, "_probe", lambda *a: calls.append(a) or real(*a))
        probe.onednn_linear(torch.float32, False)
        probe.onednn_linear(torch.float32, False)
    assert calls == []  # decided already: no second probe


def test_the_probe_decides_on_the_median_ratio_of_paired_calls(monkeypatch):
    """One lucky call must not decide: the answer is the median of the pairs' time ratios against the margin,
    each pair's two calls back to back and their order alternating (a slow stretch of the machine moves both)."""
    monkeypatch.setattr(probe, "REPEATS", 7)
    order: list[str] = []
    fast_times = iter([1.0, 5.0, 9.0, 9.5, 10.0, 9.0, 9.8, 9.9])  # a warm-up call, then one lucky call of 5 ms
    plain_times = iter([1.0] + [10.0] * 7)
    monkeypatch.setattr(probe, "_ms", lambda fn: fn())

    def fast():
        order.append("f")
        return next(fast_times)

    def plain():
        order.append("p")
        return next(plain_times)

    fast_ms, plain_ms, ratio = probe._time(fast, plain)
    assert order == ["f", "p"] + ["f", "p", "p", "f"] * 3 + ["f", "p"]
    assert (fast_ms, plain_ms, ratio) == (9.5, 10.0, 0.95)  # the best-of-calls rule would read 5 against 10
    assert not probe.decide(fast_ms, plain_ms, ratio).taken
    assert probe.decide(8.0, 10.0, probe.MARGIN).taken and not probe.decide(8.0, 10.0, probe.MARGIN + 0.01).taken
    assert "0.95x its time" in probe.decide(fast_ms, plain_ms, ratio).reason


def test_the_stem_probe_keeps_channels_last_unless_nchw_is_faster_by_the_margin(monkeypatch, tmp_path):
    """The stems' layout in training: channels-last stays unless NCHW's time is at most MARGIN of its own (the
    median ratio of paired calls); the answer is made once, kept in the machine's cache and reported; a
    convolution that fails leaves the input's own layout."""
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path))
    real_probe = probe._probe_stem
    for ratio, kept in ((1.0, True), (1 / probe.MARGIN - 0.01, True), (1 / probe.MARGIN + 0.01, False), (2.8, False)):
        monkeypatch.setattr(probe, "_time", lambda fast, plain, r=ratio: (r * 10.0, 10.0, r))
        decision = real_probe()
        assert decision.works and decision.taken is kept and f"{ratio:.2f}x NCHW's time" in decision.reason

    def timed_once(channels_last, nchw):
        channels_last(), nchw()  # both layouts' steps run
        return 30.0, 10.0, 3.0

    monkeypatch.setattr(probe, "_time", timed_once)
    monkeypatch.setattr(probe, "_DECISIONS", {})
    first = probe.stem_channels_last()
    assert first.works and not first.taken and probe.stem_channels_last_taken() is False
    assert ops.decisions()["stem_channels_last[train]"] == dataclasses.asdict(first)
    monkeypatch.setattr(probe, "_DECISIONS", {})
    monkeypatch.setattr(probe, "_probe_stem", lambda: pytest.fail("probed although the cache holds the answer"))
    assert probe.stem_channels_last() == first

    def refuse(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for a convolution")

    monkeypatch.setattr(probe, "_time", refuse)
    failed = real_probe()
    assert not failed.works and not failed.taken and "primitive descriptor" in failed.reason


@pytest.fixture
def unsupported_cpu(monkeypatch):
    """A CPU whose instruction set oneDNN's linear primitive does not support (the error PyTorch raises there)."""

    def refuse(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation")

    monkeypatch.setattr(onednn, "linear", refuse)
    monkeypatch.setattr(probe, "_DECISIONS", {})
    monkeypatch.setenv("VITLAB_CACHE_DIR", "off")  # this CPU's cached answers are not that CPU's
    return refuse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_failing_probe_leaves_the_plain_path_which_agrees(unsupported_cpu, dtype):
    for training in (False, True):
        decision = probe.onednn_linear(dtype, training)
        assert not decision.works and not decision.taken
    assert "primitive descriptor" in probe.onednn_linear(dtype, False).reason
    torch.manual_seed(0)
    for name in ("deit_mini", "aft_full_mini", "refiner_mini"):
        model = vitlab.create_model(name, num_classes=10).to(dtype).eval()
        x = torch.randn(2, *model.meta["input_size"], dtype=dtype)
        with torch.inference_mode():
            y = model(x)  # the primitive would raise: it is never called
            with ops.fast_paths(False):
                plain = model(x)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.float(), plain.float(), rtol=0.05, atol=0.05)
        model.train()
        model(x).float().square().sum().backward()  # training too
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _mini_models() -> list[str]:
    return vitlab.list_models("*_mini")


def _agree(actual: torch.Tensor, expected: torch.Tensor, units: float) -> None:
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= units * BF16_UNIT * scale, f"max abs error {err:.3g} > {units} bf16 units of {scale:.3g}"


def _bf16_run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 and bf16-weight inference outputs, fp32 and bf16-autocast training-mode outputs, and the flat gradient
    of a bf16-autocast training step.

    The training-mode outputs are compared with BatchNorm on its running statistics: the batch statistics of two
    images' attention maps (DeepViT's, the refiner's) are tiny variances that amplify any rounding, bf16's
    included. The gradient's step uses the batch statistics (and the fused head mix + BatchNorm)."""
    with torch.inference_mode():
        fp32 = model.float().eval()(x)
        bf16 = model.to(torch.bfloat16)(x.bfloat16())
    model.float().train()
    for m in model.modules():  # the same function in every pass: no dropout, no random depth
        if isinstance(m, nn.Dropout) or type(m).__name__ == "DropPath":
            m.eval()
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    outputs = []
    for precision in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)  # the same random masks (attention drop-map) in both
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
            for m in norms:
                m.eval()
            outputs.append(model(x))
            for m in norms:
                m.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().sum().backward()
    grads = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    return fp32, bf16, *outputs, grads


@pytest.mark.parametrize("name", _mini_models())
def test_every_mini_model_runs_in_bf16_and_agrees_with_fp32(name):
    """bf16 weights in inference and bf16 autocast in training, with the fast paths on and off: each output within
    bf16 tolerance of the fp32 model's, and the two paths' gradients the same up to bf16 rounding. (Gradients of
    the maps' BatchNorm models, DeepViT's and the refiner's, follow bf16's rounding of tiny batch statistics, so
    bf16 gradients are compared between the paths, not with fp32's.)"""
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10)
    x = torch.randn(2, *model.meta["input_size"])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runs = {}
    for fast in (True, False):
        model.load_state_dict(state)  # the same running statistics before each
        with ops.fast_paths(fast):
            runs[fast] = _bf16_run(model, x)
    for fp32, bf16, fp32_train, autocast, grads in runs.values():
        assert bf16.dtype == autocast.dtype == torch.bfloat16 and torch.isfinite(grads).all()
        _agree(bf16, fp32, units=32.0)  # a dozen blocks of bf16 rounding
        _agree(autocast, fp32_train, units=32.0)
    (*_, fast_grads), (*_, plain_grads) = runs[True], runs[False]
    cosine = torch.nn.functional.cosine_similarity(fast_grads, plain_grads, dim=0).item()
    # bf16 rounding of two images' map statistics compounds with depth: DeepViT-32B's mini (32 blocks) reads
    # 0.982-0.997 over three inputs on an AVX2-only CPU (bf16 products without bf16 instructions), its 4-block mini
    # 0.995-0.999 there
    assert cosine > (0.99 if len(getattr(model, "blocks", ())) <= 16 else 0.97), cosine


def test_no_kernel_or_private_torch_op_lives_above_the_kernel_layer():
    """The papers' modules, layers and models call named ops; autograd Functions, oneDNN and private torch APIs
    live in vitlab/ops alone."""
    pattern = re.compile(r"autograd\.Function|torch\.ops\.|torch\._C\b|torch\._[a-z]|\bfrom torch\.[\w.]*\._\w+")
    found = [
        f"{path.relative_to(SRC)}:{i}: {line.strip()}"
        for package in ("mixers", "layers", "models")
        for path in sorted((SRC / package).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_grep_would_see_a_kernel(tmp_path):
    pattern = re.compile(r"autograd\.Function|torch\.ops\.|torch\._C\b|torch\._[a-z]|\bfrom torch\.[\w.]*\._\w+")
    for line in (
        "class F(torch.autograd.Function):",
        "torch.ops.mkldnn._linear_pointwise(x)",
        "torch._C._are_functorch_transforms_active()",
        "from torch.utils._python_dispatch import _get_current_dispatch_mode",
    ):
        assert pattern.search(line), line
    assert not pattern.search("torch.nn.functional.linear(x, w)")


def test_fused_linear_on_the_plain_path_is_exactly_the_module(unsupported_cpu):
    torch.manual_seed(0)
    lin, x, res = nn.Linear(16, 24), torch.randn(3, 16), torch.randn(3, 24)
    with torch.inference_mode():
        assert torch.equal(fused_linear(lin, x, residual=res), res + lin(x))
        assert torch.equal(fused_linear(lin, x, gelu=True), torch.nn.functional.gelu(lin(x)))


@pytest.mark.usefixtures("fast_path")
def test_the_first_decision_may_be_asked_for_anywhere(monkeypatch):
    """The first call that needs a decision may run under activation checkpointing (saved-tensor hooks), a FLOP
    counter or inference mode: the probe runs apart from them and decides as it does on its own."""
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(probe, "_DECISIONS", {})
    torch.manual_seed(0)
    lin, x = nn.Linear(32, 32), torch.randn(4, 32, requires_grad=True)
    with FlopCounterMode(display=False):
        checkpoint(lambda t: fused_linear(lin, t), x, use_reentrant=False).sum().backward()
    with torch.inference_mode():
        fused_linear(lin, x.detach())
    for (dtype, training), decision in probe._DECISIONS.items():
        assert decision.works == probe._probe(dtype, training).works
    assert set(probe._DECISIONS) == {(torch.float32, True), (torch.float32, False)}
    torch.testing.assert_close(x.grad, torch.ones(4, 32) @ lin.weight)


def test_decisions_are_kept_per_machine(monkeypatch, tmp_path):
    """The answers go to a cache file named by the machine, torch and the settings they depend on; the next
    process reads them instead of probing (its memory and time), a damaged file is probed again, and "off" keeps
    nothing."""
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probe, "_DECISIONS", {})
    first = probe.onednn_linear(torch.float32, False)
    path = probe.cache_path()
    assert path is not None and path.parent == tmp_path and path.is_file()
    monkeypatch.setattr(probe, "_DECISIONS", {})
    monkeypatch.setattr(probe, "_probe", lambda *a: pytest.fail("probed although the cache holds the answer"))
    assert probe.onednn_linear(torch.float32, False) == first
    monkeypatch.undo()
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probe, "_DECISIONS", {})
    path.write_text("{not json")
    calls = []
    real = probe._probe
    monkeypatch.setattr(probe, "_probe", lambda *a: calls.append(a) or real(*a))
    assert probe.onednn_linear(torch.float32, False).works == first.works and calls
    other = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA") != "SSE41" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other)  # another instruction-set limit: another file
    assert probe.cache_path() != path
    monkeypatch.setenv("VITLAB_CACHE_DIR", "off")
    assert probe.cache_path() is None


def test_only_a_probed_answer_is_kept_for_the_machine(monkeypatch, tmp_path):
    """A decision set in the process by hand (a test, an A/B script forcing a path) stays in the process: the cache
    file gets the answers the probe found, and the other entries already in it stay as they were."""
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path))
    earlier = probe.Decision(True, False, 2.0, 1.0, "aten faster")
    probe.cache_path().write_text(json.dumps({"stem_channels_last,train": dataclasses.asdict(earlier)}))
    forced = probe.Decision(True, True, reason="forced for an A/B")
    monkeypatch.setattr(probe, "_DECISIONS", {probe._AFT: forced})
    monkeypatch.setattr(probe, "_probe", lambda *a: probe.Decision(True, False, 1.0, 1.0, "probed"))
    probe.onednn_linear(torch.float32, False)
    kept = json.loads(probe.cache_path().read_text())
    assert kept == {"stem_channels_last,train": dataclasses.asdict(earlier), "float32,infer": kept["float32,infer"]}
    assert kept["float32,infer"]["reason"] == "probed"


def test_a_cached_answer_that_no_longer_holds_is_probed_again(unsupported_cpu, monkeypatch, tmp_path):
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path))
    stale = probe.Decision(True, True, 1.0, 2.0, "oneDNN faster than aten")
    probe.cache_path().write_text(json.dumps({"float32,infer": dataclasses.asdict(stale)}))
    assert probe.onednn_linear(torch.float32, False).works is False  # the primitive fails here now


def test_a_cached_answer_is_checked_in_the_calling_thread_with_the_callers_modes_set_aside(monkeypatch, tmp_path):
    """A thread that runs oneDNN leaves an OpenMP team of its own behind (the process's products then ran slower):
    the check of a cached answer runs in the caller's thread, under a FLOP counter or autocast too (set aside for
    the check: its operations are neither counted nor autocast), and in a thread of its own only under a function
    mode (``torch.device``) or compile tracing, which would change the tensors it makes."""
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path))
    taken = probe.Decision(True, True, 1.0, 2.0, "oneDNN faster than aten")
    probe.cache_path().write_text(json.dumps({"float32,infer": dataclasses.asdict(taken)}))
    calls = []

    def still_works(*args):
        mode = _get_current_dispatch_mode()
        calls.append((threading.current_thread(), mode, torch.is_autocast_enabled("cpu")))
        return True

    monkeypatch.setattr(probe, "_still_works", still_works)
    monkeypatch.setattr(probe, "_probe", lambda *a: pytest.fail("probed although the cache holds the answer"))
    counter = FlopCounterMode(display=False)
    surroundings = [contextlib.nullcontext(), counter, torch.autocast("cpu", dtype=torch.bfloat16)]
    surroundings.append(torch.device("meta"))
    for surrounding in surroundings:
        monkeypatch.setattr(probe, "_DECISIONS", {})
        with surrounding:
            assert probe.onednn_linear(torch.float32, False).taken
    here = threading.current_thread()
    assert [c[0] is here for c in calls] == [True, True, True, False]
    assert all(mode is None and not autocast for _, mode, autocast in calls)
    assert counter.get_total_flops() == 0  # the check's products were not counted as the caller's


def test_a_known_decision_not_to_take_onednn_skips_the_context_checks(monkeypatch):
    """``onednn_mode`` reads the process's answer first: a known "not taken" returns before the call's context
    is inspected; an unknown or taken answer goes through the context checks."""
    monkeypatch.setattr(ops.switch, "_enabled", True)  # a test of the fast path's choice, VITLAB_FAST_PATHS=0 too
    inspected = []
    monkeypatch.setattr(linear_ops, "_context_allows", lambda *a, **k: inspected.append(1) or False)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    monkeypatch.setattr(probe, "_DECISIONS", {(torch.float32, False): probe.Decision(True, False)})
    assert linear_ops.onednn_mode(x, w) is None and not inspected
    monkeypatch.setattr(probe, "_DECISIONS", {(torch.float32, False): probe.Decision(True, True)})
    assert linear_ops.onednn_mode(x, w) is None and inspected == [1]
