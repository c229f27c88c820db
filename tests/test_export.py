"""Export: every model family traces to TorchScript, exports to ONNX (run with onnxruntime) and compiles
with inductor on CPU, within 1e-4 of eager; CPVT and AFT-conv export with a dynamic input size.

The families run at their mini configs cut to 2 blocks (export time grows with the graph). TorchScript and
ONNX for a handful of families (the ones whose graphs once fixed the batch size among them) are in the default
suite; ONNX for every registered mini model and ``torch.compile`` (minutes on a small CPU) are marked slow."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import vitlab
import vitlab.interop.export as export_module
from vitlab.common.rundir import RunLock
from vitlab.interop.export import (
    CHECK_BATCHES,
    check_exports,
    check_onnx,
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
# the default suite's ONNX exports: the three whose graphs once fixed the batch at the example's (the refiner's
# folded maps walked the batch in a Python loop; an example batch of 1 was fixed to 1), and one model of each
# family with its own token mixing or input handling
HANDFUL = [
    "refiner_vit_mini",
    "deepvit_mini",
    "aft_local_w8_mini",
    "tnt_mini",
    "cpvt_mini",
    "eamlp_mini",
    "aft_conv_mini",
]
MINIS = vitlab.list_models("*_mini")


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
def exports_at_any_batch(model: torch.nn.Module, tmp_path) -> None:
    """``vitlab export``'s path: exported from an example batch of 1 (the command's default), the file runs in
    onnxruntime at batch 1, 2 and 3 (and at twice the size where the size is dynamic) with eager's logits
    (:func:`check_onnx` raises otherwise)."""
    need_onnx()
    x = example_input(model, 1)
    path = export_onnx(model, x, tmp_path / "model.onnx")
    dynamic = supports_dynamic_size(model)
    errs = check_onnx(model, path, x, dynamic)
    size = x.shape[-1]
    expected = {f"{b}x{s}x{s}" for b in CHECK_BATCHES for s in ((size, 2 * size) if dynamic else (size,))}
    assert set(errs) == expected and max(e["rel"] for e in errs.values()) <= ATOL, errs


@pytest.mark.parametrize("name", HANDFUL)
def test_onnx_runs_at_any_batch(name, tmp_path, fast_path):
    """The exported graph is batch-dynamic, with the fast paths on (the refiner's folded maps walk the batch in a
    Python loop, which an export once fixed at the example's batch); CPVT and AFT-conv take any size too. One
    block (the refiner's pattern needs two)."""
    exports_at_any_batch(small(name, 2 if name == "refiner_vit_mini" else 1), tmp_path)


def torch_default_export(model: torch.nn.Module, tmp_path, onednn_linear) -> None:
    """``torch.onnx.export(model, (x,), path)`` with torch's defaults (the dynamo-based exporter, autograd on, no
    dynamic axes) where the probe takes oneDNN's linear layers for training (a registered operator in compiled
    graphs): the file holds plain ONNX operators and runs with eager's logits."""
    need_onnx()
    import onnx

    x = example_input(model, 2)
    with torch.no_grad():
        ref = model(x)
    onednn_linear(torch.float32, training=True)
    path = tmp_path / "default.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path))
    graph = onnx.load(str(path), load_external_data=False).graph
    assert not [node.op_type for node in graph.node if "vitlab" in node.domain or "onednn" in node.op_type]
    assert_close(run_onnx(onnx_session(path), x), ref)


@pytest.mark.parametrize("name", ["deit_mini", "aft_local_w8_mini"])
def test_torch_onnx_export_with_defaults(name, tmp_path, onednn_linear):
    """torch.onnx.export's defaults (grad on) once recorded vitlab::onednn_linear, which no exporter translates."""
    torch_default_export(small(name, 1), tmp_path, onednn_linear)


@pytest.mark.slow
@pytest.mark.parametrize("name", MINIS)
def test_every_mini_exports(name, tmp_path, onednn_linear, fast_path):
    """Every registered mini model as built: ``vitlab export``'s path runs at batch 1, 2 and 3 (and two sizes
    where the size is dynamic), and torch's default export works."""
    torch.manual_seed(0)
    model = vitlab.create_model(name).eval()
    exports_at_any_batch(model, tmp_path)
    torch_default_export(model, tmp_path, onednn_linear)


def test_torch_default_export_of_attention_with_a_bias(tmp_path, onednn_linear, fast_path):
    """torch's ONNX decomposition of SDPA with an additive bias (2-D relative positions) fails with autograd on,
    torch.onnx.export's default: an export with a bias records the explicit form of the same function."""
    torch.manual_seed(0)
    torch_default_export(vitlab.create_model("deit_rpe2d_mini").eval(), tmp_path, onednn_linear)


@pytest.mark.parametrize("name", ["refiner_vit_mini", "tnt_mini"])
def test_torchscript_onnx_exporter_records_the_model_as_eager(name, tmp_path, fast_path):
    """The TorchScript-based exporter (dynamo=False) recorded writes into views of a new tensor wrongly: the
    refiner's folded maps (logits off by ~0.07) and TNT's inner-to-outer sum (0.1-0.2): exports take the plain
    operations."""
    need_onnx()
    model = small(name)
    x = example_input(model, 2)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(tmp_path / "m.onnx"), dynamo=False)
        assert_close(run_onnx(onnx_session(tmp_path / "m.onnx"), x), model(x))


def test_torchscript_onnx_exporter_refuses_aft_local_in_one_line(tmp_path):
    need_onnx()
    model = small("aft_local_w8_mini", 1)
    with warnings.catch_warnings(), torch.no_grad(), pytest.raises(ValueError) as info:
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example_input(model, 2),), str(tmp_path / "m.onnx"), dynamo=False)
    msg = str(info.value)
    assert "\n" not in msg and "TorchScript-based ONNX exporter" in msg and "dynamo=True" in msg, msg


# --------------------------------------------------------------------------------------------- files written
def test_onnx_is_one_file_that_works_where_it_is_moved(tmp_path):
    need_onnx()
    model = small("deit_mini", 1)
    x = example_input(model, 2)
    export_onnx(model, x, tmp_path / "a" / "m.onnx")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["m.onnx"]
    (tmp_path / "b").mkdir()
    shutil.move(tmp_path / "a" / "m.onnx", tmp_path / "b" / "m.onnx")
    with torch.no_grad():
        assert_close(run_onnx(onnx_session(tmp_path / "b" / "m.onnx"), x), model(x))


def test_a_failed_check_leaves_the_output_untouched(tmp_path):
    need_onnx()
    out = tmp_path / "m.onnx"
    out.write_bytes(b"the previous export")

    def fail(path):
        assert path != out and path.is_file()  # the written file, before it replaces OUT
        raise ValueError("check failed")

    model = small("deit_mini", 1)
    with pytest.raises(ValueError, match="check failed"):
        export_onnx(model, example_input(model, 1), out, check=fail)
    assert out.read_bytes() == b"the previous export" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_weights_in_a_companion_file_are_written_together_under_the_folder_lock(tmp_path, monkeypatch, capsys):
    """Large weights go to OUT.data beside OUT: two files that belong together. ``vitlab export`` holds the output
    folder's lock while it writes them (a second writer is refused in one line) and leaves both, working."""
    need_onnx()
    from vitlab.cli import main

    monkeypatch.setattr(export_module, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "m.onnx"
    argv = ["export", "deit_mini", "--out", str(out)]
    with RunLock(tmp_path, "another export", lambda line: None):
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "is in use by another export" in err and "\n" not in err, err
    assert not out.exists()
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]  # no lock or temporary left
    model = vitlab.create_model("deit_mini").eval()
    with torch.no_grad():
        assert run_onnx(onnx_session(out), example_input(model, 3)).shape == (3, 1000)


def test_cli_onnx_check_runs_batches_1_2_3(tmp_path, capsys, fast_path):
    """``--check`` runs the written file at batch 1, 2 and 3: the export batch alone once hid a graph fixed to it
    (the refiner's, exported from the default example batch of 1)."""
    need_onnx()
    from vitlab.cli import main

    out = tmp_path / "refiner.onnx"
    assert main(["export", "refiner_vit_mini", "--out", str(out), "--check"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(info["checked"]) == ["1x32x32", "2x32x32", "3x32x32"] and info["max_rel_error"] <= ATOL, info


class _FixedHeight(torch.nn.Module):
    """Claims to take any size (no position table) but its code fixes the height at 32."""

    dynamic_img_size, pos_embed = False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] != 32:
            raise ValueError("32 px high only")
        return x.mean((2, 3))


def test_a_size_the_graph_fixes_is_one_line(tmp_path):
    """A dynamic height that the traced code specialises is an error naming the axis and what to do, not a file
    that declares a dynamic size and runs at one."""
    need_onnx()
    with pytest.raises(ValueError) as info:
        export_onnx(_FixedHeight(), torch.randn(2, 3, 32, 32), tmp_path / "m.onnx", dynamic_size=True)
    msg = str(info.value)
    assert "\n" not in msg and "height" in msg and "--static-size" in msg, msg
    assert not list(tmp_path.iterdir())


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
