"""Models with weights in one call: ``vitlab.create_model(name, pretrained=..., checkpoint_path=...)`` and
``vitlab.from_pretrained(folder)``; :func:`load_model`, the one way the tools get a model with its weights.

Weights never come from the network. ``pretrained=True`` looks in the local weights folder
(``$VITLAB_WEIGHTS``, else ``$XDG_CACHE_HOME/vitlab/weights``, else ``~/.cache/vitlab/weights``) for, in
order, a model folder ``<name>/`` (written by ``save_pretrained``), ``<name>.safetensors``, or the official
checkpoint under its published file name (converted on loading); a missing file is one line naming the
folder and the file names. ``checkpoint_path`` takes any file :func:`load_model` reads (a
``vitlab train`` checkpoint, safetensors, an official or timm checkpoint: detected, converted, loaded
strictly with its report) or a model folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoint import (
    FORMAT,
    check_image_classifier,
    check_model_name,
    describe_mismatch,
    load_checkpoint,
    load_state_checked,
    model_from_checkpoint,
)
from ..data.data_config import training_data_cfg
from ..models import build_model, get_config, list_models
from ..models.base import feature_extractor
from ..models.folder import CONFIG, CONFIG_FIX, WEIGHTS, is_model_folder, is_vitlab_folder, read_config
from ..models.registry import CFG_KEYS, channel_stats, check_overlay, input_cfg, overlay_cfg
from .convert import load_reference, read_checkpoint

WEIGHTS_ENV = "VITLAB_WEIGHTS"
#: the weights file of a folder another library wrote, in the order looked for: safetensors (timm's
#: ``save_for_hf(safe_serialization=True)``, the Trainer), then timm's default ``pytorch_model.bin`` (a torch
#: pickle, read as every other: ``torch.load(weights_only=True)``, tensors and plain values only)
FOREIGN_WEIGHTS = (WEIGHTS, "pytorch_model.bin")


def weights_dir() -> Path:
    """The local weights folder: ``$VITLAB_WEIGHTS``, else the user cache (``$XDG_CACHE_HOME`` or
    ``~/.cache``) ``/vitlab/weights``."""
    if os.environ.get(WEIGHTS_ENV):
        return Path(os.environ[WEIGHTS_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "vitlab" / "weights"


def weight_candidates(name: str) -> list[str]:
    """The file names ``pretrained=True`` accepts for ``name``, in the order they are tried."""
    official = get_config(name).weights_file
    return [f"{name}/", f"{name}.safetensors"] + ([official] if official else [])


def find_weights(name: str) -> Path:
    """The weights of ``name`` in :func:`weights_dir`; FileNotFoundError naming where it looked and for what."""
    folder = weights_dir()
    for candidate in weight_candidates(name):
        path = folder / candidate.rstrip("/")
        if (candidate.endswith("/") and is_model_folder(path)) or (not candidate.endswith("/") and path.is_file()):
            return path
    where = f"${WEIGHTS_ENV}" if os.environ.get(WEIGHTS_ENV) else f"the user cache (set ${WEIGHTS_ENV} to change it)"
    url = get_config(name).weights_url
    hint = f"; the official checkpoint: {url}" if url else "; no official checkpoint is published for it"
    raise FileNotFoundError(
        f"no pretrained weights for {name} in {folder} ({where}): expected "
        f"{' or '.join(weight_candidates(name))} there (vitlab never downloads){hint}"
    )


def from_pretrained(folder: str | os.PathLike, **overrides: Any) -> nn.Module:
    """The model saved in ``folder`` by ``model.save_pretrained(folder)``, in eval mode (Hugging Face's
    ``from_pretrained``). Only ``config.json`` and ``model.safetensors`` are read; nothing in them runs.
    ``overrides`` change build options that keep the weights' shapes (``drop_path_rate``, ...)."""
    return load_folder(folder, **overrides)


def create_model(
    name: str,
    pretrained: bool = False,
    checkpoint_path: str | os.PathLike | None = None,
    pretrained_cfg_overlay: dict[str, Any] | None = None,
    features_only: bool = False,
    out_indices: int | Sequence[int] | None = None,
    feature_cls: str | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build the named model (timm's ``create_model``), with weights when asked.

    Args:
        name: a registered model (``vitlab.list_models()``).
        pretrained: load the model's weights from the local weights folder (:func:`find_weights`), or from
            ``pretrained_cfg_overlay["file"]`` when given (timm's way to name a local file).
        checkpoint_path: load these weights instead (see the module docstring).
        pretrained_cfg_overlay: entries replacing the model's ``pretrained_cfg`` (crop_pct, mean, ...).
        features_only, out_indices, feature_cls: return timm's feature extractor of these blocks (default the
            last 3; ``feature_cls`` None or ``'getter'``).
        overrides: build options (num_classes, img_size, in_chans, drop_path_rate, ...). A ``num_classes``
            other than the weights' gets a new, randomly initialised head (fine-tuning), as timm; an
            ``in_chans`` other than the weights' adapts the first layer (:func:`adapt_input_channels`).

    Returns the model in training mode, as ``torch.nn`` builds it; ``model.meta["weights"]`` says where its
    weights came from.
    """
    overlay = check_overlay(pretrained_cfg_overlay)
    local = overlay.pop("file", None) or None
    if pretrained and checkpoint_path:
        raise ValueError("pass either pretrained=True or checkpoint_path=..., not both")
    path = checkpoint_path or (local if pretrained and local else find_weights(name) if pretrained else None)
    if path is None:
        model = build_model(name, pretrained_cfg_overlay=overlay, **overrides)
    else:
        model = _with_weights(name, Path(path).expanduser(), overlay, overrides)
    return feature_extractor(model, out_indices, feature_cls) if features_only else model


def _with_weights(name: str, path: Path, overlay: dict[str, Any], overrides: dict[str, Any]) -> nn.Module:
    """The model with the weights at ``path``, built as they were (classes and channels included), then given
    a new head for another ``num_classes``, a first layer for another ``in_chans``, and ``overlay`` on its
    pretrained_cfg."""
    num_classes = overrides.pop("num_classes", None)
    if not path.exists():
        raise FileNotFoundError(f"weights {path} not found")
    if path.is_dir() and not is_vitlab_folder(path):  # another library's folder (timm's hub format, a Trainer's)
        path = next((path / w for w in FOREIGN_WEIGHTS if (path / w).is_file()), path)
    try:
        model = load_model(name, path, **overrides)
    except ValueError:  # weights for other channels than asked: loaded as they are, the first layer adapted
        in_chans = overrides.pop("in_chans", None)
        if in_chans is None:
            raise
        model = load_model(name, path, **overrides)
        if in_chans == model.in_chans:
            raise
        model = with_input_channels(model, in_chans)
    if num_classes is not None and num_classes != model.num_classes:
        model.reset_classifier(num_classes)
    overlay_cfg(model, overlay)
    return model.train()


def adapt_input_channels(weight: Tensor, in_chans: int, chans: int | None = None) -> Tensor:
    """First-layer weights ``(O, C, ...)`` of a convolution (or, with ``chans = C`` given, ``(O, C·k·k)`` of a
    Linear over ``C``-major unfolded windows) trained on ``C`` image channels, for ``in_chans`` channels
    (timm's rule).

    One channel: the sum of the ``C`` filters, so a grey image ``g`` gives what the image ``(g, ..., g)`` gave.
    Otherwise the ``C`` filters repeat cyclically up to ``in_chans`` and are scaled by ``C / in_chans``, which
    keeps the response to inputs of the same statistics at its scale: ``W'_c = (C / in_chans) · W_{c mod C}``.
    """
    if in_chans < 1:
        raise ValueError(f"in_chans must be >= 1, got {in_chans}")
    out, chans = weight.shape[0], chans or weight.shape[1]
    per_chan = weight.reshape(out, chans, -1)
    if in_chans == 1:
        adapted = per_chan.sum(1, keepdim=True)
    else:
        index = torch.arange(in_chans, device=weight.device) % chans
        adapted = per_chan[:, index] * (chans / in_chans)
    shape = (out, in_chans, *weight.shape[2:]) if weight.dim() > 2 else (out, -1)
    return adapted.reshape(shape).to(weight.dtype)


def with_input_channels(model: nn.Module, in_chans: int) -> nn.Module:
    """``model`` (built by name) rebuilt for ``in_chans`` image channels, its weights kept and its first layer
    adapted by :func:`adapt_input_channels`; its pretrained_cfg gets the new input size and per-channel
    normalisation. ValueError where more than the first layer depends on the channel count."""
    state = model.state_dict()
    key = f"{model.first_conv}.weight"
    new = build_model(model.model_name, **{**model.model_kwargs, "in_chans": in_chans})
    target = new.state_dict()
    depends = [k for k, v in target.items() if k != key and v.shape != state[k].shape]
    if depends:
        raise ValueError(
            f"{model.model_name}: cannot adapt the weights to {in_chans} input channels: besides {key}, "
            f"{', '.join(depends)} depend on the channel count; train it from scratch with in_chans={in_chans}"
        )
    state[key] = adapt_input_channels(state[key], in_chans, model.in_chans)
    new.load_state_dict(state)
    cfg = model.pretrained_cfg
    stats = {k: channel_stats(cfg[k], in_chans) for k in ("mean", "std")}
    new.pretrained_cfg = {**cfg, **input_cfg(new), **stats}
    weights = getattr(model, "meta", {}).get("weights", "n/a")
    new.meta = {**new.meta, **stats, "weights": f"{weights}, first layer adapted to {in_chans} channels"}
    return new.train(model.training)


# ------------------------------------------------------------------------------------- load_model
def load_model(
    name_or_path: str | Path,
    weights: str | Path | Mapping[str, Any] | None = None,
    *,
    ema: bool = False,
    **overrides: Any,
) -> nn.Module:
    """A model with its weights, in eval mode on the CPU; ``model.meta["weights"]`` says where they came from.

    ``name_or_path`` is a registered model name, or a ``vitlab train`` checkpoint (a file, or a run folder
    holding ``last.pt``) that is then also the weights. ``weights`` is

    - None: random init (seed torch first for a repeatable draw);
    - a ``vitlab train`` checkpoint (a path, or the dict :func:`load_checkpoint` returns): it must hold
      this model; the model is rebuilt with the recorded constructor options plus ``overrides``, with the
      EMA weights when ``ema``;
    - a model folder written by ``save_pretrained`` (config.json + model.safetensors): it must hold this model;
    - any other weights file (safetensors, a state dict in vitlab's or an official implementation's names):
      read without running code and mapped by :func:`vitlab.interop.load_reference` (strict), the number of
      classes taken from its ``head.weight`` unless ``overrides`` set it.

    ``name_or_path`` may also be a model folder.

    ``overrides`` are constructor options (``img_size``, ``in_chans``, ``num_classes``, ...).
    """
    if isinstance(weights, Mapping):
        check_image_classifier(weights)  # before its name is looked up among the image models
    if not isinstance(name_or_path, str) or not _is_model_name(name_or_path):
        if weights is not None:
            raise ValueError(f"{name_or_path} is a checkpoint, not a model name; pass the weights only once")
        if is_model_folder(name_or_path):
            return load_folder(name_or_path, **overrides)
        return _from_vitlab(load_checkpoint(name_or_path), ema, overrides)
    if weights is None:
        if ema:
            raise ValueError("--ema needs a checkpoint written by `vitlab train`; no weights were given")
        return _ready(build_model(name_or_path, **overrides), "random init")
    if isinstance(weights, Mapping):
        if weights.get("format") != FORMAT or "model_name" not in weights:
            raise ValueError("weights given as a dict must be a checkpoint read by vitlab.checkpoint.load_checkpoint")
        check_model_name(dict(weights), name_or_path)
        return _from_vitlab(dict(weights), ema, overrides)
    if not isinstance(weights, Mapping) and is_model_folder(weights):
        model = load_folder(weights, **overrides)
        if model.model_name != name_or_path:
            raise ValueError(f"{weights} holds a {model.model_name!r} model, not {name_or_path!r}")
        return model
    path = _weights_file(weights)
    if (ckpt := _training_checkpoint(path)) is not None:
        check_model_name(ckpt, name_or_path)
        return _from_vitlab(ckpt, ema, overrides)
    if ema:
        raise ValueError(f"--ema needs a checkpoint written by `vitlab train`; {path} holds plain weights")
    return _from_weights_file(name_or_path, path, overrides)


def load_folder(folder: str | Path, **overrides: Any) -> nn.Module:
    """The model saved in ``folder`` by ``save_pretrained`` (config.json + model.safetensors), in eval mode.

    Only JSON and raw tensors are read: nothing in the folder runs. ``overrides`` change build options
    that do not change the weights' shapes (``drop_path_rate``, ``dynamic_img_size``, ...). The model is first
    built on the meta device (no memory): options that do not build it, and weights whose names, shapes or
    kinds (floating point against integer) differ from the model's own, are one line before anything is
    allocated."""
    folder = Path(folder).expanduser()
    config = read_config(folder)
    name, where = config["model_name"], folder / CONFIG
    cfg = {k: v for k, v in config["pretrained_cfg"].items() if k in CFG_KEYS}
    kwargs = {**config["model_kwargs"], **overrides}
    try:
        with torch.device("meta"):
            shaped = build_model(name, pretrained_cfg_overlay=cfg, **kwargs)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        first = " ".join(str(e).split())[:200]
        raise ValueError(f"{where}: model_args do not build {name} ({first}); {CONFIG_FIX}") from None
    recorded = config["num_classes"]
    if recorded is not None and "num_classes" not in overrides and recorded != shaped.num_classes:
        raise ValueError(f"{where}: num_classes {recorded} is not the {shaped.num_classes} classes model_args "
                         f"build; {CONFIG_FIX}")  # fmt: skip
    state = read_checkpoint(folder / WEIGHTS)
    check_state_fits(shaped.state_dict(), state, f"{folder / WEIGHTS}")  # before the real build allocates
    model = build_model(name, pretrained_cfg_overlay=cfg, **kwargs)
    load_state_checked(model, state, f"{folder / WEIGHTS}")
    return _ready(model, f"{folder} (vitlab model folder)")


def _kind(t: Tensor) -> str:
    return "complex" if t.is_complex() else "floating point" if t.is_floating_point() else (
        "bool" if t.dtype == torch.bool else "integer")  # fmt: skip


def check_state_fits(own: Mapping[str, Tensor], state: Mapping[str, Tensor], what: str) -> None:
    """One line when ``state`` does not fit a model whose state_dict is ``own`` (meta tensors will do): names
    missing or unexpected, shapes that differ, or the first tensor whose kind (floating point, integer, bool,
    complex) is not the model's own (``load_state_dict`` would cast int64 weights to float silently). Another
    float precision (bf16 weights for a float32 model) fits: a cast keeps them."""
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(f"{what} does not fit the model: {describe_mismatch(missing, unexpected, shapes)}")
    for key, tensor in state.items():
        mine = own.get(key)
        if isinstance(mine, Tensor) and isinstance(tensor, Tensor) and _kind(mine) != _kind(tensor):
            raise ValueError(
                f"{what}: tensor {key} is {tensor.dtype} ({_kind(tensor)}), but the model's {key} is {mine.dtype} "
                f"({_kind(mine)}): the file is damaged or not this model's weights; re-create it or pass another file"
            )


def _is_model_name(name: str) -> bool:
    """A registered name; raises the registry's "unknown model" error for what is neither a name nor a path."""
    if name in list_models():
        return True
    if Path(name).expanduser().exists() or any(sep in name for sep in ("/", "\\")) or name.endswith((".pt", ".pth")):
        return False
    get_config(name)  # an unknown name, with the closest registered ones
    return True


def _weights_file(weights: str | Path) -> Path:
    path = Path(weights).expanduser()
    if path.is_dir() and (path / "last.pt").is_file():  # a `vitlab train` output folder
        path = path / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    return path


def _training_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint dict when ``path`` was written by ``vitlab train``, else None (plain weights)."""
    if path.suffix == ".safetensors":
        return None
    try:
        return load_checkpoint(path)
    except ValueError:  # not a training checkpoint (or unreadable: the plain reader explains why)
        return None


def _from_vitlab(ckpt: dict[str, Any], ema: bool, overrides: dict[str, Any]) -> nn.Module:
    """The checkpoint's model as it was trained: its build options, and its data (spec, normalisation) in
    ``pretrained_cfg``."""
    check_image_classifier(ckpt)
    model = model_from_checkpoint(ckpt, ema=ema, **overrides)
    config = ckpt.get("config", {})
    if spec := config.get("data"):
        data_cfg = training_data_cfg(spec, model.in_chans, config.get("holdout"))
        streamed = {k: v for k, v in (ckpt.get("data_cfg") or {}).items() if k != "input_size"}
        names = {"label_names": list(ckpt["label_names"])} if ckpt.get("label_names") else {}
        overlay_cfg(model, {**data_cfg, **streamed, **names})  # streaming data: evaluated with the model's crop
    epoch = ckpt.get("epoch", "?")
    return _ready(model, f"{ckpt.get('path', 'checkpoint')} (vitlab checkpoint, epoch {epoch}{', EMA' if ema else ''})")


def _from_weights_file(name: str, path: Path, overrides: dict[str, Any]) -> nn.Module:
    state = read_checkpoint(path)
    head = state.get("head.weight")
    if "num_classes" not in overrides and isinstance(head, Tensor) and head.dim() == 2:
        overrides = {**overrides, "num_classes": head.shape[0]}
    model = build_model(name, **overrides)
    try:
        report = load_reference(model, state, source="auto")
    except ValueError as e:
        first = str(e).splitlines()[0]
        raise ValueError(f"{first}; check the model name and --img-size / --in-chans / --num-classes") from None
    return _ready(model, f"{path} ({report.source} weights)")


def _ready(model: nn.Module, weights: str) -> nn.Module:
    model.meta = {**getattr(model, "meta", {}), "weights": weights}
    return model.eval()
