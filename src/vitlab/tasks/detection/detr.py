"""DETR (Carion et al. 2020, End-to-End Object Detection with Transformers) over any vitlab backbone, its position
encoding a switch (:mod:`.position`: DETR's sine, learned, CPVT's PEG, none).

The network (the paper's Sec. 3.2 and Fig. 10)::

    f      = Conv_1x1(backbone(x)[-1])            the backbone's last, coarsest map to d channels: C5 at stride
                                                  32 for a ResNet, the last block at the patch stride for a
                                                  plain ViT (its final norm applied), (B, d, H, W)
    m      = nearest(padding, H x W)              the padding mask at the map's size
    p      = PE(m)                                "sine" / "learned" (.position); nothing for "peg" / "none"
    z_l    = LN(z' + FFN(z')),                    encoder layer l = 1..L_e, post-norm, over z_0 = flatten(f);
    z'     = LN(z + Attn(z + p, z + p, z; m))     padded keys masked out. pos="peg": z_1 <- PEG(z_1, m)
    q_l    = LN(q'' + FFN(q''))                   decoder layer l = 1..L_d from q_0 = 0; e the N learned query
    q''    = LN(q' + Attn(q' + e, z + p, z; m))   embeddings ("object queries"), z = z_{L_e} (the memory);
    q'     = LN(q + Attn(q + e, q + e, q))        every layer's output normed by one shared LN: o_l = LN(q_l)
    logits_l = Linear(o_l)  (C + 1 classes, the last "no object")
    boxes_l  = σ(MLP_3(o_l))  (cx, cy, w, h) normalised by the unpadded image's size (target "size")

The batch is first zero-padded further, at the bottom and right, to a multiple of 32 and of the backbone's
strides (:func:`.fpn.size_divisible`: a ViT's patch grid, PCPVT's spatial reduction), those pixels marked as
padding too.

The set loss (Sec. 3.1, eqs. 1-2; DETR's ``SetCriterion``), for each decoder layer l with its own matching σ̂_l
(:mod:`.matcher`), summed over the layers (the auxiliary losses)::

    L_l = λ_ce · CE_w(logits_l, c)                c_i = c_j if σ̂_l(j) = i, else "no object"; w = (1, ..., 1,
                                                  eos_coef): a weighted mean over every query, eos_coef = 0.1
        + Σ_j [λ_L1 ||b_j - b̂_σ̂(j)||_1 + λ_giou (1 - GIoU(b_j, b̂_σ̂(j)))] / max(1, M̄)
    M̄   = the targets in the batch, averaged over processes;  λ_ce, λ_L1, λ_giou = 1, 5, 2

``predict``: ``p = softmax(logits)`` without the "no object" column; each query's best class and its
probability; boxes to corners, times the original file's ``(w, h, w, h)``, clipped to it; every query kept,
best first (COCO's evaluation reads up to 100).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ...models import build_model
from ...models.base import FeatureGetter
from .batch import DetBatch
from .box_ops import cxcywh_to_xyxy, generalized_box_iou, xyxy_to_cxcywh
from .fpn import size_divisible, takes_dynamic_size
from .matcher import HungarianMatcher
from .position import POSITIONS, PEGDetection, build_position

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm)


def with_pos(x: Tensor, pos: Tensor | None) -> Tensor:
    return x if pos is None else x + pos


def feed_forward(d: int, hidden: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, d))


class Attention(nn.Module):
    """Multi-head attention ``softmax(Q K^T / sqrt(d_h)) V`` with separate query, key and value inputs (DETR adds
    the position to queries and keys only); ``pad`` ``(B, N_k)`` True on keys to ignore."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def split(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None = None) -> Tensor:
        mask = None if pad is None else ~pad[:, None, None]
        p = self.dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(
            self.split(self.to_q(q)), self.split(self.to_k(k)), self.split(self.to_v(v)), attn_mask=mask, dropout_p=p
        )
        return self.to_out(o.transpose(1, 2).flatten(2))


class EncoderLayer(nn.Module):
    """``z' = LN(z + Attn(z + p, z + p, z)); LN(z' + FFN(z'))`` (post-norm, module docstring)."""

    def __init__(self, d: int, heads: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.attn, self.ffn = Attention(d, heads, dropout), feed_forward(d, hidden, dropout)
        self.norm1, self.norm2, self.drop = nn.LayerNorm(d), nn.LayerNorm(d), nn.Dropout(dropout)

    def forward(self, z: Tensor, pos: Tensor | None, pad: Tensor) -> Tensor:
        qk = with_pos(z, pos)
        z = self.norm1(z + self.drop(self.attn(qk, qk, z, pad)))
        return self.norm2(z + self.drop(self.ffn(z)))


class DecoderLayer(nn.Module):
    """Self-attention among the queries, cross-attention to the memory, FFN; post-norm (module docstring)."""

    def __init__(self, d: int, heads: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.self_attn, self.cross_attn = Attention(d, heads, dropout), Attention(d, heads, dropout)
        self.ffn, self.drop = feed_forward(d, hidden, dropout), nn.Dropout(dropout)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, q: Tensor, memory: Tensor, query_pos: Tensor, pos: Tensor | None, pad: Tensor) -> Tensor:
        qk = q + query_pos
        q = self.norm1(q + self.drop(self.self_attn(qk, qk, q)))
        q = self.norm2(q + self.drop(self.cross_attn(q + query_pos, with_pos(memory, pos), memory, pad)))
        return self.norm3(q + self.drop(self.ffn(q)))


class Transformer(nn.Module):
    """DETR's encoder-decoder; with ``peg``, CPVT's PEG after encoder layer ``peg_layer`` (module docstring).
    ``forward(f (B, d, H, W), mask (B, H, W), pos (B, d, H, W) | None, query (N, d)) -> (L_d, B, N, d)``."""

    def __init__(self, d: int, heads: int, enc_layers: int, dec_layers: int, hidden: int, dropout: float,
                 peg: bool = False, peg_layer: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.encoder = nn.ModuleList(EncoderLayer(d, heads, hidden, dropout) for _ in range(enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(d, heads, hidden, dropout) for _ in range(dec_layers))
        self.norm = nn.LayerNorm(d)
        self.peg, self.peg_layer = (PEGDetection(d) if peg else None), peg_layer
        for p in self.parameters():  # DETR's initialisation of its transformer
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, f: Tensor, mask: Tensor, pos: Tensor | None, query: Tensor) -> Tensor:
        B, _, H, W = f.shape
        z, pad = f.flatten(2).transpose(1, 2), mask.flatten(1)
        pos = None if pos is None else pos.flatten(2).transpose(1, 2)
        for i, layer in enumerate(self.encoder):
            z = layer(z, pos, pad)
            if self.peg is not None and i == self.peg_layer:
                z = self.peg(z.transpose(1, 2).unflatten(2, (H, W)), mask).flatten(2).transpose(1, 2)
        e = query[None].expand(B, -1, -1)
        q, outs = torch.zeros_like(e), []
        for layer in self.decoder:
            q = layer(q, z, e, pos, pad)
            outs.append(self.norm(q))
        return torch.stack(outs)


class SetCriterion(nn.Module):
    """DETR's set loss (module docstring): ``forward(outputs, targets) -> (total, parts)`` with ``targets`` per
    image ``labels`` and ``boxes`` (normalised cxcywh); parts are the last layer's ``loss_ce``, ``loss_bbox``,
    ``loss_giou`` (unweighted) and ``class_error`` (percent of matched queries whose best class is wrong)."""

    def __init__(self, num_classes: int, matcher: HungarianMatcher, eos_coef: float = 0.1, ce_coef: float = 1.0,
                 bbox_coef: float = 5.0, giou_coef: float = 2.0) -> None:  # fmt: skip
        super().__init__()
        self.num_classes, self.matcher = num_classes, matcher
        self.coef = {"loss_ce": ce_coef, "loss_bbox": bbox_coef, "loss_giou": giou_coef}
        weight = torch.ones(num_classes + 1)
        weight[-1] = eos_coef  # "no object" is most queries' class: down-weighted against class imbalance
        self.register_buffer("class_weight", weight, persistent=False)

    def layer_terms(self, out: dict[str, Tensor], targets: list[dict[str, Tensor]], num: Tensor) -> dict[str, Tensor]:
        logits, boxes = out["pred_logits"].float(), out["pred_boxes"].float()
        match = self.matcher(logits, boxes, targets)
        dev = logits.device
        b = torch.cat([torch.full_like(q, i) for i, (q, _) in enumerate(match)]).to(dev)
        q = torch.cat([q for q, _ in match]).to(dev)
        labels = torch.cat([t["labels"][j.to(dev)] for t, (_, j) in zip(targets, match)])
        target_boxes = torch.cat([t["boxes"][j.to(dev)] for t, (_, j) in zip(targets, match)]).float()
        classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.long, device=dev)
        classes[b, q] = labels
        matched = boxes[b, q]
        giou = generalized_box_iou(cxcywh_to_xyxy(matched), cxcywh_to_xyxy(target_boxes)).diagonal()
        wrong = (logits[b, q].argmax(-1) != labels).float()
        return {
            "loss_ce": F.cross_entropy(logits.transpose(1, 2), classes, self.class_weight),
            "loss_bbox": F.l1_loss(matched, target_boxes, reduction="sum") / num,
            "loss_giou": (1 - giou).sum() / num,
            "class_error": 100 * wrong.mean() if len(wrong) else wrong.sum(),
        }

    def forward(self, outputs: dict[str, Any], targets: list[dict[str, Tensor]]) -> tuple[Tensor, dict[str, Any]]:
        dev = outputs["pred_logits"].device
        num = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=dev)
        if dist.is_available() and dist.is_initialized():  # every process divides by the same count
            dist.all_reduce(num)
            num = num / dist.get_world_size()
        num = num.clamp(min=1)
        total, last = torch.zeros((), device=dev), {}
        for i, out in enumerate([outputs, *outputs.get("aux_outputs", [])]):
            terms = self.layer_terms(out, targets, num)
            total = total + sum(c * terms[k] for k, c in self.coef.items())
            if i == 0:  # the final layer's terms are the ones reported
                last = terms
        return total, {k: v.detach() for k, v in last.items()}


class DETR(nn.Module):
    """DETR of ``num_classes`` classes over the registered model ``backbone`` (module docstring), keeping the
    detector contract of :mod:`.batch`. Sizes default to the paper's (d 256, 8 heads, 6 + 6 layers, FFN 2048,
    dropout 0.1, 100 queries); ``pos`` one of :data:`~.position.POSITIONS` (``peg_layer``: the encoder layer
    the PEG follows); ``aux_loss``: a loss on every decoder layer. ``cost_*``: the matcher's weights,
    ``*_coef``: the loss's. ``backbone_lr_scale``: the backbone's learning rate relative to the rest (DETR: 1e-5
    against 1e-4), read by the engine through :meth:`lr_scale_of`. ``frozen_bn``: the backbone's BatchNorm
    statistics and affine frozen (DETR's FrozenBatchNorm2d, for a pretrained backbone trained with small
    batches). Other keywords go to the backbone's constructor (``drop_path_rate``, ``output_stride``, ...)."""

    def __init__(self, backbone: str, num_classes: int, d_model: int = 256, nhead: int = 8, enc_layers: int = 6,
                 dec_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1, num_queries: int = 100,
                 pos: str = "sine", peg_layer: int = 0, aux_loss: bool = True, eos_coef: float = 0.1,
                 cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0, ce_coef: float = 1.0,
                 bbox_coef: float = 5.0, giou_coef: float = 2.0, backbone_lr_scale: float = 0.1,
                 frozen_bn: bool = False, **backbone_kwargs: Any) -> None:  # fmt: skip
        super().__init__()
        if num_classes < 1 or num_queries < 1 or dec_layers < 1 or enc_layers < 0:
            raise ValueError(
                f"DETR needs num_classes, num_queries, dec_layers >= 1 and enc_layers >= 0, got {num_classes}, "
                f"{num_queries}, {dec_layers}, {enc_layers}"
            )
        if d_model % nhead:
            raise ValueError(f"d_model {d_model} must be divisible by nhead {nhead}")
        if pos not in POSITIONS:
            raise ValueError(f"pos must be one of {', '.join(POSITIONS)}, got {pos!r}")
        if pos == "peg" and not 0 <= peg_layer < enc_layers:
            raise ValueError(f"peg_layer must name one of the {enc_layers} encoder layers (0 = after the first)")
        if not 0 < eos_coef <= 1 or backbone_lr_scale < 0 or not 0 <= dropout < 1:
            raise ValueError(f"need 0 < eos_coef <= 1, backbone_lr_scale >= 0, 0 <= dropout < 1, got {eos_coef}, "
                             f"{backbone_lr_scale}, {dropout}")  # fmt: skip
        if "dynamic_img_size" not in backbone_kwargs and takes_dynamic_size(backbone):
            backbone_kwargs["dynamic_img_size"] = True  # the images differ in size from batch to batch
        net = build_model(backbone, **backbone_kwargs)
        self.size_divisible = size_divisible([int(f["reduction"]) for f in net.feature_info])
        self.backbone = FeatureGetter(net, [len(net.feature_info) - 1], norm=True)
        self.input_proj = nn.Conv2d(int(self.backbone.feature_info[-1]["num_chs"]), d_model, 1)
        self.position = build_position(pos, d_model)
        self.transformer = Transformer(d_model, nhead, enc_layers, dec_layers, dim_feedforward, dropout,
                                       peg=pos == "peg", peg_layer=peg_layer)  # fmt: skip
        self.query = nn.Embedding(num_queries, d_model)
        self.class_head = nn.Linear(d_model, num_classes + 1)
        self.box_head = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, d_model), nn.ReLU(),
                                      nn.Linear(d_model, 4))  # fmt: skip
        matcher = HungarianMatcher(cost_class, cost_bbox, cost_giou)
        self.criterion = SetCriterion(num_classes, matcher, eos_coef, ce_coef, bbox_coef, giou_coef)
        self.num_classes, self.num_queries, self.pos, self.aux_loss = num_classes, num_queries, pos, aux_loss
        self.backbone_lr_scale, self.frozen_bn, self.backbone_name = backbone_lr_scale, frozen_bn, backbone
        if frozen_bn:
            for m in self.backbone.modules():
                if isinstance(m, BATCH_NORMS):
                    m.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> DETR:
        super().train(mode)
        if self.frozen_bn:  # running statistics used and never updated, as DETR's FrozenBatchNorm2d
            for m in self.backbone.modules():
                if isinstance(m, BATCH_NORMS):
                    m.eval()
        return self

    def forward(self, batch: DetBatch) -> dict[str, Any]:
        """``pred_logits`` ``(B, N, C + 1)``, ``pred_boxes`` ``(B, N, 4)`` (the last decoder layer) and, with
        ``aux_loss``, ``aux_outputs``: the same for every earlier layer."""
        x, pad = batch.images, batch.padding
        ph, pw = (-s % self.size_divisible for s in x.shape[-2:])
        if ph or pw:  # the backbone's strides must divide the input: more padding, marked as such
            x, pad = F.pad(x, (0, pw, 0, ph)), F.pad(pad, (0, pw, 0, ph), value=True)
        f = self.input_proj(self.backbone(x)[-1])
        mask = F.interpolate(pad[:, None].float(), f.shape[-2:]).bool()[:, 0]
        pos = None if self.position is None else self.position(mask).to(f.dtype)
        hs = self.transformer(f, mask, pos, self.query.weight)
        logits, boxes = self.class_head(hs), self.box_head(hs).sigmoid()
        out: dict[str, Any] = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        if self.aux_loss:
            out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])]
        return out

    def normalised_targets(self, batch: DetBatch) -> list[dict[str, Tensor]]:
        """The targets' boxes as cxcywh over their image's unpadded ``(w, h, w, h)``, the regression target."""
        out = []
        for i, t in enumerate(batch.targets):
            h, w = batch.image_size(i)
            scale = torch.tensor([w, h, w, h], dtype=torch.float32, device=t["boxes"].device)
            out.append({"labels": t["labels"], "boxes": xyxy_to_cxcywh(t["boxes"].float()) / scale})
        return out

    def loss(self, batch: DetBatch, outputs: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """The set loss summed over the decoder layers, and the last layer's terms (module docstring)."""
        return self.criterion(outputs, self.normalised_targets(batch))

    @torch.no_grad()
    def predict(self, batch: DetBatch, outputs: dict[str, Any]) -> list[dict[str, Tensor]]:
        """Per image ``boxes`` (xyxy in the original file's pixels), ``scores``, ``labels``: every query, best
        first (module docstring)."""
        scores, labels = outputs["pred_logits"].float().softmax(-1)[..., :-1].max(-1)
        boxes = cxcywh_to_xyxy(outputs["pred_boxes"].float())
        results = []
        for i, t in enumerate(batch.targets):
            h, w = (float(v) for v in t["orig_size"])
            b = boxes[i] * torch.tensor([w, h, w, h], device=boxes.device)
            b = torch.stack([b[:, 0].clamp(0, w), b[:, 1].clamp(0, h), b[:, 2].clamp(0, w), b[:, 3].clamp(0, h)], 1)
            order = scores[i].argsort(descending=True)
            results.append({"boxes": b[order], "scores": scores[i][order], "labels": labels[i][order]})
        return results

    def lr_scale_of(self, name: str) -> float:
        """The learning-rate factor of parameter ``name`` (the engine's :func:`~vitlab.engine.optim.param_groups`
        hook): ``backbone_lr_scale`` for the backbone's, 1 for the rest."""
        return self.backbone_lr_scale if name.startswith("backbone.") else 1.0

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    def init_target(self) -> nn.Module:
        """What ``--init-from`` initialises: the backbone's classifier (a pretrained ResNet-50 for DETR)."""
        return self.backbone.model

    def no_weight_decay(self) -> set[str]:
        inner = getattr(self.backbone.model, "no_weight_decay", lambda: set())()
        return {f"backbone.model.{n}" for n in inner}


__all__ = ["DETR", "Attention", "DecoderLayer", "EncoderLayer", "SetCriterion", "Transformer"]
