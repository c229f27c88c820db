"""Read checkpoints safely, convert them to vitlab names and load them strictly, with a report.

Loading never runs code from a file (:mod:`vitlab.checkpoint.safeload`): ``.safetensors`` files hold raw
tensors, and PyTorch files go through ``torch.load(weights_only=True)`` (tensors, containers and plain
values only; ``argparse.Namespace`` is also allowed because timm and DeiT training checkpoints store their
arguments in one). A file holding any other Python object is refused with a ValueError before anything
from it runs; so is every damaged file, in one line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoint.safeload import load_file
from ..common.io import write_safetensors_atomic
from ..layers import resample_pos_embed
from .keymaps import SOURCES, check_source, compact_keys, convert_state

PathOrState = str | os.PathLike | Mapping[str, Any]

#: where training scripts nest the weights, in the order they are looked for
NESTED_KEYS = ("model", "state_dict", "model_state", "state_dict_ema", "model_ema", "ema")


# ------------------------------------------------------------------------------------------- reading
def read_checkpoint(path: str | os.PathLike, nested_key: str | None = None) -> dict[str, Tensor]:
    """The flat ``{name: tensor}`` state_dict inside a checkpoint file.

    The format is told by the file's first bytes (:func:`vitlab.checkpoint.safeload.load_file`): safetensors
    files are read with safetensors, PyTorch files with ``torch.load(weights_only=True)``; anything else,
    or a damaged file, is one ValueError line. A dict nesting the weights under one of ``NESTED_KEYS``
    ("model", "state_dict", "state_dict_ema", ...) is unwrapped (``nested_key`` picks one explicitly), and
    DataParallel's ``module.`` prefix is stripped.
    """
    return unwrap_state(load_file(path), nested_key, where=str(path))


def unwrap_state(obj: Any, nested_key: str | None = None, where: str = "checkpoint") -> dict[str, Tensor]:
    """The state_dict inside a loaded checkpoint object (see :func:`read_checkpoint`)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a dict of tensors, got {type(obj).__name__}")
    if nested_key is not None:
        if nested_key not in obj:
            raise ValueError(f"{where}: no entry {nested_key!r}; top-level keys: {', '.join(map(str, obj))}")
        obj = obj[nested_key]
    elif not any(isinstance(v, Tensor) for v in obj.values()):
        key = next((k for k in NESTED_KEYS if isinstance(obj.get(k), Mapping)), None)
        if key is None:
            raise ValueError(
                f"{where}: found no tensors and none of the usual entries {', '.join(NESTED_KEYS)}; "
                f"top-level keys: {', '.join(map(str, list(obj)[:20]))}"
            )
        obj = obj[key]
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise ValueError(f"{where}: entries that are not tensors: {', '.join(map(str, bad[:10]))}")
    if obj and all(k.startswith("module.") for k in obj):  # DataParallel / DDP
        return {k[len("module.") :]: v for k, v in obj.items()}
    return dict(obj)


def _as_state(path_or_state: PathOrState, nested_key: str | None = None) -> tuple[dict[str, Tensor], str]:
    if isinstance(path_or_state, Mapping):
        return unwrap_state(path_or_state, nested_key), "state_dict"
    return read_checkpoint(path_or_state, nested_key), str(path_or_state)


# ---------------------------------------------------------------------------------- source detection
def detect_source(state: Mapping[str, Any]) -> str:
    """Which implementation wrote ``state`` (a flat state_dict), from its key names.

    Returns a key of :data:`~vitlab.interop.keymaps.SOURCES`; raises ValueError
    when the keys match none (pass the source explicitly then).
    """
    keys = set(state)

    def has(pattern: str) -> bool:
        rx = re.compile(pattern)
        return any(rx.search(k) for k in keys)

    if has(r"^patch_embeds\.\d+\.") or (has(r"^pos_block\.\d+\.proj\.0\.") and has(r"^blocks\.\d+\.\d+\.")):
        if has(r"^blocks\.\d+\.\d+\.attn\.qkv\.") or not has(r"^pos_block\."):
            raise ValueError(
                "this looks like a Twins pyramid with timm blocks or position tables (Twins-SVT / ALTGVT, PVT); "
                "vitlab implements the CPVTV2 pyramid (pcpvt_*) only"
            )
        return "twins_cpvtv2"
    if has(r"^linear_0\.weight$") and has(r"^conv2\.1\.running_mean$"):
        return "eanet"
    if has(r"^tokens_to_token\.attention\d\.") or has(r"\.attn\.trans_dims\."):
        return "eamlp"
    if "outer_pos" in keys or "outer_tokens" in keys or has(r"\.outer_attn\.qk\."):
        return "tnt_huawei"
    if "pixel_pos" in keys or "patch_pos" in keys or has(r"\.attn_in\.qk\."):
        return "tnt_timm"
    if has(r"\.attn\.DLA\.") or has(r"\.mlp\.scale_channel$") or "patch_embed.conv3.weight" in keys:
        return "refiner"
    if has(r"\.attn\.reatten_matrix\.") or "patch_embed.conv1.weight" in keys:
        return "deepvit"
    if has(r"^pos_block\."):
        return "cpvt"
    if has(r"^proj\.0\.weight$") and len(keys) <= 2:
        return "twins_peg"
    if has(r"\.mixer\.") or has(r"^pegs\."):
        return "vitlab"
    # the CNN baselines keep their reference implementations' names (torchvision's ResNet, timm's RegNetY and
    # EfficientNet): their checkpoints load as vitlab's own
    if has(r"^layer\d\.\d+\.conv1\.weight$") or has(r"^s\d\.b\d+\.conv1\.") or "conv_stem.weight" in keys:
        return "vitlab"
    if has(r"^blocks\.\d+\.attn\.qkv\."):
        return "deit" if "dist_token" in keys else "timm_vit"
    sample = ", ".join(sorted(keys)[:8])
    raise ValueError(
        f"cannot tell which implementation wrote this checkpoint (keys: {sample}, ...); "
        f"pass the source explicitly, one of: {', '.join(SOURCES)}"
    )


# ---------------------------------------------------------------------------------------- the report
@dataclass
class LoadReport:
    """What a conversion did: which tensors loaded, and everything that did not fit.

    ``ok`` is True when every model tensor got a checkpoint tensor of the right
    shape and every checkpoint tensor was used (apart from ``dropped`` ones, which
    the reference keeps but never uses, or which the model has no place for by design).
    """

    source: str
    origin: str = "state_dict"
    matched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    resampled: list[tuple[str, tuple[int, ...], tuple[int, ...], str]] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def problems(self) -> str:
        """One line: the counts of what did not fit."""
        parts = [
            f"{len(v)} {name}"
            for name, v in (
                ("missing", self.missing),
                ("unexpected", self.unexpected),
                ("shape mismatches", self.mismatched),
            )
            if v
        ]
        return ", ".join(parts) or "none"

    def lines(self) -> list[str]:
        out = [
            f"source: {self.source} ({SOURCES.get(self.source, '')}) from {self.origin}",
            f"matched: {len(self.matched)} tensors",
        ]
        if self.resampled:
            out.append("resampled:")
            out += [f"  {k}: {old} -> {new} ({how})" for k, old, new, how in self.resampled]
        if self.dropped:
            out.append("dropped from the checkpoint:")
            out += [f"  {k}: {why}" for k, why in self.dropped.items()]
        if self.excluded:
            out.append(f"excluded on purpose: {', '.join(compact_keys(self.excluded))}")
        if self.notes:
            out.append("transformed:")
            out += [f"  {n}" for n in self.notes]
        for name, keys in (
            ("missing (in the model, not in the checkpoint)", self.missing),
            ("unexpected (in the checkpoint, not in the model)", self.unexpected),
        ):
            if keys:
                out.append(f"{name}: {len(keys)}")
                out += [f"  {k}" for k in compact_keys(keys)]
        if self.mismatched:
            out.append(f"shape mismatches: {len(self.mismatched)}")
            out += [f"  {k}: checkpoint {old} vs model {new}" for k, old, new in self.mismatched]
        out.append("OK: every tensor used" if self.ok else f"NOT LOADED CLEANLY: {self.problems()}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "origin": self.origin,
            "ok": self.ok,
            "matched": len(self.matched),
            "missing": self.missing,
            "unexpected": self.unexpected,
            "mismatched": [{"key": k, "checkpoint": list(a), "model": list(b)} for k, a, b in self.mismatched],
            "resampled": [
                {"key": k, "checkpoint": list(a), "model": list(b), "how": h} for k, a, b, h in self.resampled
            ],
            "dropped": self.dropped,
            "excluded": self.excluded,
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


# ------------------------------------------------------------------------------------------- loading
def _resample_table(key: str, value: Tensor, target: Tensor, model: nn.Module) -> tuple[Tensor, str] | None:
    """A learned position table for another square patch grid, resampled (bicubic) to the model's grid."""
    grid, prefix = getattr(model, "grid", None), getattr(model, "num_prefix", None)
    if key != "pos_embed" or grid is None or prefix is None or value.dim() != 3 or value.shape[-1] != target.shape[-1]:
        return None
    side = math.isqrt(max(value.shape[1] - prefix, 0))
    if side * side != value.shape[1] - prefix or target.shape[1] != prefix + grid[0] * grid[1]:
        return None
    how = f"bicubic, {side}x{side} -> {grid[0]}x{grid[1]} patch grid, {prefix} prefix row(s) kept"
    return resample_pos_embed(value.float(), tuple(grid), (side, side), prefix).to(value.dtype), how


def _fit_pegs(converted: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """CPVT: the J-th PEG of the checkpoint goes to the model's J-th PEG in block order."""
    pegs = getattr(model, "pegs", None)
    ckpt = sorted({int(m[1]) for k in converted if (m := re.match(r"^pegs\.(-?\d+)\.", k))})
    if not isinstance(pegs, nn.ModuleDict) or len(pegs) != len(ckpt):
        return converted
    where = dict(zip(ckpt, sorted(pegs.keys(), key=int)))
    return {re.sub(r"^pegs\.(-?\d+)\.", lambda m: f"pegs.{where[int(m[1])]}.", k): v for k, v in converted.items()}


def match_state(
    model: nn.Module, converted: Mapping[str, Tensor], report: LoadReport, exclude: Iterable[str] = ()
) -> dict[str, Tensor]:
    """Compare converted tensors with ``model.state_dict()``; fill ``report``; return what fits (resampled)."""
    target = model.state_dict()
    excl = [re.compile(p) for p in exclude]
    fits: dict[str, Tensor] = {}
    for key, value in converted.items():
        if any(rx.search(key) for rx in excl):
            report.excluded.append(key)
        elif key not in target:
            report.unexpected.append(key)
        elif value.shape == target[key].shape:
            fits[key] = value
        elif (res := _resample_table(key, value, target[key], model)) is not None:
            fits[key] = res[0]
            report.resampled.append((key, tuple(value.shape), tuple(target[key].shape), res[1]))
        else:
            report.mismatched.append((key, tuple(value.shape), tuple(target[key].shape)))
    report.matched = list(fits)
    report.missing = [k for k in target if k not in converted and not any(rx.search(k) for rx in excl)]
    return fits


def load_reference(
    model: nn.Module,
    path_or_state: PathOrState,
    source: str = "auto",
    strict: bool = True,
    nested_key: str | None = None,
) -> LoadReport:
    """Load a checkpoint of the official code or timm into a vitlab ``model`` by key mapping.

    Args:
        model: the vitlab model, built with the checkpoint's configuration.
        path_or_state: a checkpoint file (``.pth``/``.pt``/``.bin`` via ``torch.load(weights_only=True)``,
            or ``.safetensors``) or an already loaded dict.
        source: one of :data:`~vitlab.interop.keymaps.SOURCES`, or ``"auto"`` (:func:`detect_source`).
        strict: raise ValueError unless every model tensor is filled and every checkpoint tensor is used
            (shapes checked). With ``strict=False`` whatever fits is loaded and the report says the rest.
        nested_key: the checkpoint entry holding the weights (default: the first of ``NESTED_KEYS``).

    Learned position tables made for another patch grid are resampled bicubically (reported). Tensors the
    reference never uses (TNT's ``outer_tokens``, EAMLP's fixed sinusoid) and Refined-ViT's token-labelling
    ``aux_head`` when the model has none are dropped and reported. Returns the :class:`LoadReport`.
    """
    state, origin = _as_state(path_or_state, nested_key)
    source = detect_source(state) if source == "auto" else check_source(source)
    converted, dropped, notes = convert_state(state, source)
    report = LoadReport(source, origin, dropped=dropped, notes=notes)
    if source == "refiner" and getattr(model, "aux_head", None) is None:
        for key in [k for k in converted if k.startswith("aux_head.")]:
            converted.pop(key)
            report.dropped[key] = (
                "token-labelling aux head; the model has none (build it with aux_head=True to keep it)"
            )
    if source == "cpvt":
        converted = _fit_pegs(converted, model)
    fits = match_state(model, converted, report)
    if strict and not report.ok:
        raise ValueError(
            f"checkpoint {origin} does not fit {type(model).__name__} (source {source}): "
            f"{report.problems()}\n" + "\n".join(report.lines())
        )
    with torch.no_grad():
        model.load_state_dict(fits, strict=False)  # copy_ casts dtypes (e.g. a float num_batches_tracked)
    return report


# ------------------------------------------------------------------------------------------- safetensors
def save_weights(
    model_or_state: nn.Module | Mapping[str, Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write a state_dict as safetensors, atomically (:func:`vitlab.common.io.write_safetensors_atomic`)."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else dict(model_or_state)
    return write_safetensors_atomic(state, path, metadata)


def load_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a safetensors file (or any checkpoint :func:`read_checkpoint` accepts) into a state_dict."""
    return read_checkpoint(path)
