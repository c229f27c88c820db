"""A checkpoint file as a vitlab model ready to save (``vitlab convert``): a ``vitlab train`` checkpoint or a model
folder rebuilt as it was built, or an official / timm checkpoint mapped into a named registered model with the
report of what fitted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import load_checkpoint
from ..models import build_model, get_config
from ..models.folder import is_model_folder
from .convert import detect_source, load_reference, read_checkpoint
from .keymaps import check_source, convert_state
from .pretrained import load_folder, load_model


def rebuild_vitlab_model(
    src: Path,
    model_name: str | None = None,
    num_classes: int | None = None,
    img_size: int | None = None,
    ema: bool = False,
) -> tuple[Any, None, dict[str, Any]] | None:
    """A `vitlab train` checkpoint or a model folder, rebuilt as it was built (the EMA's weights with ``ema``;
    resampled to ``img_size``), with no report and its facts; None for other files."""

    if is_model_folder(src):
        model = load_folder(src)
    else:
        try:
            ckpt = load_checkpoint(src)
        except ValueError:  # not a vitlab checkpoint: an official / timm one
            return None
        model = load_model(ckpt["model_name"], ckpt, ema=ema)
    if model_name and model_name != model.model_name:
        raise ValueError(f"{src} holds a {model.model_name!r} model, not {model_name!r}")
    if num_classes is not None and num_classes != model.num_classes:
        raise ValueError(f"{src} was trained for {model.num_classes} classes; its head cannot be converted to another")
    notes = []
    if img_size and (img_size, img_size) != model.img_size:
        notes.append(f"input size {model.img_size[0]}x{model.img_size[1]} -> {img_size} (position table resampled)")
        model.set_input_size(img_size)
    kw = ", ".join(f"{k}={v!r}" for k, v in model.model_kwargs.items())
    summary = f"{model.meta['weights']}: {model.model_name}({kw}); every tensor loaded" + "".join(
        f"; {n}" for n in notes
    )
    info = {
        "source": "vitlab",
        "ok": True,
        "model": model.model_name,
        "model_kwargs": model.model_kwargs,
        "num_classes": model.num_classes,
        "notes": notes,
        "summary": summary,
    }
    return model, None, info


def map_reference_checkpoint(
    src: Path,
    model_name: str | None,
    source: str = "auto",
    nested_key: str | None = None,
    num_classes: int | None = None,
    img_size: int | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """An official / timm checkpoint mapped into the registered model ``model_name``: the model, the load
    report (non-strict here: the caller decides) and its facts."""

    if not model_name:
        raise ValueError(f"{src} is not a vitlab checkpoint; name the vitlab model to load it into with --model")
    get_config(model_name)  # an unknown name fails before the checkpoint is read
    state = read_checkpoint(src, nested_key)
    source = detect_source(state) if source == "auto" else check_source(source)
    if num_classes is None:
        head = convert_state(state, source)[0].get("head.weight")
        num_classes = head.shape[0] if head is not None and head.dim() == 2 else None
    overrides = {k: v for k, v in (("num_classes", num_classes), ("img_size", img_size)) if v}
    model = build_model(model_name, **overrides)
    report = load_reference(model, state, source=source, strict=False)
    report.origin = str(src)
    model.meta["weights"] = f"{src} ({source} weights)"
    return model, report, {**report.to_dict(), "model": model_name, "num_classes": num_classes}
