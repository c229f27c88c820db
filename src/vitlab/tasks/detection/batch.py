"""What flows between the detection data, the detectors and the engine: a padded image batch with its padding
mask and the per-image targets, and the contract every detector keeps.

Targets (one dict per image), in the pixels of the image after resizing, before padding:

- ``boxes``: float ``(n, 4)``, ``x0, y0, x1, y1``;
- ``labels``: long ``(n,)``, contiguous class indices ``0 .. C-1`` (the dataset maps COCO's category ids);
- ``masks``: uint8 ``(n, h, w)`` instance masks at the resized size (only when the data have masks);
- ``image_id``: long scalar, the COCO image id; ``size``: ``(h, w)`` after resizing; ``orig_size``: ``(h, w)``
  of the file. Crowd annotations are left out of training targets (DETR and torchvision do the same); the
  evaluator reads them from the annotation file.

A detector is an ``nn.Module`` with

- ``forward(batch: DetBatch) -> dict``: its raw outputs (training or evaluation);
- ``loss(batch, outputs) -> (total, parts)``: the scalar it trains on and its named terms (detached floats);
- ``predict(batch, outputs) -> list[dict]``: per image ``boxes`` (xyxy in the pixels of the original file),
  ``scores``, ``labels`` (contiguous indices) and, for an instance-segmentation model, ``masks`` (float
  probabilities ``(n, H, W)`` at the original size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DetBatch:
    """``images`` ``(B, 3, H, W)`` normalised and zero-padded at the bottom and right to the batch's largest image;
    ``padding`` ``(B, H, W)`` True on padded pixels (DETR's mask); ``targets`` one dict per image (module doc)."""

    images: Tensor
    padding: Tensor
    targets: list[dict[str, Tensor]]

    def __len__(self) -> int:
        return len(self.images)

    def to(self, device: torch.device | str) -> DetBatch:
        moved = [{k: v.to(device) for k, v in t.items()} for t in self.targets]
        return DetBatch(self.images.to(device), self.padding.to(device), moved)

    def image_size(self, i: int) -> tuple[int, int]:
        """Image ``i``'s ``(h, w)`` after resizing, before padding: its target's ``size``, else read off the
        padding."""
        t = self.targets[i]
        if "size" in t:
            h, w = (int(v) for v in t["size"])
            return h, w
        valid = ~self.padding[i]
        return int(valid.any(1).sum()), int(valid.any(0).sum())
