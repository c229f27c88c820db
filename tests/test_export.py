"""Export: every model family traces to TorchScript, exports to ONNX (run with onnxruntime) and compiles
with inductor on CPU, within 1e-4 of eager; CPVT and AFT-conv export with a dynamic input size.

The families run at their mini configs cut to 2 blocks (export time grows with the graph). TorchScript and
one dynamic-size ONNX export are in the default suite; ONNX for every family and ``torch.compile`` (minutes
on a small CPU) are marked slow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import vitlab
from vitlab.interop.export import (
    check_exports,
    example_input,
    export_onnx,
    onnx_session,
    run_onnx,
    supports_dynamic_size,
    to_torchscript,
)
from vitlab.models import get_config
from vitlab.ops.switch import traced_or_exported

FAMILIES = [
    "deit_mini",
    "refiner_vit_mini",
    "deepvit_mini",
    "cpvt_mini",
    "tnt_mini",
    "eamlp_mini",
    "aft_full_mini",
    "aft_simple_mini",
    "aft_conv_mini",
]
DYNAMIC = {"cpvt_mini", "aft_conv_mini"}
ATOL = 1e-4


def small(name: str, depth: int = 2) -> torch.nn.Module:
    """The family's mini config with ``depth`` blocks (per-block mixer lists and PEG positions cut to fit)."""
    kw = get_config(name).kwargs
    over: dict = {"depth": depth, "num_classes": 10}
    if isinstance(kw.get("mixer"), list):
        over["mixer"] = kw["mixer"][:depth]
    if "peg_at" in kw:
        over["peg_at"] = tuple(i for i in kw["peg_at"] if i < depth)
    torch.manual_seed(0)
    model = vitlab.create_model(name, **over).eval()
    with torch.no_grad():  # BatchNorm statistics away from (0, 1) so that they matter in the comparison
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= ATOL, f"max abs error {err:.3g} > {ATOL}"


def need_onnx():
    pytest.importorskip("onnx", reason="ONNX export needs onnx: pip install -c constraints.txt 'vitlab[export]'")
    pytest.importorskip("onnxruntime", reason="ONNX checks need onnxruntime: pip install 'vitlab[export]'")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")


# ------------------------------------------------------------------------------------------ TorchScript
@pytest.mark.parametrize("name", FAMILIES)
def test_torchscript_trace(name, tmp_path):
    model = small(name)
    x = example_input(model)
    traced = to_torchscript(model, x, tmp_path / "m.pt")
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    with torch.no_grad():
        ref = model(x)
        assert_close(traced(x), ref)
        assert_close(loaded(x), ref)


# -------------------------------------------------------------------------------------------------- ONNX
def check_onnx(name: str, tmp_path) -> None:
    need_onnx()
    model = small(name)
    x = example_input(model)
    path = export_onnx(model, x, tmp_path / f"{name}.onnx")
    sess = onnx_session(path)
    # the batch axis is always dynamic; the image size where the model has no fixed-length table
    sizes = (16, 32, 48) if name in DYNAMIC else (x.shape[-1],)
    for batch, size in [(2, x.shape[-1])] + [(3, s) for s in sizes]:
        y = example_input(model, batch, size)
        with torch.no_grad():
            assert_close(run_onnx(sess, y), model(y))


def test_onnx_dynamic_size_cpvt(tmp_path):
    """CPVT (PEG instead of a table) exports once and runs at 16, 32 and 48 px and any batch."""
    check_onnx("cpvt_mini", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "cpvt_mini"])
def test_onnx(name, tmp_path):
    check_onnx(name, tmp_path)


def test_dynamic_size_support():
    for name in FAMILIES:
        with torch.device("meta"):
            model = vitlab.create_model(name)
        assert supports_dynamic_size(model) == (name in DYNAMIC), name
    with pytest.raises(ValueError, match="fixed-length position table"):
        export_onnx(small("deit_mini", 1), torch.randn(1, 3, 32, 32), "unused.onnx", dynamic_size=True)


def test_one_dynamic_size_rule_for_export_and_eval():
    """``vitlab export`` and ``vitlab eval`` ask the models' one rule: as built (export) or with its tables
    resampled (eval); a model that runs at any size as built also runs once resampled."""
    import vitlab.interop.export
    from vitlab.engine.evaluate import resample_tables
    from vitlab.models import supports_dynamic_size as rule

    assert vitlab.interop.export.supports_dynamic_size is rule
    for name in vitlab.list_models():
        with torch.device("meta"):
            model = vitlab.create_model(name)
        as_built, resampled = rule(model), rule(model, resample=True)
        assert resampled == (get_config(name).arch in ("vit", "tnt")), name
        assert resampled or not as_built, name
    for name in ("deit_mini", "aft_full_mini", "tnt_mini"):  # tables resampled by eval: run at 48 px
        model = small(name, 1)
        resample_tables(model)
        with torch.no_grad():
            assert model(example_input(model, 1, 48)).shape == (1, 10)


# ----------------------------------------------------------------------------------------- torch.compile
@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_torch_compile_inductor(name):
    model = small(name, depth=1 if name != "refiner_vit_mini" else 2)  # the refiner pattern needs two blocks
    errs = check_exports(model, ["compile"])
    assert errs["compile"] <= ATOL, errs


# -------------------------------------------------------------------------------------------------- CLI
def test_cli_export_torchscript(tmp_path):
    out = tmp_path / "deit.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitlab.cli",
            "export",
            "deit_mini",
            "--format",
            "torchscript",
            "--out",
            str(out),
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["out"] == str(out) and out.exists() and info["max_abs_error"] <= ATOL
    bad = subprocess.run(
        [sys.executable, "-m", "vitlab.cli", "export", "no_such_model", "--out", "x.onnx"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "unknown model" in bad.stderr and bad.stderr.strip().count("\n") == 0


# ------------------------------------------------------------------------------------ capture detection
class _CaptureRecorder(torch.nn.Module):
    """Records what :func:`traced_or_exported` says in each forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(traced_or_exported())
        return x * 2


@pytest.mark.parametrize("how", ["trace", "onnx-torchscript"])
def test_capture_is_seen_by_the_tracer_and_the_onnx_exporter(how, tmp_path):
    """The forward passes a TorchScript trace or the TorchScript-based ONNX exporter records see the capture (the
    trace's check then runs the module eagerly again). The dynamo-based exporter is a torch.compile capture."""
    m, x = _CaptureRecorder(), torch.randn(2, 3)
    m(x)
    if how == "trace":
        torch.jit.trace(m, x)
    else:
        need_onnx()
        torch.onnx.export(m, (x,), str(tmp_path / "m.onnx"), dynamo=False)
    assert m.seen[:2] == [False, True], m.seen


def test_a_forward_pass_imports_no_onnx_exporter():
    """Asking whether an ONNX export records must not import the exporters (27 modules, ~2.5 MB in the first
    forward pass): in a fresh process, an AFT model's first forward pass loads no torch.onnx module."""
    code = (
        "import sys, torch, vitlab\n"
        "m = vitlab.create_model('aft_full_mini', num_classes=4).eval()\n"
        "before = set(sys.modules)\n"
        "with torch.inference_mode():\n"
        "    m(torch.randn(1, 3, *m.default_cfg['input_size'][1:]))\n"
        "print(sorted(k for k in set(sys.modules) - before if k.startswith('torch.onnx')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
