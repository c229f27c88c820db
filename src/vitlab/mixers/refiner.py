"""Refiner: refining self-attention maps (Zhou et al. 2021, arXiv 2106.03714).

The refiner works on the attention maps ``A`` (B, H, N, N), read as images with
H channels on the query × key plane (class-token row/column included):

1. attention expansion (paper §2.2): ``Ã^h = Σ_i W_A(h, i) A^i``, h = 1..rH, a
   1×1 convolution H → rH over the head axis;
2. distributed local attention (DLA, paper §2.3):
   ``A*_{ij} = Σ_{a,b} w_{ab} Ã_{i-⌊k/2⌋+a, j-⌊k/2⌋+b}``, a depth-wise k×k
   convolution of every expanded map (zero padding, TensorFlow "same");
3. linear reduction (paper §2.4): a 1×1 convolution rH → H,

and the refined maps multiply V. With a kernel that is non-zero only along the
key axis, ``Σ_j A*_ij v_j = Σ_j A_ij Σ_a w_a v_{j-a+⌊k/2⌋}``: attention over
locally aggregated values, hence the name.

docs/semantics.md, Decision R1: the defaults are the paper's linear operation;
``official_extras=True`` adds what the official code (Refiner_ViT ``DLA``) has
-- BatchNorm + ReLU6 after expansion and after the depth-wise conv, BatchNorm
after reduction, an identity shortcut -- and, through ``adapt_bn``, the extra
BatchNorm on the refined map. ``share=True`` and ``residual_attention=True``
reproduce the official "shared" and "normal" blocks of the released models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..ops.fold import can_fold, fold_bn
from ..ops.head_mix_norm import can_fuse, head_mix_batchnorm
from ..ops.linear import fused_linear
from ..ops.row_norm import batch_norm_rows, can_normalise_rows
from .attention import Attention, HeadMix, attention_map, attention_softmax_flops
from .base import RELU6, TokenLayout, batchnorm_flops, check_divisible, merge_heads, split_heads

#: official Refiner_ViT key prefixes -> vitlab's (``Refined_Attention`` -> ``RefinerAttention``)
OFFICIAL_KEY_PREFIXES: dict[str, str] = {
    "DLA.conv_exp.": "refiner.expand.0.",
    "DLA.bn1.": "refiner.expand.1.",
    "DLA.depth_sep_conv.": "refiner.local.0.",
    "DLA.bn2.": "refiner.local.1.",
    "DLA.conv_pro.": "refiner.reduce.0.",
    "DLA.bn3.": "refiner.reduce.1.",
}


def _positive_int(name: str, what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {what} must be a positive integer, got {value!r}")
    return value


def _fold_stage(stage: nn.Sequential, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, bool]:
    """(weight, bias or None, ReLU6?) of a refiner stage with its BatchNorm folded in; a 1x1 head mix gives a
    (out, in) matrix, the depth-wise conv its (C, 1, k, k) kernel. Folded in fp32, returned in ``dtype``."""
    conv = stage[0]
    w = conv.weight.float()
    w = w[:, :, 0, 0] if isinstance(conv, HeadMix) else w
    bias = None if conv.bias is None else conv.bias.float()
    bns = [m for m in stage if isinstance(m, nn.BatchNorm2d)]
    if bns:
        w, bias = fold_bn(w, bias, bns[0])
    relu6 = any(isinstance(m, nn.ReLU6) for m in stage)
    return w.to(dtype), None if bias is None else bias.to(dtype), relu6


def _bias_act(x: Tensor, bias: Tensor | None, relu6: bool) -> Tensor:
    """``ReLU6(x + bias)`` in place (bias over the last axis of a heads-last tensor)."""
    if bias is not None:
        x = x.add_(bias)
    return x.clamp_(0.0, 6.0) if relu6 else x


def check_maps(attn: Tensor, num_heads: int, name: str) -> None:
    """ValueError unless ``attn`` is ``(B, num_heads, N, N)`` attention maps (``name``: whose input)."""
    if attn.dim() != 4 or attn.shape[1] != num_heads or attn.shape[2] != attn.shape[3]:
        raise ValueError(f"{name}: expected attention maps (B, H={num_heads}, N, N), got {tuple(attn.shape)}")


def check_prev_map(attn_prev: Tensor, x: Tensor, num_heads: int, reads: bool = True) -> None:
    """ValueError unless ``attn_prev`` is the previous block's map ``(B, H, N, N)`` for the tokens ``x``. A block
    that never ``reads`` the map (neither shared nor residual) takes any head count: after a block without the
    reduction (Refiner Table 3) there are rH maps."""
    heads = num_heads if reads or attn_prev.dim() != 4 else attn_prev.shape[1]
    want = (x.shape[0], heads, x.shape[1], x.shape[1])
    if tuple(attn_prev.shape) != want:
        raise ValueError(
            f"RefinerAttention: attn_prev must be the previous block's map of shape (B, H, N, N) = {want}, "
            f"got {tuple(attn_prev.shape)}"
        )


torch.fx.wrap("check_maps")  # kept as calls in a torch.fx graph
torch.fx.wrap("check_prev_map")


class SameDepthwiseConv2d(nn.Conv2d):
    """Depth-wise k×k convolution, no bias, TensorFlow-"same" zero padding at stride 1.

    Padding is k-1 in total per axis, ⌊(k-1)/2⌋ before and the rest after, as the
    official ``Conv2dSamePadding``: symmetric for odd k, one more after for even k.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        before = (kernel_size - 1) // 2
        odd = kernel_size % 2 == 1
        super().__init__(channels, channels, kernel_size, padding=before if odd else 0, groups=channels, bias=False)
        # even kernels need an asymmetric pad, which Conv2d's own padding cannot express
        self.same_pad = None if odd else (before, kernel_size - 1 - before) * 2

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x if self.same_pad is None else F.pad(x, self.same_pad))


#: Refiner Table 4: the span of the DLA kernel (docs/semantics.md, Decision R4). ``none``: k×k over the map's
#: query × key plane (the paper's DLA); ``spatial``: k×k over the keys' image grid, each query's row of the map
#: read as an image; ``rowcol``: the same kernel restricted to the key's image row and column (a cross).
KERNEL_CONSTRAINTS = ("none", "spatial", "rowcol")


def kernel_mask(kernel_size: int, constraint: str) -> Tensor:
    """The 0/1 (k, k) tap mask of a DLA kernel constraint: every tap for ``none`` and ``spatial``; for ``rowcol``
    the centre row and the centre column (a cross of 2k - 1 taps, on the keys' image grid)."""
    if constraint not in KERNEL_CONSTRAINTS:
        raise ValueError(f"kernel_constraint must be one of {', '.join(KERNEL_CONSTRAINTS)}, got {constraint!r}")
    mask = torch.ones(kernel_size, kernel_size)
    if constraint == "rowcol":
        centre = (kernel_size - 1) // 2
        mask.zero_()
        mask[centre, :] = 1.0
        mask[:, centre] = 1.0
    return mask


def key_grid_conv(maps: Tensor, weight: Tensor, layout: TokenLayout) -> Tensor:
    """``A*[c, i, j] = Σ_{a,b} w[c, a, b] · A[c, i, j + (a - k//2)·gw + (b - k//2)]`` over the keys' image grid:
    each query's row of every map ``(B, C, N, N)`` is an image of the patch keys, convolved depth-wise (weight
    ``(C, 1, k, k)``, odd k, zero padding k//2; no wrap from one image row to the next). A prefix key (class
    token) has no image neighbours: its column is scaled by the centre tap."""
    b, c, n, _ = maps.shape
    (gh, gw), p = layout.grid, layout.num_prefix
    k = weight.shape[-1]
    patches = maps[..., p:].permute(0, 2, 1, 3).reshape(b * n, c, gh, gw)
    patches = F.conv2d(patches, weight, padding=k // 2, groups=c).reshape(b, n, c, gh * gw).permute(0, 2, 1, 3)
    prefix = maps[..., :p] * weight[:, 0, k // 2, k // 2].view(1, c, 1, 1)
    return torch.cat([prefix, patches], dim=-1)


class MaskedKernel(nn.Module):
    """Parametrisation ``w -> w * mask``: the constrained taps are 0 wherever the weight is read (forward, the
    inference fold, ``state_dict`` consumers of ``conv.weight``), and receive no gradient."""

    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, w: Tensor) -> Tensor:
        return w * self.mask.to(w.dtype)


class DistributedLocalAttention(nn.Module):
    """The refiner on attention maps: expansion H → rH, depth-wise k×k conv (DLA), reduction rH → H.

    Input and output are maps ``(B, H, N, N)`` (``(B, rH, N, N)`` out when
    ``reduction=False``). Stages can be switched off for the paper's ablations:
    ``expansion=1`` skips the expansion conv (as the official code), ``dla=False``
    the local convolution, ``reduction=False`` the reduction. With
    ``official_extras`` each conv is followed by BatchNorm (+ ReLU6 after the
    first two) and the input map is added back (official ``DLA``). ``kernel_constraint`` sets the span of
    the local kernel (Refiner Table 4: :data:`KERNEL_CONSTRAINTS`, :func:`key_grid_conv`).
    """

    def __init__(
        self,
        num_heads: int,
        expansion: int = 3,
        kernel_size: int = 3,
        dla: bool = True,
        reduction: bool = True,
        official_extras: bool = False,
        kernel_constraint: str = "none",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.num_heads = _positive_int(name, "num_heads", num_heads)
        self.expansion = _positive_int(name, "expansion", expansion)
        self.kernel_size = _positive_int(name, "kernel_size", kernel_size)
        hidden = num_heads * expansion
        self.out_heads = num_heads if reduction else hidden
        if official_extras and self.out_heads != num_heads:
            raise ValueError(
                f"{name}: official_extras adds the input maps back (identity shortcut), which needs "
                f"reduction=True or expansion=1; got reduction=False with expansion={expansion}"
            )
        self.residual = official_extras

        def stage(conv: nn.Conv2d, relu: bool) -> nn.Sequential:
            # in place (as the official code): the BatchNorm's backward needs its input, not its output, so the
            # clamp reuses that buffer instead of allocating and filling a new map (about 4x faster here)
            extras = [nn.BatchNorm2d(conv.out_channels)] + ([nn.ReLU6(inplace=True)] if relu else [])
            return nn.Sequential(conv, *(extras if official_extras else []))

        self.expand = stage(HeadMix(num_heads, hidden, bias=False), True) if expansion > 1 else None
        self.local = stage(SameDepthwiseConv2d(hidden, kernel_size), True) if dla else None
        self.reduce = stage(HeadMix(hidden, num_heads, bias=False), False) if reduction else None
        mask = kernel_mask(kernel_size, kernel_constraint)
        self.kernel_constraint = kernel_constraint
        self.key_grid = dla and kernel_constraint != "none"  # the kernel runs over the keys' image grid
        if self.key_grid and kernel_size % 2 == 0:
            raise ValueError(
                f"{name}: kernel_constraint={kernel_constraint!r} needs an odd kernel_size, got {kernel_size}"
            )
        if dla and kernel_constraint == "rowcol":
            parametrize.register_parametrization(self.local[0], "weight", MaskedKernel(mask))

    def forward(
        self, attn: Tensor, post: tuple[Tensor, Tensor] | None = None, layout: TokenLayout | None = None
    ) -> Tensor:
        """Refined maps; ``post = (a, c)`` (one value per output head) returns ``a · DLA(attn) + c``. ``layout``:
        the tokens' patch grid, needed by the kernel constraints that run over the keys' image grid."""
        check_maps(attn, self.num_heads, type(self).__name__)
        if self.key_grid and (layout is None or layout.grid is None):
            raise ValueError(
                f"{type(self).__name__}: kernel_constraint={self.kernel_constraint!r} convolves over the keys' "
                "image grid; pass layout=TokenLayout(grid=(H, W), num_prefix=...)"
            )
        if self.fast_path_applies(attn):
            return self._folded(attn, post)
        out = attn
        for stage in (self.expand, self.local, self.reduce):
            if stage is not None and stage is self.local and self.key_grid:
                out = key_grid_conv(out, stage[0].weight, layout)
                for layer in list(stage)[1:]:  # one by one: a slice would be a new module torch.fx cannot name
                    out = layer(out)
            elif stage is not None:  # a fused expansion feeds the depth-wise conv channels-last maps, like HeadMix
                out = self._run_stage(stage, out, heads_last=stage is self.expand and self.local is not None)
        out = attn + out if self.residual else out
        if post is not None:
            out = out * post[0].view(-1, 1, 1) + post[1].view(-1, 1, 1)
        return out

    def fast_path_applies(self, attn: Tensor) -> bool:
        """Whether the folded inference path runs (it convolves over the map's plane, not the keys' grid)."""
        return not self.key_grid and can_fold(self, attn)

    @staticmethod
    def _run_stage(stage: nn.Sequential, x: Tensor, heads_last: bool) -> Tensor:
        """One stage; in training a head mix + BatchNorm runs fused (:func:`head_mix_batchnorm`: the same maps,
        a backward pass that keeps less), and the BatchNorm after the depth-wise conv normalises its
        channels-last maps as rows (:func:`batch_norm_rows`: the CPU's channels-last BatchNorm runs partly
        scalar for a channel count such as 18)."""
        if isinstance(stage[0], HeadMix) and len(stage) > 1 and can_fuse(x, stage[1]):
            x = head_mix_batchnorm(x, stage[0], stage[1], heads_last=heads_last)
            return x if len(stage) == 2 else stage[2](x)
        if len(stage) == 1:
            return stage(x)
        x, bn = stage[0](x), stage[1]
        x = batch_norm_rows(x, bn) if can_normalise_rows(x, bn) else bn(x)
        return x if len(stage) == 2 else stage[2](x)

    # ------------------------------------------------------------------ inference fast path
    # Speed (eval, no autograd): each BatchNorm is folded into the conv before it, bias + ReLU6 run in place,
    # and the stages run on a few maps at a time. The expanded maps (B, rH, N, N) are large (45 MB for
    # Refined-ViT-S at batch 8, 224 px): processed whole, every stage streams them through memory and every
    # intermediate is a fresh allocation that the kernel must fault in; chunks of ~16 MB stay in cache and are
    # reused by the allocator. The 1x1 head mixes are GEMMs over the head axis on heads-last views, so the
    # depth-wise conv gets channels-last maps (oneDNN's native layout) and the reduction writes the standard
    # (B, H, N, N) layout that ``attn @ v`` reads, with no copies in between. Same function as the modules.

    _CHUNK_BYTES = 16 << 20

    def _folded(self, attn: Tensor, post: tuple[Tensor, Tensor] | None) -> Tensor:
        b, h, n, _ = attn.shape
        stages = [None if st is None else _fold_stage(st, attn.dtype) for st in (self.expand, self.local, self.reduce)]
        if self.residual:  # a · (attn + r) + c = a·r + (a·attn + c): the residual joins the post affine
            one = attn.new_ones(self.out_heads)
            post = (one, attn.new_zeros(self.out_heads)) if post is None else post
        if post is not None and stages[2] is not None:  # fold the scale a into the reduction
            w, bias, _ = stages[2]
            a = post[0].to(attn.dtype)
            stages[2] = (w * a[:, None], (bias if bias is not None else 0) * a + post[1].to(attn.dtype), False)
        out = attn.new_empty(b, self.out_heads, n, n)
        per_sample = max(self.num_heads * self.expansion, h) * n * n * attn.element_size()
        step = max(1, self._CHUNK_BYTES // per_sample)
        for i in range(0, b, step):  # a loop over a few chunks of the batch, never over tokens
            self._folded_chunk(attn[i : i + step], out[i : i + step], stages, post)
        return out

    def _folded_chunk(self, attn: Tensor, out: Tensor, stages: list, post: tuple[Tensor, Tensor] | None) -> None:
        b, h, n, _ = attn.shape
        x = attn.reshape(b, h, n * n).transpose(1, 2)  # (b, N², H): a heads-last view
        expand, local, reduce = stages
        if expand is not None:
            x = _bias_act(torch.bmm(x, expand[0].t().expand(b, -1, -1)), expand[1], expand[2])  # (b, N², rH)
        if local is not None:
            c = x.shape[-1]
            x = x.reshape(b, n, n, c).permute(0, 3, 1, 2)  # channels-last (b, C, N, N)
            pad = self.local[0].same_pad
            x = F.conv2d(
                x if pad is None else F.pad(x, pad), local[0], local[1], padding=self.local[0].padding, groups=c
            )
            x = _bias_act(x, None, local[2]).permute(0, 2, 3, 1).reshape(b, n * n, c)
        dest = out.view(b, self.out_heads, n * n)
        if reduce is not None:
            torch.matmul(reduce[0], x.transpose(1, 2), out=dest)  # (b, H, N²)
            if reduce[1] is not None:
                dest.add_(reduce[1].view(-1, 1))
        else:
            dest.copy_(x.transpose(1, 2))
            if post is not None:
                dest.mul_(post[0].view(-1, 1)).add_(post[1].view(-1, 1))
        if self.residual:
            dest.addcmul_(attn.reshape(b, h, n * n), post[0].view(-1, 1).to(dest.dtype))

    def extra_repr(self) -> str:
        constraint = f", kernel_constraint={self.kernel_constraint!r}" if self.kernel_constraint != "none" else ""
        return f"num_heads={self.num_heads}, expansion={self.expansion}, kernel_size={self.kernel_size}{constraint}"

    def map_flops(self, batch: int, n: int) -> int:
        """Elementwise FLOPs on ``batch`` sets of (N, N) maps (expansion, conv and reduction are MACs): with
        ``official_extras``, BatchNorm + ReLU6 after the expansion and after the depth-wise conv, BatchNorm
        after the reduction, and the identity shortcut; none without."""
        if not self.residual:
            return 0
        maps = batch * n * n
        hidden = self.num_heads * self.expansion
        bn = batchnorm_flops(self.training)
        total = 0
        if self.expand is not None:
            total += (bn + RELU6) * hidden * maps
        if self.local is not None:
            total += (bn + RELU6) * hidden * maps
        if self.reduce is not None:
            total += bn * self.out_heads * maps
        return total + self.out_heads * maps  # + the input map


class RefinerAttention(Attention):
    """Multi-head attention with refined maps (Refined-ViT's token mixer).

    Normal block (``share=False``)::

        A = softmax(q kᵀ s)  [+ s · attn_prev  if residual_attention and attn_prev is given]
        A = drop(A);  A = adapt_bn(DLA(A)) if refine
        out = proj(merge_h(A_h V_h))

    Shared block (``share=True``, the official odd blocks): no q/k -- ``qkv``
    maps dim → dim and gives V only -- and ``A = adapt_bn(DLA(attn_prev)) · s``;
    ``attn_prev`` is required.

    ``aux["attn"]`` is the map multiplied with V; ``aux["carry"]`` the map to hand
    to the next block as the official code does: the (refined) map of a normal
    block. A shared block hands on the incoming ``attn_prev`` unchanged, so it
    leaves ``"carry"`` out (the caller keeps the map it has): a block that returned
    its own input would hand FSDP a view of it, which an in-place op could detach
    from the all-gather of the backward.

    ``reduction=False`` (paper Table 3 ablation: no linear reduction) leaves rH
    maps; vitlab's reading is that they multiply V split into rH heads of width
    dim / (rH), so the output width stays dim (ValueError if not divisible).
    ``adapt_bn`` (BatchNorm2d on the refined map) defaults to ``official_extras``. ``kernel_constraint``
    (``"none"``, ``"spatial"``, ``"rowcol"``) sets the DLA kernel's span (paper Table 4, Decision R4).

    The released Refined-ViT models alternate ``RefinerAttention(refine=False,
    residual_attention=True)`` (even blocks) and ``RefinerAttention(share=True,
    official_extras=True)`` (odd blocks), each block passing ``aux["carry"]`` on as
    the next block's ``attn_prev``. Official ``Refined_Attention`` weights load
    after :func:`vitlab.interop.rename_keys` (source ``"refiner"``).
    """

    uses_attn_prev = True
    flops_label = "refiner maps"

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        expansion: int = 3,
        kernel_size: int = 3,
        dla: bool = True,
        reduction: bool = True,
        official_extras: bool = False,
        adapt_bn: bool | None = None,
        share: bool = False,
        residual_attention: bool = False,
        refine: bool = True,
        kernel_constraint: str = "none",
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_scale, attn_drop, proj_drop, fused=False)
        if share and not refine:
            raise ValueError("RefinerAttention: share=True refines the previous block's map; it needs refine=True")
        self.share = share
        self.residual_attention = residual_attention
        if share:
            self.qkv = nn.Linear(dim, dim, bias=qkv_bias)  # values only: the map comes from the previous block
        self.refiner = (
            DistributedLocalAttention(
                num_heads, expansion, kernel_size, dla, reduction, official_extras, kernel_constraint
            )
            if refine
            else None
        )
        self.value_heads = self.refiner.out_heads if refine else num_heads
        self.needs_grid = refine and self.refiner.key_grid  # the constrained kernels run on the keys' image grid
        if self.value_heads != num_heads:
            check_divisible(
                f"RefinerAttention (reduction=False: V is split into {expansion}x heads)", dim, self.value_heads
            )
        use_bn = official_extras if adapt_bn is None else adapt_bn
        self.adapt_bn = nn.BatchNorm2d(self.value_heads) if refine and use_bn else None

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        """A normal block: the softmax (and ``+ s · attn_prev``); a refined map: the refiner's elementwise work,
        ``adapt_bn`` and (shared block) the scale."""
        maps = batch * self.num_heads * tokens * tokens
        total = 0
        if not self.share:
            total += attention_softmax_flops(batch, self.num_heads, tokens, tokens)
            if self.residual_attention and with_attn_prev:
                total += 2 * maps  # + s · attn_prev
        if self.refiner is not None and (with_attn_prev or not self.share):
            total += self.refiner.map_flops(batch, tokens)
            if self.adapt_bn is not None:
                total += batchnorm_flops(self.adapt_bn.training) * batch * self.value_heads * tokens * tokens
            if self.share:
                total += batch * self.value_heads * tokens * tokens  # · s
        return total

    def refine_map(self, attn: Tensor, scale: float = 1.0, layout: TokenLayout | None = None) -> Tensor:
        """``scale · adapt_bn(DLA(attn))`` (without ``adapt_bn`` unless enabled), in ``attn``'s dtype."""
        if self.refiner.fast_path_applies(attn) and can_fold(self, attn):  # adapt_bn, scale fold into the last stage
            if self.adapt_bn is not None:
                a, c = fold_bn(attn.new_ones(self.value_heads, dtype=torch.float32), None, self.adapt_bn)
            else:
                a, c = attn.new_ones(self.value_heads), attn.new_zeros(self.value_heads)
            return self.refiner(attn, post=((a * scale).to(attn.dtype), (c * scale).to(attn.dtype)))
        out = self.refiner(attn, layout=layout)
        if self.adapt_bn is not None:
            out = self.adapt_bn(out)
        out = out.to(attn.dtype)  # BN/conv may run in another precision under autocast
        return out * scale if scale != 1.0 else out

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        if attn_prev is not None:
            check_prev_map(attn_prev, x, self.num_heads, self.share or self.residual_attention)
        if self.share:
            if attn_prev is None:
                raise ValueError("RefinerAttention(share=True) reuses the previous block's map: pass attn_prev")
            v = split_heads(fused_linear(self.qkv, x), self.value_heads)
            attn = self.refine_map(attn_prev.to(v.dtype), self.scale, layout)
            carry = None  # attn_prev goes on: the caller holds it
        else:
            q, k, v = self.qkv_heads(x)
            if self.value_heads != self.num_heads:
                v = split_heads(merge_heads(v), self.value_heads)
            attn = attention_map(q, k, self.scale)
            if self.residual_attention and attn_prev is not None:  # official: added after the softmax
                prev = attn_prev.to(attn.dtype)
                attn = attn.add_(prev, alpha=self.scale) if can_fold(self, attn) else attn + self.scale * prev
            attn = self.attn_drop(attn)
            if self.refiner is not None:
                attn = self.refine_map(attn, layout=layout)
            carry = attn
        out = self.project(attn @ v)
        return out, {"attn": attn} if carry is None else {"attn": attn, "carry": carry}
