"""What every vitlab classifier shares: building blocks from mixer specs, the block loop, init, and timm's
model contract, written once.

VisionTransformer, TNT and T2TViT differ only in how images become tokens and in their blocks. Each
implements ``_trace`` (embed, then run the blocks, keeping the outputs asked for); everything else lives
here: ``forward_features`` / ``forward_head`` / ``forward`` (timm's split of a classifier),
``forward_intermediates`` and ``prune_intermediate_layers`` (timm 1.0's feature extraction),
``forward_trace`` (vitlab's per-block trace: tokens, the mixers' maps and keys, the token layout: what the
analysis tools read), ``reset_classifier`` / ``get_classifier`` with timm's pools, ``set_grad_checkpointing``,
``group_matcher`` (layer-wise learning-rate decay), ``set_input_size``, ``no_weight_decay``, ``feature_info``,
``pretrained_cfg`` and ``save_pretrained``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..data.datasets import IMAGENET_MEAN, IMAGENET_STD
from ..layers import Block
from ..layers.recompute import recompute_active, recomputed
from ..mixers import build as build_mixer
from ..mixers.base import TokenLayout, TokenMixer
from ..ops.switch import fx_tracing

MixerSpec = str | tuple[str, dict[str, Any]]
#: timm's global pools: '' (none: every token goes to the head), the class token, and reductions over the
#: patch tokens (prefix tokens excluded): mean, max, and the average of the two
POOLS = ("", "token", "avg", "max", "avgmax")
OUTPUT_FORMATS = ("NCHW", "NLC")


def is_single_spec(spec: Any) -> bool:
    """A mixer spec for one block: a kind, or ``(kind, kwargs)`` (a tuple or, read back from JSON, a list)."""
    if isinstance(spec, str):
        return True
    return isinstance(spec, tuple | list) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], dict)


def mixer_specs(mixer: MixerSpec | Sequence[MixerSpec], depth: int) -> list[tuple[str, dict[str, Any]]]:
    """One ``(kind, kwargs)`` per block from a single spec or a per-block list."""
    specs = [mixer] * depth if is_single_spec(mixer) else list(mixer)
    if len(specs) != depth:
        raise ValueError(f"got {len(specs)} mixer specs for depth {depth}")
    if not all(is_single_spec(s) for s in specs):
        raise ValueError(f"a mixer spec is a kind or (kind, options), got {mixer!r}")
    return [(s, {}) if isinstance(s, str) else (s[0], dict(s[1])) for s in specs]


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Stochastic depth growing linearly from 0 to ``rate`` over the blocks (DeiT)."""
    return [rate * i / max(depth - 1, 1) for i in range(depth)]


def build_blocks(
    dim: int,
    depth: int,
    mixer: MixerSpec | Sequence[MixerSpec],
    mixer_defaults: dict[str, Any],
    drop_path_rate: float = 0.0,
    **block_kw: Any,
) -> nn.ModuleList:
    """``depth`` pre-norm blocks, block i holding the mixer of spec i; ``mixer_defaults`` (num_heads, qkv_bias,
    max_len, ...) go to the mixers that take them."""
    dpr = drop_path_rates(drop_path_rate, depth)
    return nn.ModuleList(
        Block(dim, build_mixer(kind, dim, defaults=mixer_defaults, **kw), drop_path=dpr[i], **block_kw)
        for i, (kind, kw) in enumerate(mixer_specs(mixer, depth))
    )


def run_blocks(
    blocks: Sequence[nn.Module],
    x: Tensor,
    layout: TokenLayout,
    return_aux: bool = False,
    after_block=None,
    keep: Collection[int] | None = None,
    stop: int | None = None,
    checkpointing: bool = False,
) -> tuple[Tensor, list[Tensor], list[dict[str, Tensor]]]:
    """Run ``blocks`` in order, handing Refined-ViT's attention map from block to block.

    Returns the last output, the outputs of the blocks in ``keep`` (None: all) in block order, and every
    mixer's aux (empty dicts unless ``return_aux``). ``after_block(i, x)`` may transform the output of
    block i (CPVT's PEG). ``stop``: the last block to run. ``checkpointing``: each block is recomputed in
    backward instead of keeping its activations (:mod:`vitlab.layers.recompute`).
    """
    tokens, auxes = [], []
    carry = None
    ckpt = recompute_active(checkpointing)
    for i, blk in enumerate(blocks):
        if stop is not None and i > stop:
            break
        chained = blk.mixer.uses_attn_prev
        if return_aux or chained:
            kw = dict(attn_prev=carry, return_aux=True)
            x, aux = recomputed(blk, blk, x, layout, **kw) if ckpt else blk(x, layout, **kw)
            carry = aux.get("carry", carry) if chained else carry
        else:
            x, aux = (recomputed(blk, blk, x, layout) if ckpt else blk(x, layout)), {}
        if after_block is not None:
            x = after_block(i, x)
        if keep is None or i in keep:
            tokens.append(x)
        if return_aux:
            auxes.append(aux)
    return x, tokens, auxes


def check_pool(global_pool: str, has_class_token: bool = True) -> str:
    if global_pool not in POOLS:
        raise ValueError(f"global_pool must be one of {', '.join(map(repr, POOLS))}, got {global_pool!r}")
    if global_pool == "token" and not has_class_token:
        raise ValueError("global_pool='token' needs a class token; use global_pool='avg' without one")
    return global_pool


def pool_tokens(x: Tensor, global_pool: str, num_prefix: int) -> Tensor:
    """timm's pooling of ``(B, N, C)`` tokens: '' keeps them all; 'token' takes the first (the class token);
    'avg' / 'max' / 'avgmax' reduce the patch tokens."""
    if not global_pool:
        return x
    if global_pool == "token":
        return x[:, 0]
    patches = x[:, num_prefix:]
    if global_pool == "avg":
        return patches.mean(1)
    if global_pool == "max":
        return patches.amax(1)
    return 0.5 * (patches.amax(1) + patches.mean(1))


def feature_take_indices(num_blocks: int, indices: int | Sequence[int] | None = None) -> tuple[list[int], int]:
    """timm's choice of blocks: None = all, an int n = the last n, a list = those (negative from the end).
    Returns the block indices (non-negative) and the largest."""
    if indices is None:
        indices = num_blocks
    if isinstance(indices, int):
        if not 0 < indices <= num_blocks:
            raise ValueError(f"asked for the last {indices} blocks of {num_blocks}")
        take = list(range(num_blocks - indices, num_blocks))
    else:
        take = [num_blocks + i if i < 0 else i for i in indices]
        if not take or any(not 0 <= i < num_blocks for i in take):
            raise ValueError(f"block indices {list(indices)} out of range for {num_blocks} blocks")
    return take, max(take)


class FeatureInfo(list):
    """timm's feature description: one dict per feature (``num_chs``, ``reduction``, ``module``) with the
    accessors timm's feature users call."""

    def get(self, key: str, idx: int | Sequence[int] | None = None) -> Any:
        if idx is None:
            return [f[key] for f in self]
        return self[idx][key] if isinstance(idx, int) else [self[i][key] for i in idx]

    def channels(self, idx: int | Sequence[int] | None = None) -> Any:
        return self.get("num_chs", idx)

    def reduction(self, idx: int | Sequence[int] | None = None) -> Any:
        return self.get("reduction", idx)

    def module_name(self, idx: int | Sequence[int] | None = None) -> Any:
        return self.get("module", idx)


#: a group_matcher suffix that joins the layer before (timm's ``MATCH_PREV_GROUP``: the final norm learns with
#: the last block)
MATCH_PREV_GROUP = 99999


def layer_ids(names: Iterable[str], matcher: dict[str, Any]) -> dict[str, int]:
    """Which layer each parameter belongs to, from a timm ``group_matcher`` dict (timm's ``group_parameters``
    rule): every group's regexes are tried in order (anchored at the start); a parameter gets the group's
    ordinal, the numbers the regex captured and the regex's suffix; unmatched ones (the head) come last; the
    sorted ordinals are then numbered 0, 1, ..., except that one ending in :data:`MATCH_PREV_GROUP` shares the
    number before it (stem 0, block i -> i + 1, the final norm with the last block, head L + 1)."""
    compiled = []
    for ordinal, spec in enumerate(matcher.values()):
        for rx, suffix in [(spec, None)] if isinstance(spec, str) else spec:
            compiled.append((re.compile(rx), ordinal, suffix))

    def key(name: str) -> tuple[float, ...]:
        for rx, ordinal, suffix in compiled:
            if m := rx.match(name):
                return (ordinal, *(float(g) for g in m.groups()), *(suffix or ()))
        return (float("inf"),)

    keys = {n: key(n) for n in names}
    number: dict[tuple[float, ...], int] = {}
    for k in sorted(set(keys.values())):
        joins = number and k[-1] == MATCH_PREV_GROUP
        number[k] = len(set(number.values())) - 1 if joins else len(set(number.values()))
    return {n: number[k] for n, k in keys.items()}


class Classifier(nn.Module):
    """The head and timm's model contract shared by the models.

    Subclasses set ``embed_dim``, ``num_prefix``, ``global_pool``, ``num_classes``, ``head``, ``norm`` and
    ``blocks``, and implement :meth:`_trace`, :meth:`_set_img_size` and the class facts ``STEM`` (names of
    the parameters before the first block, for :meth:`group_matcher`), ``first_conv``, ``NO_WEIGHT_DECAY``.
    """

    embed_dim: int
    num_prefix: int
    global_pool: str
    num_classes: int
    blocks: nn.ModuleList
    grad_checkpointing: bool = False
    STEM: tuple[str, ...] = ("cls_token", "pos_embed", "patch_embed")
    NO_WEIGHT_DECAY: tuple[str, ...] = ("pos_embed", "cls_token", "dist_token")
    #: extra (regex, suffix) groups of parameters that belong to block N (CPVT's PEG after block N)
    BLOCK_GROUPS: tuple[tuple[str, Any], ...] = ()

    # ------------------------------------------------------------------------------- sizes and names
    @property
    def num_features(self) -> int:
        return self.embed_dim

    @property
    def head_hidden_size(self) -> int:
        return self.embed_dim

    @property
    def num_prefix_tokens(self) -> int:  # timm's name
        return self.num_prefix

    @property
    def first_conv(self) -> str:
        """The first layer that sees the image (timm's ``first_conv``): the CNN stem's first convolution where
        there is one, else the patch projection."""
        stem = getattr(getattr(self, "patch_embed", None), "stem", ())
        return "patch_embed.stem.0" if len(stem) else "patch_embed.proj"

    @property
    def reduction(self) -> int:
        """Image pixels per token along a side (the patch size)."""
        return int(self.patch_embed.patch_size[0])

    @property
    def feature_info(self) -> FeatureInfo:
        return FeatureInfo(
            dict(num_chs=self.embed_dim, reduction=self.reduction, module=f"blocks.{i}")
            for i in range(len(self.blocks))
        )

    @property
    def pretrained_cfg(self) -> dict[str, Any]:
        """timm's description of the expected input and of the weights (set by ``build_model``; a model built
        from its class gets one from its own sizes)."""
        cfg = self.__dict__.get("_pretrained_cfg")
        return cfg if cfg is not None else self.default_pretrained_cfg()

    @pretrained_cfg.setter
    def pretrained_cfg(self, cfg: dict[str, Any]) -> None:
        self.__dict__["_pretrained_cfg"] = dict(cfg)

    @property
    def default_cfg(self) -> dict[str, Any]:  # timm's older name
        return self.pretrained_cfg

    def default_pretrained_cfg(self) -> dict[str, Any]:
        chans = self.in_chans
        return {
            "input_size": (chans, *self.img_size),
            "interpolation": "bicubic",
            "crop_pct": 0.875,
            "crop_mode": "center",
            "mean": IMAGENET_MEAN if chans == 3 else (0.5,) * chans,
            "std": IMAGENET_STD if chans == 3 else (0.5,) * chans,
            "num_classes": self.num_classes,
            "first_conv": self.first_conv,
            "classifier": self.classifier_names(),
        }

    def classifier_names(self) -> str | tuple[str, ...]:
        return "head"

    # ------------------------------------------------------------------------------------------ head
    def new_head(self, num_classes: int) -> nn.Module:
        """A head for ``num_classes`` on the model's device and dtype, in its training mode (timm's contract:
        a head replaced after ``.to(...)`` lands where the model is)."""
        if num_classes <= 0:
            return nn.Identity()
        like = next(self.parameters(), None)
        where = {} if like is None else {"device": like.device, "dtype": like.dtype}
        return nn.Linear(self.embed_dim, num_classes, **where).train(self.training)

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head for ``num_classes`` (0: none, the pooled features come out) and optionally another pool
        (``''`` keeps every token: the model then returns ``(B, N, num_classes or C)``)."""
        if global_pool is not None:
            self.global_pool = check_pool(global_pool, self.num_prefix > 0)
            self._record(global_pool=global_pool)
        self.num_classes = num_classes
        self.head = self.new_head(num_classes)
        self._record(num_classes=num_classes)

    def _record(self, **changes: Any) -> None:
        """Keep the build description (``model_kwargs``, ``pretrained_cfg``) in step with a change made after
        building, so that ``save_pretrained`` writes the model as it is."""
        if "model_kwargs" in self.__dict__:
            self.model_kwargs.update(changes)
        cfg = self.__dict__.get("_pretrained_cfg")
        if cfg is not None and "num_classes" in changes:
            cfg["num_classes"] = changes["num_classes"]

    def pool(self, x: Tensor) -> Tensor:
        return pool_tokens(x, self.global_pool, self.num_prefix)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Pooled features (``pre_logits``) or logits from ``forward_features`` output."""
        pooled = self.pool(x)
        return pooled if pre_logits else self.head(pooled)

    # --------------------------------------------------------------------------------------- forward
    def _trace(
        self, x: Tensor, return_aux: bool, keep: Collection[int] | None = None, stop: int | None = None
    ) -> dict[str, Any]:
        """Embed and run the blocks (up to ``stop``): ``{"tokens": outputs of the blocks in keep (None: all),
        "aux": each mixer's aux (with return_aux), "last": the last block's output, "layout": TokenLayout}``."""
        raise NotImplementedError

    def forward_features(self, x: Tensor) -> Tensor:
        """Tokens ``(B, N, C)`` after the final norm."""
        return self.norm(self._trace(x, False, keep=())["last"])

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_trace(self, x: Tensor, return_aux: bool = True) -> dict[str, Any]:
        """vitlab's per-block trace: ``{"tokens": [(B, N, C) per block], "aux": [the mixer's maps / keys per
        block], "features": final normed tokens, "layout": TokenLayout}`` (TNT adds ``"inner_tokens"``).

        With ``return_aux`` attention takes its explicit path (it materialises the maps), which computes the
        same output as SDPA; this is what the analysis tools read.
        """
        trace = self._trace(x, return_aux)
        trace["features"] = self.norm(trace.pop("last"))
        if not return_aux:
            trace["aux"] = [{} for _ in trace["tokens"]]
        return trace

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Any] | tuple[Tensor, list[Any]]:
        """timm 1.0's feature extraction: the outputs of the blocks ``indices`` (None: all; n: the last n; a
        list, negative from the end), prefix tokens removed, as ``(B, C, H, W)`` maps (``output_fmt="NCHW"``)
        or ``(B, N, C)`` tokens (``"NLC"``); ``norm`` applies the final norm to each; ``return_prefix_tokens``
        pairs each with its prefix tokens. Returns ``(final normed tokens, intermediates)``, or the
        intermediates only; ``stop_early`` runs no block past the last one asked for."""
        if output_fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output_fmt must be one of {', '.join(OUTPUT_FORMATS)}, got {output_fmt!r}")
        take, last = feature_take_indices(len(self.blocks), indices)
        trace = self._trace(x, False, keep=set(take), stop=last if stop_early else None)
        outs = [self.norm(t) if norm else t for t in trace["tokens"]]
        prefix = [t[:, : self.num_prefix] for t in outs]
        outs = [t[:, self.num_prefix :] for t in outs]
        if output_fmt == "NCHW":
            gh, gw = trace["layout"].grid
            outs = [t.reshape(t.shape[0], gh, gw, -1).permute(0, 3, 1, 2).contiguous() for t in outs]
        if return_prefix_tokens:
            outs = list(zip(outs, prefix))
        return outs if intermediates_only else (self.norm(trace["last"]), outs)

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the blocks after the last of ``indices`` (and the final norm, the head) for feature extraction;
        returns the block indices kept for ``forward_intermediates``."""
        take, last = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: last + 1]
        self._prune_after(last)
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take

    def _prune_after(self, last: int) -> None:
        """Remove what belongs to blocks after ``last`` (CPVT's PEGs)."""

    # ------------------------------------------------------------------------------------- training
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in backward instead of keeping its activations (less memory, about one more
        forward pass of time); gradients, BatchNorm statistics and dropout draws are those without it."""
        self.grad_checkpointing = bool(enable)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's parameter groups for layer-wise learning-rate decay: the stem (embeddings, tokens, tables),
        then one group per block, the final norm joining the last; the head is left unmatched (timm puts it
        last)."""
        stem = "|".join(rf"^{re.escape(name)}(?:\.|$)" for name in self.STEM)
        blocks = [(r"^blocks\.(\d+)\.", None), *self.BLOCK_GROUPS, (r"^norm\.", (MATCH_PREV_GROUP,))]
        return {"stem": stem, "blocks": blocks}

    def regularization_loss(self) -> Tensor | None:
        """The sum of the submodules' training penalties (their ``regularization_loss()``: AFT-conv's sparsity
        of the position bias), or None when none has one. The training loop adds it to the loss."""
        terms = []
        for m in self.modules():
            penalty = getattr(m, "regularization_loss", None) if not isinstance(m, Classifier) else None
            term = penalty() if penalty is not None else None
            if term is not None:
                terms.append(term)
        return torch.stack(terms).sum() if terms else None

    def no_weight_decay(self) -> set[str]:
        """Tokens and position tables (as the official code), plus what each block's mixer names."""
        names = {n for n, _ in self.named_parameters() if n.split(".")[0] in self.NO_WEIGHT_DECAY}
        for i, blk in enumerate(self.blocks):
            mixer = getattr(blk, "mixer", None)
            if hasattr(mixer, "no_weight_decay"):
                names |= {f"blocks.{i}.mixer.{n}" for n in mixer.no_weight_decay()}
        return names

    def init_trunc_normal(self, *tensors: Tensor | None) -> None:
        """The init of DeiT, TNT and T2T-ViT: trunc-normal(0.02) for the given tokens/tables and every Linear
        weight, zero biases, unit LayerNorms; then mixers with their own init (external attention's
        ``M_v = M_kᵀ``, AFT's factors) re-apply it through ``reset_parameters``."""
        for t in tensors:
            if t is not None:
                nn.init.trunc_normal_(t, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, TokenMixer) and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    # ------------------------------------------------------------------------------------ input size
    @property
    def img_size(self) -> tuple[int, int]:
        """The input size the model is built for (its position table's grid times the patch size)."""
        return (self.grid[0] * self.reduction, self.grid[1] * self.reduction)

    @property
    def traced_size(self) -> tuple[int, int] | None:
        """The input size a torch.fx graph of this model is built for: None where the computation depends on the
        size only through reshapes (no position table, no mixer built for a token count), so the graph reads the
        size of each input and runs at any size (:func:`~vitlab.layers.patch_embed.image_size`). None outside
        tracing (an eager call reads its input's size; the module walk is skipped)."""
        if not fx_tracing() or supports_dynamic_size(self):
            return None
        return self.img_size

    @property
    def in_chans(self) -> int:
        return int(self.patch_embed.in_chans)

    def set_input_size(self, img_size: int | Sequence[int] | None = None, patch_size: Any = None) -> None:
        """Rebuild for another input size (timm's ``set_input_size``): a learned position table is resampled
        (bicubic) to the new patch grid, a fixed one recomputed. The patch size cannot change."""
        if patch_size is not None:
            current = self.reduction
            if tuple(patch_size if isinstance(patch_size, Sequence) else (patch_size, patch_size)) != (current,) * 2:
                raise ValueError(f"the patch size ({current}) cannot change after building; build a new model")
        if img_size is None:
            return
        size = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
        with torch.no_grad():
            self._set_img_size(size)
        self._record(img_size=size[0] if size[0] == size[1] else size)
        cfg = self.__dict__.get("_pretrained_cfg")
        if cfg is not None:
            cfg["input_size"], cfg["pool_size"] = (self.in_chans, *size), tuple(self.grid)
        if isinstance(getattr(self, "meta", None), dict):
            self.meta["input_size"] = (self.in_chans, *size)

    def _set_img_size(self, size: tuple[int, int]) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------------------------- saving
    def save_pretrained(self, folder: Any) -> Any:
        """Write ``config.json`` (model name and build options), ``model.safetensors`` and a short model card
        (``README.md``) into ``folder``; ``vitlab.from_pretrained(folder)`` builds the same model again."""
        from .folder import save_pretrained

        return save_pretrained(self, folder)


#: timm's ``feature_cls`` values a vitlab model serves: its ``forward_intermediates`` getter (None: the default)
FEATURE_CLASSES = (None, "getter")


class FeatureGetter(nn.Module):
    """timm's ``features_only`` model (timm's ``feature_cls='getter'``): ``forward(x)`` returns the outputs of
    the blocks ``out_indices`` (an int n: the last n; default 3) as ``(B, C, H, W)`` maps (``output_fmt="NLC"``:
    tokens), through ``forward_intermediates``. The blocks after the last one, the head and (unless ``norm``)
    the final norm are removed from ``model``. ``feature_info`` describes each output; ``pretrained_cfg`` /
    ``default_cfg`` are the model's."""

    def __init__(
        self,
        model: Classifier,
        out_indices: int | Sequence[int] | None = None,
        output_fmt: str = "NCHW",
        norm: bool = False,
    ) -> None:
        super().__init__()
        if output_fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output_fmt must be one of {', '.join(OUTPUT_FORMATS)}, got {output_fmt!r}")
        if out_indices is None:
            out_indices = min(3, len(model.blocks))
        info = model.feature_info
        self.out_indices = model.prune_intermediate_layers(out_indices, prune_norm=not norm, prune_head=True)
        self.feature_info = FeatureInfo(info[i] for i in self.out_indices)
        self.model, self.output_fmt, self.norm = model, output_fmt, norm
        self.pretrained_cfg = self.default_cfg = model.pretrained_cfg

    def forward(self, x: Tensor) -> list[Tensor]:
        return self.model.forward_intermediates(
            x, self.out_indices, norm=self.norm, output_fmt=self.output_fmt, intermediates_only=True
        )

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.model.set_grad_checkpointing(enable)


def feature_extractor(
    model: Classifier, out_indices: int | Sequence[int] | None = None, feature_cls: str | None = None, **kw: Any
) -> FeatureGetter:
    """timm's ``features_only=True``: the :class:`FeatureGetter` of ``model`` (``feature_cls`` None or
    ``'getter'``: timm's other feature classes hook or rewrite a CNN's modules, which a token model has not)."""
    if feature_cls not in FEATURE_CLASSES:
        raise ValueError(
            f"feature_cls={feature_cls!r}: vitlab models extract features with forward_intermediates "
            f"(feature_cls='getter', the default); leave it unset or pass 'getter'"
        )
    return FeatureGetter(model, out_indices, **kw)


def supports_dynamic_size(model: nn.Module, resample: bool = False) -> bool:
    """Whether ``model`` runs at input sizes other than the one it was built for (a multiple of its patch).

    Without ``resample``: as built, with one computation for every size -- no learned position table and no
    mixer built for a fixed token count (CPVT's PEGs, AFT-conv, TNT without a patch table): what an exported
    graph with a dynamic height and width needs (resampling a table is traced at the example's size). With
    ``resample``: also once its fixed-size tables are resampled to the input (ViT's and TNT's position table,
    ``dynamic_img_size``; AFT-full/local's position biases, the mixers' ``resample``): what evaluating trained
    weights at another resolution needs. T2T-ViT and the pyramid CPVT are built for one size either way.
    """
    if not hasattr(model, "dynamic_img_size"):  # the architectures that can resample their table say so
        return False
    if resample:
        return True
    return model.pos_embed is None and not has_fixed_mixer(model)


def has_fixed_mixer(model: nn.Module) -> bool:
    """Whether a mixer of ``model`` is built for one token count (AFT-full/local's position biases)."""
    return any(getattr(m, "max_len", None) for m in model.modules() if m is not model)
