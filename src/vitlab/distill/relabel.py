"""Relabelling (``vitlab relabel``): dense token-label maps for an image folder from a teacher (LV-ViT's relabelling).

For every image the teacher sees the *whole* image (resized, not cropped, to its input size) and gives a score
vector per location: a vitlab model per patch token (its token-labelling head where it has one, else its
classifier applied to every patch token), an exported program or TorchScript file whatever dense output it
returns, ``(B, N, C)`` tokens on a square grid or ``(B, C, H, W)`` maps (e.g. a CNN without its global pool).
The scores are turned into probabilities (softmax over the classes) and the top ``k`` kept:
``float16 (2, k, Hm, Wm)``, scores then class indices, written as ``<image name>.tl.npy`` beside the image
(``a.JPEG.tl.npy``: two images never share a map) or under ``--out`` in the same layout: the format the loader
crops with each image's box (:mod:`vitlab.data.tokenlabel`). The images are the ones training reads (regular
files of the class folders); one that cannot be decoded is skipped, warned and counted, as training does.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..common.device import resolve_device
from .teacher import DEFAULT_TIMEOUT_S, Teacher, load_teacher


class DenseTeacher(nn.Module):
    """A vitlab classifier's per-patch scores ``(B, C, gh, gw)``: its token-labelling head, else its head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.model.forward_features(x)[:, self.model.num_prefix :]
        head = self.model.aux_head if getattr(self.model, "aux_head", None) is not None else self.model.head
        gh, gw = self.model.patch_embed.grid_size(tuple(x.shape[-2:]))
        return head(tokens).transpose(1, 2).reshape(len(x), -1, gh, gw)


def dense_scores(out: Tensor) -> Tensor:
    """A teacher's dense output as ``(B, C, Hm, Wm)``: maps as they are, tokens on their square grid."""
    if out.dim() == 4:
        return out
    if out.dim() == 3 and math.isqrt(out.shape[1]) ** 2 == out.shape[1]:
        side = math.isqrt(out.shape[1])
        return out.transpose(1, 2).reshape(len(out), -1, side, side)
    raise ValueError(
        f"the teacher returns {tuple(out.shape)}: relabelling needs dense scores, (B, N, C) tokens on a square grid "
        "or (B, C, H, W) maps (export the model without its global pooling)"
    )


def top_k_maps(scores: Tensor, k: int) -> np.ndarray:
    """``(B, C, Hm, Wm)`` scores -> ``float16 (B, 2, k, Hm, Wm)``: the top-k probabilities and their classes."""
    if k > scores.shape[1]:
        raise ValueError(f"--top-k {k}: the teacher has only {scores.shape[1]} classes")
    values, classes = scores.float().softmax(1).topk(k, dim=1)
    return torch.stack([values, classes.float()], 1).to(torch.float16).numpy()


def load_dense_teacher(
    path: str, img_size: int | None, device: torch.device, timeout: float | None = DEFAULT_TIMEOUT_S
) -> tuple[Teacher, tuple[int, int]]:
    """The teacher of ``path`` giving per-location scores, and the input size it takes."""
    teacher = load_teacher(path, device, img_size, timeout)
    if teacher.num_classes is not None:  # a vitlab model: per patch token
        teacher.model = DenseTeacher(teacher.model)
    if teacher.input_size is None:
        raise ValueError(f"{path} does not say its input size: pass --img-size")
    return teacher, teacher.input_size


def image_files(folder: Path) -> list[Path]:
    """Every image of ``folder`` as training reads it, from the data factory's folder source: the train/ and
    val/ (or test/) splits of an ImageNet layout, else the whole folder of class subfolders."""
    from ..data import DataSpec, open_source

    spec = DataSpec("folder", str(folder))
    if not (folder / "train").is_dir():
        splits = ["all"]
    else:
        splits = ["train"] + (["val"] if any((folder / s).is_dir() for s in ("val", "test")) else [])
    sources = [open_source(spec, split) for split in splits]
    return [src.path(i) for src in sources for i in range(len(src))]


def relabel(teacher_path: str, folder: str | Path, top_k: int = 5, img_size: int | None = None,
            out: str | Path | None = None, batch_size: int = 64, device: str = "auto",
            timeout: float | None = DEFAULT_TIMEOUT_S) -> tuple[int, list[str]]:  # fmt: skip
    """Write the dense maps of every image of ``folder``; returns how many were written and the unreadable
    images skipped (each also warned). ``timeout``: the seconds the teacher's first call may take (see
    :mod:`vitlab.distill.teacher`)."""
    from ..common.io import atomic_open
    from ..data import create_transform
    from ..data.decode import UnreadableImage
    from ..data.sources import dense_file

    folder, dev = Path(folder).expanduser(), resolve_device(device)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    teacher, size = load_dense_teacher(teacher_path, img_size, dev, timeout)
    tf = create_transform(size, crop_mode="squash", crop_pct=1.0)  # the whole image: the map covers all of it
    files, written, skipped = image_files(folder), 0, []
    for start in range(0, len(files), batch_size):
        images, targets = [], []
        for f in files[start : start + batch_size]:
            try:
                images.append(tf(f))
            except UnreadableImage as e:
                skipped.append(str(e))
                warnings.warn(f"unreadable image skipped ({len(skipped)} so far): {e}", stacklevel=2)
                continue
            targets.append(dense_file(Path(out) / f.relative_to(folder) if out else f))
        if not images:
            continue
        teacher.check_channels(images[0].shape[0])  # before the teacher sees a batch
        maps = top_k_maps(dense_scores(teacher.predict(torch.stack(images).to(dev))).cpu(), top_k)
        for target, m in zip(targets, maps):  # predict chunks as the teacher's batch allows
            target.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(target, "wb") as fh:
                np.save(fh, m, allow_pickle=False)
        written += len(targets)
    return written, skipped
