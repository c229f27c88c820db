"""What vitlab's convolutional baselines share (ResNet, RegNetY, EfficientNet): timm's model contract for a CNN
whose **stages** are its blocks, on top of :class:`~vitlab.models.base.Classifier`.

A CNN's stages end at widths and strides of their own, like the stages of the PCPVT pyramid; the contract is
the pyramid's, so every tool that takes a vitlab model takes a CNN:

* ``blocks`` are the stages: ``feature_info`` (one entry per stage: width, stride, module),
  ``forward_intermediates`` (each stage's ``(B, C, H, W)`` map), ``features_only`` (the C2..C5 pyramid of a
  ResNet, what a segmentation or detection head reads), ``prune_intermediate_layers``, the units of FSDP;
  ``group_matcher`` gives the stem, then one group per residual block (``coarse``: per stage), then the head;
* ``forward_features`` returns the last map as tokens ``(B, H·W, C)``, as every vitlab classifier does (timm's
  CNNs return the map itself: ``forward_intermediates(x, 1)`` gives it), and the head pools them with timm's
  pools (``avg``, ``max``, ``avgmax``; ``''`` keeps every position);
* ``forward_trace`` (what ``vitlab analyze`` reads) lists every residual block's output as tokens, so that a
  CNN's feature evolution (how much consecutive blocks of one shape change the features) stands beside a
  ViT's; there are no attention maps, and the analyses that need them say so;
* the input size is only a default: a CNN runs at any size (``grid`` is the last map's size at ``img_size``,
  ``ceil(img_size / reduction)`` for the ``k // 2`` paddings used throughout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.recompute import recompute_active, recomputed
from ..mixers.base import TokenLayout
from .base import OUTPUT_FORMATS, Classifier, FeatureInfo, check_pool, feature_take_indices

OUTPUT_STRIDES = (8, 16, 32)


def as_pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def stage_plan(strides: Sequence[int], stem_stride: int, output_stride: int = 32) -> list[tuple[int, int, int]]:
    """``(stride, first_dilation, dilation)`` of each stage for a network whose stem reduces ``stem_stride``
    times: a stage whose stride would take the network past ``output_stride`` keeps the resolution and
    dilates its 3x3 convolutions by the stride instead (DeepLab's atrous ResNet, as EANet's backbone and
    torchvision's ``replace_stride_with_dilation``); its first block still sees the previous dilation."""
    if output_stride not in OUTPUT_STRIDES:
        raise ValueError(f"output_stride must be one of {', '.join(map(str, OUTPUT_STRIDES))}, got {output_stride}")
    net, dilation, plan = stem_stride, 1, []
    for stride in strides:
        first = dilation
        if net * stride > output_stride:
            dilation, stride = dilation * stride, 1
        else:
            net *= stride
        plan.append((stride, first, dilation))
    return plan


def conv_bn(cin: int, cout: int, kernel: int = 1, stride: int = 1, dilation: int = 1, groups: int = 1,
            eps: float = 1e-5, momentum: float = 0.1) -> tuple[nn.Conv2d, nn.BatchNorm2d]:  # fmt: skip
    """A bias-free ``kernel x kernel`` convolution padded to keep ``ceil(size / stride)`` and its BatchNorm."""
    pad = dilation * (kernel - 1) // 2
    conv = nn.Conv2d(cin, cout, kernel, stride, pad, dilation=dilation, groups=groups, bias=False)
    return conv, nn.BatchNorm2d(cout, eps=eps, momentum=momentum)


def tokens(x: Tensor) -> Tensor:
    """A ``(B, C, H, W)`` map as row-major tokens ``(B, H·W, C)``."""
    return x.flatten(2).transpose(1, 2)


class ConvClassifier(Classifier):
    """The contract of a CNN classifier whose stages are its blocks (module docstring).

    A subclass builds its stem (:meth:`forward_stem`), its stages (``blocks``: an ``nn.ModuleList`` whose entry i
    is an ``nn.ModuleList`` of stage i's residual blocks, the module ``stage_names[i]``: each residual block is
    called on its own, so FSDP's units are the residual blocks), optionally layers after the last stage
    (:meth:`forward_final`, :meth:`_prune_final`) and its classifier (the module ``CLASSIFIER``, called by
    :meth:`classify`), and calls :meth:`_setup` with what it built.
    """

    CLASSIFIER = "fc"
    # TorchScript types a module's attributes from the nearest class annotations, which it cannot read as the
    # strings they are here (``from __future__ import annotations``): the ones forward reads, as types
    __annotations__ = {"global_pool": str, "drop_rate": float, "num_classes": int}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # TorchScript compiles every property unless told not to: only forward's path is scripted
        cls.__jit_unused_properties__ = sorted(
            {n for c in cls.__mro__ for n, v in vars(c).items() if isinstance(v, property)}
        )

    def _setup(
        self,
        img_size: int | Sequence[int],
        in_chans: int,
        num_classes: int,
        global_pool: str,
        drop_rate: float,
        stages: Sequence[tuple[str, int, int, int]],
        num_features: int,
    ) -> None:
        """Record the contract's facts: ``stages`` = ``(module name, width, stride from the image, blocks)`` per
        stage; ``num_features`` = the width the head sees; then build the head."""
        if num_classes < 0 or in_chans < 1:
            raise ValueError(f"num_classes must be >= 0 and in_chans >= 1, got {num_classes}, {in_chans}")
        if not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
        self.global_pool = check_pool(global_pool, has_class_token=False)
        self.num_classes, self.drop_rate, self.num_prefix = num_classes, float(drop_rate), 0
        self.stage_names = [s[0] for s in stages]
        self.stage_channels = [int(s[1]) for s in stages]
        self.stage_reductions = [int(s[2]) for s in stages]
        self.depths = tuple(int(s[3]) for s in stages)
        self.embed_dim = int(num_features)
        self._in_chans = int(in_chans)
        self._set_img_size(as_pair(img_size))
        self._set_classifier(self.new_head(num_classes))

    # ------------------------------------------------------------------------------- what subclasses give
    def forward_stem(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward_final(self, x: Tensor) -> Tensor:
        """The layers after the last stage (EfficientNet's 1x1 head convolution); none by default."""
        return x

    def forward_scripted(self, x: Tensor) -> Tensor:
        """Stem and stages as TorchScript compiles them: loops over module lists only, which it unrolls (the
        ``blocks`` list is built on the fly, out of its reach)."""
        raise NotImplementedError

    def classify(self, x: Tensor) -> Tensor:
        return self.get_submodule(self.CLASSIFIER)(x)

    def _prune_final(self) -> None:
        """Remove the layers after the last stage (features_only)."""

    def _drop_stage(self, name: str) -> None:
        """Empty the stage module ``name`` (features_only keeps the stages up to the last one asked for)."""
        setattr(self, name, type(getattr(self, name))())

    # ------------------------------------------------------------------------------------ sizes and names
    @property
    def in_chans(self) -> int:
        return self._in_chans

    @property
    def img_size(self) -> tuple[int, int]:
        """The default input size (what ``pretrained_cfg`` describes); a CNN runs at any size."""
        return self._img_size

    @property
    def reduction(self) -> int:
        """Image pixels per position of the last map along a side (the output stride)."""
        return self.stage_reductions[-1]

    @property
    def feature_info(self) -> FeatureInfo:
        """One feature per stage (timm's CNN ``feature_info`` without its stem entry)."""
        return FeatureInfo(
            dict(num_chs=c, reduction=r, module=n)
            for n, c, r in zip(self.stage_names, self.stage_channels, self.stage_reductions)
        )

    def classifier_names(self) -> str:
        return self.CLASSIFIER

    def _set_img_size(self, size: tuple[int, int]) -> None:
        if min(size) < 1:
            raise ValueError(f"img_size must be positive, got {size}")
        self._img_size = size
        self.grid = (math.ceil(size[0] / self.reduction), math.ceil(size[1] / self.reduction))

    def no_weight_decay(self) -> set[str]:
        """None named: biases and BatchNorm scales are 1-D, which the optimizer never decays anyway."""
        return set()

    # ------------------------------------------------------------------------------------------- head
    def get_classifier(self) -> nn.Module:
        return self.get_submodule(self.CLASSIFIER)

    def _set_classifier(self, head: nn.Module) -> None:
        parent, _, name = self.CLASSIFIER.rpartition(".")
        setattr(self.get_submodule(parent) if parent else self, name, head)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            self.global_pool = check_pool(global_pool, has_class_token=False)
            self._record(global_pool=global_pool)
        self.num_classes = num_classes
        self._set_classifier(self.new_head(num_classes))
        self._record(num_classes=num_classes)

    def pool(self, x: Tensor) -> Tensor:
        """timm's pools of the ``(B, N, C)`` positions (TorchScript-friendly: no string truth values)."""
        if self.global_pool == "avg":
            return x.mean(1)
        if self.global_pool == "max":
            return x.amax(1)
        if self.global_pool == "avgmax":
            return 0.5 * (x.amax(1) + x.mean(1))
        return x

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool the tokens of ``forward_features``, dropout (``drop_rate``), then the classifier (timm's
        order: ``pre_logits`` are after the dropout)."""
        x = self.pool(x)
        if self.drop_rate > 0.0:
            x = F.dropout(x, self.drop_rate, self.training)
        return x if pre_logits else self.classify(x)

    # ---------------------------------------------------------------------------------------- forward
    def _run(self, x: Tensor, keep_blocks: bool = False, stop: int | None = None) -> dict[str, Any]:
        """Stem, then the stages up to ``stop``: ``{"last": the last map, "stages": each stage's map,
        "blocks": every residual block's map (with keep_blocks)}``. With gradient checkpointing each residual
        block is recomputed in backward (:mod:`vitlab.layers.recompute`: BatchNorm statistics updated once)."""
        x = self.forward_stem(x)
        ckpt = recompute_active(self.grad_checkpointing)
        stages: list[Tensor] = []
        blocks: list[Tensor] = []
        for i, stage in enumerate(self.blocks):
            if stop is not None and i > stop:
                break
            for blk in stage:
                x = recomputed(blk, blk, x) if ckpt else blk(x)
                if keep_blocks:
                    blocks.append(x)
            stages.append(x)
        return {"last": x, "stages": stages, "blocks": blocks}

    def forward_features(self, x: Tensor) -> Tensor:
        """The last map (after the final layers) as tokens ``(B, H·W, C)``."""
        if torch.jit.is_scripting():  # noqa: SIM108 -- TorchScript leaves out the other branch of this statement
            x = self.forward_scripted(x)
        else:
            x = self._run(x)["last"]
        return tokens(self.forward_final(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_trace(self, x: Tensor, return_aux: bool = True) -> dict[str, Any]:
        """vitlab's per-block trace: ``{"tokens": every residual block's output as (B, H·W, C), "aux": empty
        dicts (a CNN computes no attention maps), "features": forward_features' tokens, "layout": the last
        map's grid, no prefix tokens}``. The blocks' shapes change where a stage downsamples or widens."""
        run = self._run(x, keep_blocks=True)
        last = self.forward_final(run["last"])
        return {
            "tokens": [tokens(b) for b in run["blocks"]],
            "aux": [{} for _ in run["blocks"]],
            "features": tokens(last),
            "layout": TokenLayout((int(last.shape[-2]), int(last.shape[-1])), 0),
        }

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's feature extraction over the stages: each asked for as its ``(B, C, H, W)`` map (``"NLC"``:
        tokens). ``norm`` changes nothing (no norm sits between a CNN's stages, as timm's CNNs). Returns
        ``(forward_features' tokens, maps)``, or the maps only; ``stop_early`` runs no stage past the last
        one asked for (the first entry is then that stage's tokens)."""
        if output_fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output_fmt must be one of {', '.join(OUTPUT_FORMATS)}, got {output_fmt!r}")
        if return_prefix_tokens:
            raise ValueError(f"{type(self).__name__} has no prefix tokens: use return_prefix_tokens=False")
        take, last = feature_take_indices(len(self.blocks), indices)
        run = self._run(x, stop=last if stop_early else None)
        maps = [run["stages"][i] for i in take]
        outs = maps if output_fmt == "NCHW" else [tokens(m) for m in maps]
        if intermediates_only:
            return outs
        final = run["last"] if len(run["stages"]) < len(self.blocks) else self.forward_final(run["last"])
        return tokens(final), outs

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the stages after the last of ``indices`` and, with them, the final layers and the head (or with
        ``prune_norm`` / ``prune_head``); returns the stage indices kept for ``forward_intermediates``."""
        take, last = feature_take_indices(len(self.blocks), indices)
        cut = last < len(self.blocks) - 1
        self._prune_after(last)
        if cut or prune_norm:
            self._prune_final()
            self.embed_dim = self.stage_channels[-1]
        if cut or prune_head:
            self.reset_classifier(0, "")
        return take

    def _prune_after(self, last: int) -> None:
        for name in self.stage_names[last + 1 :]:
            self._drop_stage(name)
        for facts in ("stage_names", "stage_channels", "stage_reductions"):
            setattr(self, facts, getattr(self, facts)[: last + 1])
        self.depths = self.depths[: last + 1]
        self.grid = (math.ceil(self._img_size[0] / self.reduction), math.ceil(self._img_size[1] / self.reduction))

    # ------------------------------------------------------------------------------------ training
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's groups for layer-wise learning rates: the stem, then one per residual block (``coarse``:
        per stage), the final layers with the last; the head unmatched (last)."""
        raise NotImplementedError

    def set_input_size(self, img_size: int | Sequence[int] | None = None, patch_size: Any = None) -> None:
        """Another default input size (a CNN needs no rebuilding); there is no patch size to change."""
        if patch_size is not None:
            raise ValueError(f"{type(self).__name__} has no patch size; only img_size can be set")
        super().set_input_size(img_size)


def init_conv_fan_out(model: nn.Module) -> None:
    """He-normal convolutions over their fan-out ``k·k·C_out / groups`` (He et al. 2015, as torchvision's and
    pycls' ResNets and RegNets), zero conv biases, unit BatchNorm scales and zero shifts."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
