"""Export vitlab models: TorchScript (trace), ONNX (run with onnxruntime) and ``torch.compile``.

Every registered model exports; :func:`check_exports` compares each exported form
with eager PyTorch. ONNX uses the ``torch.export``-based exporter (``dynamo=True``):
the batch is always a dynamic axis, and models without a position table of fixed
length (CPVT's PEG, AFT-conv; :func:`supports_dynamic_size`) also take any image
size that is a multiple of the patch size. TorchScript traces record one input
shape. Data-dependent branches are not recorded in traced graphs: AFT's exact
float64 recomputation of entries whose denominator underflows (extreme logits) is
left out of the TorchScript/ONNX graphs (eager and ``torch.compile`` keep it).

``vitlab export MODEL --format onnx --out model.onnx [--weights w.safetensors] [--check]``.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..common.extras import require
from ..common.io import atomic_open, atomic_path_with_companions
from ..models import supports_dynamic_size

FORMATS = ("torchscript", "onnx", "compile")


def _need_onnx() -> None:
    for module in ("onnx", "onnxruntime", "onnxscript"):
        require(module, purpose="ONNX export", extra="export")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Exporters print progress and warn about deprecations and traced Python values; keep that out of the way."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def example_input(model: nn.Module, batch: int = 2, img_size: int | Sequence[int] | None = None) -> Tensor:
    """A random image batch of the model's input size (``model.meta['input_size']``, else 3x224x224)."""
    chans, h, w = getattr(model, "meta", {}).get("input_size", (3, 224, 224))
    if img_size is not None:
        h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    return torch.randn(batch, chans, h, w)


# --------------------------------------------------------------------------------------------- TorchScript
def to_torchscript(model: nn.Module, example: Tensor, path: str | Path | None = None) -> torch.jit.ScriptModule:
    """Trace the model in eval mode on ``example`` (one input shape; the batch size is free) and optionally save."""
    model = model.eval()
    with _quiet(), torch.no_grad():
        traced = torch.jit.trace(model, (example,), check_trace=False)
    if path is not None:  # serialised in memory first: torch's own file writer aborts the process on a failed write
        with atomic_open(path, "wb") as f:
            f.write(traced.save_to_buffer())
    return traced


# --------------------------------------------------------------------------------------------------- ONNX
def export_onnx(
    model: nn.Module, example: Tensor, path: str | Path, dynamic_size: bool | None = None, opset: int | None = None
) -> Path:
    """Export to ONNX with the ``torch.export`` exporter; the batch axis is dynamic.

    ``dynamic_size`` (default: :func:`supports_dynamic_size`) also makes height and width dynamic.
    Raises ValueError when asked for a dynamic size the model cannot have.
    """
    _need_onnx()
    if dynamic_size is None:
        dynamic_size = supports_dynamic_size(model)
    elif dynamic_size and not supports_dynamic_size(model):
        raise ValueError(f"{type(model).__name__} has a fixed-length position table: export it at one input size")
    from torch.export import Dim

    axes = {0: Dim.AUTO, **({2: Dim.AUTO, 3: Dim.AUTO} if dynamic_size else {})}
    path = Path(path)
    model = model.eval()
    kw: dict[str, Any] = {"opset_version": opset} if opset else {}
    with _quiet(), torch.no_grad(), atomic_path_with_companions(path) as tmp:  # ONNX writes NAME.data too
        torch.onnx.export(
            model,
            (example,),
            str(tmp),
            dynamo=True,
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=(axes,),
            **kw,
        )
    return path


def onnx_session(path: str | Path) -> Any:
    """An onnxruntime CPU session for the file."""
    _need_onnx()
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # shape-merge notices of the optimiser are not problems
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_onnx(session: Any, x: Tensor) -> Tensor:
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


# -------------------------------------------------------------------------------------------------- compile
def compile_model(model: nn.Module, dynamic: bool | None = False, backend: str = "inductor") -> nn.Module:
    """``torch.compile`` (inductor; on CPU it generates C++). Compilation happens on the first call."""
    return torch.compile(model.eval(), backend=backend, dynamic=dynamic)


# ---------------------------------------------------------------------------------------------------- check
def check_exports(
    model: nn.Module,
    formats: Sequence[str] = FORMATS,
    example: Tensor | None = None,
    other_sizes: Sequence[int] = (),
    onnx_path: str | Path | None = None,
) -> dict[str, float]:
    """Max |exported - eager| per format on ``example`` (and at ``other_sizes`` for ONNX if the size is dynamic).

    Keys: ``torchscript``, ``onnx``, ``onnx@<batch>x<size>`` (another batch size, and the other sizes),
    ``compile``. The ONNX file goes to ``onnx_path`` (default: a temporary file).
    """
    import tempfile

    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"unknown export format(s) {', '.join(sorted(unknown))}; known: {', '.join(FORMATS)}")
    model = model.eval()
    x = example_input(model) if example is None else example
    with torch.no_grad():
        ref = model(x)
    errs: dict[str, float] = {}

    def err(a: Tensor, b: Tensor) -> float:
        if a.shape != b.shape:
            raise ValueError(f"exported output shape {tuple(a.shape)} differs from eager {tuple(b.shape)}")
        return (a.float() - b.float()).abs().max().item()

    if "torchscript" in formats:
        errs["torchscript"] = err(to_torchscript(model, x)(x), ref)
    if "onnx" in formats:
        with tempfile.TemporaryDirectory() as tmp:
            path = export_onnx(model, x, onnx_path or Path(tmp) / "model.onnx")
            sess = onnx_session(path)
            errs["onnx"] = err(run_onnx(sess, x), ref)
            sizes = [x.shape[-1]] + (list(other_sizes) if supports_dynamic_size(model) else [])
            for size in sizes:
                y = example_input(model, batch=x.shape[0] + 1, img_size=size)
                with torch.no_grad():
                    errs[f"onnx@{y.shape[0]}x{size}"] = err(run_onnx(sess, y), model(y))
    if "compile" in formats:
        with torch.no_grad():
            errs["compile"] = err(compile_model(model)(x), ref)
    return errs


def _export_size(model: nn.Module, img_size: int | None) -> int | None:
    """The example input size: the model's own, or ``--img-size`` when the model takes any size as built.
    A model with a fixed-length position table is never resized here (that would export another model)."""
    built = tuple(getattr(model, "meta", {}).get("input_size", (3, 224, 224))[1:])
    if img_size is None or (img_size, img_size) == built:
        return None
    if not supports_dynamic_size(model):
        raise ValueError(
            f"the model is built for {built[0]}x{built[1]} px and has a fixed-length position table; exporting at "
            f"{img_size} px would resize it: export at its own size (omit --img-size), or convert it to another "
            f"size first (`vitlab convert ... --img-size {img_size}`, which reports the resampling)"
        )
    return img_size
