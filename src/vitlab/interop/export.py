"""Export vitlab models: TorchScript (trace), ONNX (run with onnxruntime) and ``torch.compile``.

Every registered model exports; :func:`check_exports` compares each exported form
with eager PyTorch. ONNX uses the ``torch.export``-based exporter (``dynamo=True``,
torch's default): the batch is always a dynamic axis, and models without a position
table of fixed length (CPVT's PEG, AFT-conv; :func:`supports_dynamic_size`) also take
any image size that is a multiple of the patch size. The example is exported with a
batch of at least 2 and the axes marked ``Dim.DYNAMIC``: ``torch.export`` fixes an axis
of size 1 to 1 (and an ``AUTO`` axis to whatever the code specialises it to) while the
file still declares it dynamic; a ``DYNAMIC`` axis that the code specialises is an
error at export time instead. :func:`check_onnx` runs the written file in onnxruntime
at batch 1, 2 and 3 (and at twice the size where the size is dynamic) against eager.
TorchScript traces record one input shape. Data-dependent branches are not recorded
in traced graphs: AFT's exact float64 recomputation of entries whose denominator
underflows (extreme logits) is left out of the TorchScript/ONNX graphs (eager and
``torch.compile`` keep it). While a graph is exported the fast paths that torch's
exporters cannot record give way to the plain operations (docs/export.md).

``vitlab export MODEL --format onnx --out model.onnx [--weights w.safetensors] [--check]``.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..common.extras import require
from ..common.io import atomic_open, atomic_path_with_companions
from ..models import supports_dynamic_size

FORMATS = ("torchscript", "onnx", "compile")
# the batch sizes every check runs an exported graph at (the example's batch alone once hid a graph fixed to it)
CHECK_BATCHES = (1, 2, 3)
# an exported graph agrees with eager when max |exported - eager| <= this times max |eager| (float32 reorderings)
TOLERANCE = 1e-4
# weights above this go to a companion file NAME.data (ONNX's protobuf holds at most 2 GiB); below, one file
EXTERNAL_DATA_BYTES = 1 << 30


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
    if path is not None:
        save_torchscript(traced, path)
    return traced


def save_torchscript(module: torch.jit.ScriptModule, path: str | Path) -> Path:
    """Write a traced or scripted module to ``path`` atomically."""
    # serialised in memory first: torch's own file writer aborts the process on a failed write
    with atomic_open(path, "wb") as f:
        f.write(module.save_to_buffer())
    return Path(path)


# --------------------------------------------------------------------------------------------------- ONNX
def writes_companion(model: nn.Module) -> bool:
    """Whether :func:`export_onnx` writes the weights to a companion file ``NAME.data`` beside the ``.onnx`` (weights
    over :data:`EXTERNAL_DATA_BYTES`); smaller models are one self-contained file."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) > EXTERNAL_DATA_BYTES


def _batch_of_two(example: Tensor) -> Tensor:
    """``example`` with at least 2 samples (a batch of 1 repeated): torch.export specialises an axis of size 1."""
    return example if example.shape[0] >= 2 else example.expand(2, *example.shape[1:]).contiguous()


def _specialised_axis(error: BaseException | None) -> int | None:
    """The input axis a torch.export error reports as marked dynamic but specialised to a constant, if any (torch
    words it two ways, by where the specialisation was found)."""
    import re

    pattern = (
        r"marked L\['\w+'\]\.size\(\)\[(\d+)\] as dynamic"
        r"|static shape of \d+ for dimension \w+\['\w+'\]\.shape\[(\d+)\]"
    )
    while error is not None:
        found = re.search(pattern, str(error))
        if found:
            return int(found.group(1) or found.group(2))
        error = error.__cause__ or error.__context__
    return None


def export_onnx(
    model: nn.Module,
    example: Tensor,
    path: str | Path,
    dynamic_size: bool | None = None,
    opset: int | None = None,
    check: Callable[[Path], object] | None = None,
) -> Path:
    """Export to ONNX with the ``torch.export`` exporter; the batch axis is dynamic.

    ``dynamic_size`` (default: :func:`supports_dynamic_size`) also makes height and width dynamic. ``example`` gives
    the input shape; a batch of 1 is exported as 2 (the module docstring says why). ``check`` is called with the
    written file before it replaces ``path`` (with its companion ``NAME.data`` for models over
    :data:`EXTERNAL_DATA_BYTES`): an exception there leaves ``path`` as it was.
    Raises ValueError when asked for a dynamic size the model cannot have.
    """
    _need_onnx()
    if dynamic_size is None:
        dynamic_size = supports_dynamic_size(model)
    elif dynamic_size and not supports_dynamic_size(model):
        raise ValueError(f"{type(model).__name__} has a fixed-length position table: export it at one input size")
    from torch.export import Dim

    axes = {0: Dim.DYNAMIC, **({2: Dim.DYNAMIC, 3: Dim.DYNAMIC} if dynamic_size else {})}
    path = Path(path)
    model = model.eval()
    kw: dict[str, Any] = {"opset_version": opset} if opset else {}
    try:
        with _quiet(), torch.no_grad():
            program = torch.onnx.export(
                model,
                (_batch_of_two(example),),
                dynamo=True,
                input_names=["images"],
                output_names=["logits"],
                dynamic_shapes=(axes,),
                **kw,
            )
    except Exception as e:
        axis = _specialised_axis(e)
        if axis in (2, 3):
            raise ValueError(
                f"{type(model).__name__} fixes the image {'height' if axis == 2 else 'width'} to the example's "
                f"{example.shape[axis]} px in its exported graph: export it at one size (--static-size, "
                "dynamic_size=False)"
            ) from None
        raise
    with _quiet(), atomic_path_with_companions(path) as tmp:  # NAME.data, if any, is committed first
        program.save(tmp, external_data=writes_companion(model))
        if check is not None:
            check(tmp)
    return path


def onnx_session(path: str | Path) -> Any:
    """An onnxruntime CPU session for the file."""
    _need_onnx()
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # shape-merge notices of the optimiser are not problems
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_onnx(session: Any, x: Tensor) -> Tensor:
    """The session's first output for the image batch ``x``."""
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def check_shapes(example: Tensor, dynamic_size: bool) -> list[tuple[int, int, int]]:
    """(batch, height, width) of the inputs a check runs an export at: batches :data:`CHECK_BATCHES` at the
    example's size, and where the size is dynamic also at twice the example's height and width (a multiple of the
    patch whenever the example's size is)."""
    h, w = example.shape[-2:]
    sizes = [(h, w), (2 * h, 2 * w)] if dynamic_size else [(h, w)]
    return [(b, *hw) for hw in sizes for b in CHECK_BATCHES]


def errors(exported: Tensor, eager: Tensor) -> dict[str, float]:
    """``{"abs": max |exported - eager|, "rel": that / max |eager|}``; ValueError when the shapes differ."""
    if exported.shape != eager.shape:
        raise ValueError(f"exported output shape {tuple(exported.shape)} differs from eager {tuple(eager.shape)}")
    diff = (exported.float() - eager.float()).abs().max()
    scale = eager.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return {"abs": diff.item(), "rel": (diff / scale).item()}


def compare(
    model: nn.Module, run: Callable[[Tensor], Tensor], shapes: Sequence[tuple[int, int, int]], what: str
) -> dict[str, dict[str, float]]:
    """``{"BxHxW": errors}`` (:func:`errors`) of ``run`` against eager ``model`` on random inputs of each (batch,
    height, width) in ``shapes``. ValueError (one line, naming the input) when ``run`` fails on one or differs by
    more than :data:`TOLERANCE` of the logits' scale."""
    chans = example_input(model, 1).shape[1]
    out: dict[str, dict[str, float]] = {}
    for b, h, w in shapes:
        x = torch.randn(b, chans, h, w)
        with torch.no_grad():
            ref = model(x)
            try:
                y = run(x)
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise ValueError(f"{what} fails at batch {b}, {h}x{w} px: {first}") from None
        err = out[f"{b}x{h}x{w}"] = errors(y, ref)
        if not err["rel"] <= TOLERANCE:  # (NaN fails too)
            raise ValueError(
                f"{what} differs from eager PyTorch at batch {b}, {h}x{w} px: max error {err['rel']:.3g} of the "
                f"logits' scale (tolerance {TOLERANCE:g})"
            )
    return out


def check_onnx(model: nn.Module, path: str | Path, example: Tensor, dynamic_size: bool) -> dict[str, dict[str, float]]:
    """Run the ONNX file in onnxruntime at :func:`check_shapes` and compare with eager (:func:`compare`)."""
    session = onnx_session(path)
    return compare(model.eval(), lambda x: run_onnx(session, x), check_shapes(example, dynamic_size), "onnxruntime")


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
    """Max |exported - eager| per format on ``example`` (and for ONNX at other batch sizes and sizes).

    Keys: ``torchscript``, ``onnx``, ``onnx@<batch>x<size>`` (batches :data:`CHECK_BATCHES` at the example's
    size, and at ``other_sizes`` if the size is dynamic), ``compile``. The ONNX file goes to ``onnx_path``
    (default: a temporary file).
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
                for batch in CHECK_BATCHES:
                    y = example_input(model, batch=batch, img_size=size)
                    with torch.no_grad():
                        errs[f"onnx@{batch}x{size}"] = err(run_onnx(sess, y), model(y))
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
