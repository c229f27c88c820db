"""Evaluating a checkpoint (``vitlab eval``): top-1 / top-5 and throughput of a checkpoint on held-out data, at its training input
size or others (``--img-size 28 56``): the CPVT paper's "train at 224, test at 384 without fine-tuning".

Official or timm weights (``vitlab eval refiner_vit_s --weights official.pth --data folder:<imagenet>/val``)
are evaluated with the model's data configuration (``vitlab.data.resolve_data_config``: resize the shorter
side to size / crop_pct, centre crop, the official mean/std), as the official evaluation does.

At another size the held-out images are resized (bilinear, antialiased) and the model runs on the larger
patch grid: PEG and AFT-conv adapt by construction, a learned position table and AFT-full/local's position
biases are resampled (bicubic over the patch grid).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..common.device import resolve_device
from ..data.spec import DataSpec


def resample_tables(model: Any) -> None:
    """Let ``model`` run at other input sizes where it can (:func:`vitlab.models.supports_dynamic_size` with
    ``resample``): its position table resampled to the input (``dynamic_img_size``), and AFT-full/local's
    learned position biases interpolated as the table. Both are read at each forward, so setting them on the
    built model is the same as building it so."""
    from ..models import supports_dynamic_size

    if supports_dynamic_size(model, resample=True):
        model.dynamic_img_size = True
    for m in model.modules():
        if isinstance(getattr(m, "resample", None), bool):
            m.resample = True


def load_for_eval(
    path: str | Path, weights: str | Path | None, model_name: str | None, ema: bool
) -> tuple[Any, dict[str, Any]]:
    """The model, and what evaluating it needs from its weights: ``{"data": the spec it was trained on or None,
    "holdout", "trained": True for a `vitlab train` checkpoint}``."""
    from ..checkpoint import load_checkpoint
    from ..interop.pretrained import load_model
    from ..models import list_models
    from ..models.folder import is_model_folder, read_config

    if weights is None and str(path) not in list_models() and not is_model_folder(path):
        ckpt = load_checkpoint(path)
        model = load_model(model_name or ckpt["model_name"], ckpt, ema=ema)
        cfg = ckpt.get("config", {})
        return model, {"data": cfg.get("data", "mnist"), "holdout": cfg.get("holdout"), "trained": True}
    if ema:
        raise ValueError("--ema needs a checkpoint written by `vitlab train`")
    name = read_config(path)["model_name"] if is_model_folder(path) else str(path)
    if model_name and model_name != name:
        raise ValueError(f"{path} holds a {name!r} model, not {model_name!r}")
    if not is_model_folder(path) and weights is None:
        raise ValueError(
            f"{name} is a model name: give its weights with --weights (a random model has nothing to evaluate)"
        )
    model = load_model(str(path), weights)
    cfg = model.pretrained_cfg
    return model, {"data": cfg.get("data"), "holdout": cfg.get("holdout"), "trained": False}


def _loaders(model: Any, trained: dict[str, Any], spec: DataSpec, sizes: list[int], batch_size: int, workers: int,
             dev, crop_pct: float | None = None) -> list:  # fmt: skip
    """One evaluation loader per input size, through ``vitlab.data``'s one road (``open_source`` ->
    ``create_transform`` -> ``create_loader``; a ``folder:`` spec streams)."""
    from ..data import create_loader, open_source

    names = model.pretrained_cfg.get("label_names") if spec.kind == "folder" else None
    source = open_source(spec, _eval_split(spec, trained), holdout=trained["holdout"], classes=names)
    if getattr(source, "classes", ()) is None:  # plain shards: their classes are the model's
        source = source.with_num_classes(model.num_classes)
    _check_data(spec, source.num_classes, getattr(source, "in_chans", model.in_chans), model)
    return [
        create_loader(source, _eval_transform(model, trained, source, s, crop_pct), batch_size, is_training=False,
                      workers=workers, device=dev)
        for s in sizes
    ]  # fmt: skip


def _eval_transform(model: Any, trained: dict[str, Any], source: Any, size: int, crop_pct: float | None = None):
    """A `vitlab train` checkpoint of in-memory data is evaluated as its training evaluated (the held-out images
    resized whole, the normalisation of its training data); one trained on streaming data, and other weights,
    as their official code does, with the model's data configuration (``resolve_data_config``: resize the
    shorter side to size / crop_pct, centre crop, the model's mean/std; ``crop_pct`` overrides the model's)."""
    from ..data import ImageDataset, create_transform, resolve_data_config
    from .data import whole_image

    data_cfg = resolve_data_config(model)
    if crop_pct is not None:
        if isinstance(source, ImageDataset):
            raise ValueError("--crop-pct sets the crop of folder:/wds: data; in-memory sets are resized whole")
        data_cfg["crop_pct"] = crop_pct
    if trained["trained"] and isinstance(source, ImageDataset):
        recorded = "data" in model.pretrained_cfg  # older checkpoints: the statistics of the data evaluated on
        return whole_image(size, *((data_cfg["mean"], data_cfg["std"]) if recorded else (source.mean, source.std)))
    return create_transform(**{**data_cfg, "input_size": (model.in_chans, size, size)}, is_training=False)


def _eval_split(spec: DataSpec, trained: dict[str, Any]) -> str:
    """The held-out split of the run's own data, or a whole folder or shard pattern given with ``--data``
    (ImageNet's val/)."""
    if spec.kind == "folder" and not _same_data(spec, trained.get("data")):
        return "val" if (Path(spec.path).expanduser() / "train").is_dir() else "all"
    if spec.kind == "wds" and not _same_data(spec, trained.get("data")):
        from ..data.wds import split_patterns

        return "all" if split_patterns(spec.path) is None and not Path(spec.path).expanduser().is_dir() else "val"
    return "val"


def _same_data(spec: DataSpec, recorded: str | None) -> bool:
    """Whether ``spec`` names the data the weights were trained on (their recorded spec, which may be gone)."""
    try:
        return recorded is not None and DataSpec.parse(recorded) == spec
    except ValueError:
        return False


def _check_data(spec: DataSpec, num_classes: int, in_chans: int, model: Any) -> None:
    if num_classes != model.num_classes:
        raise ValueError(f"{str(spec)!r} has {num_classes} classes, the model predicts {model.num_classes}")
    if in_chans != model.in_chans:
        raise ValueError(f"{str(spec)!r} has {in_chans}-channel images, the model takes {model.in_chans}")


def evaluate_checkpoint(
    path: str | Path,
    img_sizes: list[int] | None = None,
    data: str | DataSpec | None = None,
    model_name: str | None = None,
    ema: bool = False,
    batch_size: int = 256,
    device: str = "auto",
    amp: str = "none",
    threads: int = 2,
    weights: str | Path | None = None,
    workers: int = 0,
    crop_pct: float | None = None,
) -> list[dict[str, Any]]:
    """One result row per input size: ``{model, img_size, top1, top5, loss, n, skipped, img_s}`` (``skipped``:
    unreadable images left out); ``crop_pct`` overrides the model's evaluation crop of streaming data."""
    import torch

    from ..common.device import amp_dtype
    from .loop import evaluate, is_oom

    if threads > 0:
        torch.set_num_threads(threads)
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if img_sizes and any(s < 1 for s in img_sizes):
        raise ValueError(f"--img-size must be positive, got {img_sizes}")
    model, trained = load_for_eval(path, weights, model_name, ema)
    name, train_size = model.model_name, model.img_size[0]
    sizes = img_sizes or [train_size]
    if any(s != train_size for s in sizes):
        resample_tables(model)
    if (data or trained["data"]) is None:
        raise ValueError(f"--data is needed: the weights of {name} do not say what data they were trained on")
    spec = DataSpec.parse(data or trained["data"])
    dev = resolve_device(device)
    model.to(dev).eval()
    dtype = amp_dtype(amp, dev)
    weights_used = ("ema" if ema else "model") if trained["trained"] else model.meta.get("weights", "")
    rows = []
    for size, loader in zip(sizes, _loaders(model, trained, spec, sizes, batch_size, workers, dev, crop_pct)):
        try:
            res = evaluate(model, loader, dev, dtype)
        except ValueError as e:
            raise ValueError(f"{name} cannot run at {size}px: {e}") from None
        except RuntimeError as e:
            if is_oom(e):
                raise ValueError(
                    f"a batch of {batch_size} images at {size}px does not fit in memory; use a smaller --batch-size"
                ) from None
            raise
        rows.append({"model": name, "img_size": size, "trained_at": train_size, "weights": weights_used, **res})
    return rows
