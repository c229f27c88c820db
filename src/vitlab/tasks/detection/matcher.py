"""DETR's bipartite matching of predictions to ground truth (Carion et al. 2020, Sec. 3.1, eq. 1).

N query predictions ``(p̂_i, b̂_i)`` (class probabilities over C + 1 classes, the last "no object"; a
normalised cxcywh box) are matched one-to-one to an image's M <= N targets ``(c_j, b_j)`` by the permutation of
least total cost, found by the Hungarian algorithm::

    σ̂      = argmin_σ Σ_j C(j, σ(j))
    C(j, i) = λ_cls · (-p̂_i(c_j)) + λ_L1 · ||b_j - b̂_i||_1 + λ_giou · (-GIoU(b_j, b̂_i))

with DETR's λ_cls, λ_L1, λ_giou = 1, 5, 2. The class term is minus the probability (not its log, as in the
loss): the paper's choice, which puts it on the scale of the box terms. The unmatched N - M queries are the
"no object" predictions of the loss.

The costs of all B·N predictions against all of the batch's targets are one matrix computed on the device,
moved to the host once; each image's block (its queries against its own targets) is then solved by
``scipy.optimize.linear_sum_assignment``.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from .box_ops import cxcywh_to_xyxy, generalized_box_iou


class HungarianMatcher:
    """The matching of the module docstring with cost weights ``cost_class``, ``cost_bbox`` (L1) and
    ``cost_giou``. Called on ``logits`` ``(B, N, C + 1)``, ``boxes`` ``(B, N, 4)`` (normalised cxcywh) and
    ``targets`` (per image ``labels`` ``(M,)`` and ``boxes`` ``(M, 4)`` normalised cxcywh), it returns per image
    ``(query indices, target indices)``, two long tensors on the CPU, sorted by query, of length M (min(N, M)
    when an image has more targets than there are queries: the extra targets go unmatched)."""

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0) -> None:
        if min(cost_class, cost_bbox, cost_giou) < 0 or max(cost_class, cost_bbox, cost_giou) == 0:
            raise ValueError(f"matcher costs must be >= 0 and not all 0, got {cost_class}, {cost_bbox}, {cost_giou}")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def cost(self, logits: Tensor, boxes: Tensor, labels: Tensor, target_boxes: Tensor) -> Tensor:
        """C of every prediction ``(P, C + 1)`` / ``(P, 4)`` against every target ``(M,)`` / ``(M, 4)``:
        ``(P, M)`` (module docstring)."""
        prob = logits.float().softmax(-1)
        boxes, target_boxes = boxes.float(), target_boxes.float()
        return (
            -self.cost_class * prob[:, labels]
            + self.cost_bbox * torch.cdist(boxes, target_boxes, p=1)
            - self.cost_giou * generalized_box_iou(cxcywh_to_xyxy(boxes), cxcywh_to_xyxy(target_boxes))
        )

    @torch.no_grad()
    def __call__(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        B, N = logits.shape[:2]
        sizes = [len(t["labels"]) for t in targets]
        labels = torch.cat([t["labels"] for t in targets])
        target_boxes = torch.cat([t["boxes"] for t in targets])
        cost = self.cost(logits.flatten(0, 1), boxes.flatten(0, 1), labels, target_boxes)
        cost = cost.view(B, N, len(labels)).cpu()  # the one host transfer
        if not torch.isfinite(cost).all():
            raise ValueError("matching: the predictions hold NaN or inf (training diverged); lower the learning rate")
        blocks = cost.split(sizes, -1)
        out = []
        for i, block in enumerate(blocks):
            q, t = linear_sum_assignment(block[i].numpy())  # image i's queries against its own targets only
            out.append((torch.as_tensor(q, dtype=torch.long), torch.as_tensor(t, dtype=torch.long)))
        return out


__all__ = ["HungarianMatcher"]
