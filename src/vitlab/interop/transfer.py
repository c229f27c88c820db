"""Initialise a model from another model's checkpoint: fine-tuning starts and AFT's weight transfer.

AFT paper §6.3.2.3 / Table 8 fine-tunes AFT-conv from DeiT-B: every DeiT weight
is copied **except the position embedding, the class token, and the key and
query projections**; those (and AFT's own position biases) keep their
initialisation. In vitlab the attention ``qkv`` Linear (rows ``[q | k | v]``)
meets AFT's fused ``qkv`` (rows ``[Q | K | V]``, K one channel per head in
AFT-conv): only the value rows are copied.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..mixers import AFTConv, AFTFull, AFTSimple
from .convert import LoadReport, PathOrState, _as_state, detect_source, match_state
from .keymaps import check_source, convert_state

#: what AFT §6.3.2.3 does not take from DeiT (and DeiT's distillation token and head, which AFT has no use for)
DEIT_TO_AFT_EXCLUDE = (r"^pos_embed$", r"^cls_token$", r"^dist_token$", r"^head_dist\.")
AFT_MIXERS = (AFTConv, AFTFull, AFTSimple)


def _convert(path_or_state: PathOrState, source: str, nested_key: str | None) -> tuple[dict[str, Tensor], LoadReport]:
    state, origin = _as_state(path_or_state, nested_key)
    source = detect_source(state) if source == "auto" else check_source(source)
    converted, dropped, notes = convert_state(state, source)
    return converted, LoadReport(source, origin, dropped=dropped, notes=notes)


def _aft_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """``{"blocks.i.mixer": mixer}`` for every AFT mixer of the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, AFT_MIXERS)}


def init_from(
    model: nn.Module,
    path_or_state: PathOrState,
    source: str = "auto",
    exclude: Iterable[str] = (),
    nested_key: str | None = None,
) -> LoadReport:
    """Initialise ``model`` from a checkpoint, keeping its own initialisation where nothing fits (``--init-from``).

    Every checkpoint tensor (converted from ``source``'s names) whose name and shape fit is copied, except
    keys matching a regex in ``exclude``; position tables for another grid are resampled; tensors of
    another shape (a head for another number of classes) are skipped. When the model has AFT mixers and the
    checkpoint has attention blocks, this is :func:`transfer_deit_to_aftconv` (AFT §6.3.2.3).
    Never raises for what does not fit: the returned report lists it.
    """
    converted, report = _convert(path_or_state, source, nested_key)
    if _aft_blocks(model) and any(re.match(r"^blocks\.\d+\.mixer\.qkv\.", k) for k in converted):
        return _transfer(model, converted, report, (*DEIT_TO_AFT_EXCLUDE, *exclude))
    fits = match_state(model, converted, report, exclude)
    with torch.no_grad():
        model.load_state_dict(fits, strict=False)
    return report


def transfer_deit_to_aftconv(
    model: nn.Module, path_or_state: PathOrState, source: str = "auto", nested_key: str | None = None
) -> LoadReport:
    """AFT §6.3.2.3 (Table 8 "AFT-conv ft"): initialise an AFT model from a DeiT/ViT checkpoint.

    Copied: patch embedding, LayerNorms, MLPs, the attention output projection (``proj``), the value
    rows of ``qkv``, the final norm and the head (when its shape fits). Not copied: the position embedding,
    the class token, the query and key projections (AFT's Q and K rows keep their initialisation) and
    DeiT's distillation token/head. AFT's position biases (``w``, ``gamma``, ``beta``, ``u``, ``v``) are
    new. Works for AFT-conv, AFT-full/local and AFT-simple blocks (their V rows come last in ``qkv``).
    Raises ValueError if the model has no AFT mixer or an AFT block meets no attention ``qkv`` of its width.
    """
    if not _aft_blocks(model):
        raise ValueError(f"transfer_deit_to_aftconv needs a model with AFT mixers; {type(model).__name__} has none")
    converted, report = _convert(path_or_state, source, nested_key)
    return _transfer(model, converted, report, DEIT_TO_AFT_EXCLUDE)


def _transfer(model: nn.Module, converted: dict[str, Tensor], report: LoadReport, exclude: Iterable[str]) -> LoadReport:
    aft = _aft_blocks(model)
    target = model.state_dict()
    value_rows: dict[str, Tensor] = {}
    for prefix, mixer in aft.items():
        width = mixer.proj.in_features  # V's width: the input of the output projection
        for leaf in ("weight", "bias"):
            src_key, dst_key = f"{prefix}.qkv.{leaf}", f"{prefix}.qkv.{leaf}"
            if dst_key not in target:
                continue
            src = converted.pop(src_key, None)
            if src is None or src.shape[0] != 3 * width or src.shape[1:] != target[dst_key].shape[1:]:
                got = "nothing" if src is None else f"shape {tuple(src.shape)}"
                raise ValueError(
                    f"{dst_key}: expected the checkpoint's attention qkv of shape {(3 * width, *target[dst_key].shape[1:])} "
                    f"(rows [q | k | v]) to take its value rows from, got {got}"
                )
            rows = target[dst_key].clone()
            rows[-width:] = src[2 * width :]  # DeiT's v rows -> AFT's V rows; Q and K rows keep their init
            value_rows[dst_key] = rows
        report.notes.append(
            f"{prefix}.qkv: value rows copied from the attention qkv; query and key rows "
            f"(AFT's Q, K) keep their initialisation"
        )
    fits = match_state(model, converted, report, exclude)
    fits.update(value_rows)
    report.matched += list(value_rows)
    report.missing = [k for k in report.missing if k not in value_rows]
    with torch.no_grad():
        model.load_state_dict(fits, strict=False)
    return report
