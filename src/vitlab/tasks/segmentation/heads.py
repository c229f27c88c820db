"""The decoder heads of :class:`~vitlab.tasks.segmentation.Segmenter`: EANet's head and the attention it is
compared with, all on a feature map ``(B, C_in, H, W)``::

    head(x) = Conv_1x1(Dropout2d(CBR_3x3(block(CBR_3x3(x)))))      CBR = conv-BN-ReLU; C_in -> C -> C_out -> K

``block`` is the only difference between the heads (``kind``):

* ``ea``: :class:`~vitlab.layers.ExternalAttentionConv`, EANet's external-attention block (S memory slots;
  ``ea_norm`` "double": softmax over the positions, then L1 over the slots; "softmax": the softmax only);
* ``sa``: :class:`SelfAttentionConv`, self-attention over the H*W positions (a non-local block in the EA block's
  frame): ``softmax(q k^T / sqrt(C))`` over the keys;
* ``sa_dn``: the same self-attention with the EA paper's double normalisation (softmax over the queries, then
  L1 over the keys);
* ``plain``: no block. Where the second conv keeps the width (C_out = C, the pyramid decoder) it is dropped
  with the block; where it narrows it (EANet's 512 -> 256) it stays, so every head ends at the same width.

:class:`FCNHead` is the auxiliary head mmsegmentation trains on a dilated ResNet's C4 (CBR_3x3 -> Dropout2d ->
1x1 classifier), used only for the auxiliary loss.
"""

from __future__ import annotations

from torch import Tensor, nn

from ...layers import ExternalAttentionConv
from ...layers.external import PositionMixerConv
from ...mixers import Attention
from ...mixers.attention_variants import DoubleNormAttention

HEADS = ("ea", "plain", "sa", "sa_dn")
EA_NORMS = ("double", "softmax")


def conv_bn_relu(c_in: int, c_out: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(True))


class SelfAttentionConv(PositionMixerConv):
    """Self-attention over a feature map's positions, in the frame of EANet's external-attention block::

        y   = Conv_1x1(x)                                 (with bias, as EA's first conv)
        q, k, v = y W_q, y W_k, y W_v                     (C -> C each, one head, no bias), positions as tokens
        A   = softmax_keys(q k^T / sqrt(C))               (``norm="softmax"``), or
        A   = L1_keys(softmax_queries(q k^T / sqrt(C)))   (``norm="double"``, the EA paper's double norm)
        y   = (A v) W_o
        out = ReLU(x + BN(Conv_1x1(y)))                   (the conv without bias)

    So an ``sa`` head differs from an ``ea`` head only in what replaces ``M_v(Norm(M_k y))``: the attention is
    :class:`~vitlab.mixers.Attention` / :class:`~vitlab.mixers.attention_variants.DoubleNormAttention` with one
    head (same parameters and names for both norms), in EA's frame (:class:`~vitlab.layers.external.PositionMixerConv`,
    initialised as EA's block). Its map is (H*W)^2 per image, where EA's is H*W x S.
    """

    def __init__(self, channels: int, norm: str = "softmax") -> None:
        if norm not in EA_NORMS:
            raise ValueError(f"SelfAttentionConv: norm must be one of {', '.join(EA_NORMS)}, got {norm!r}")
        kind = Attention if norm == "softmax" else DoubleNormAttention
        super().__init__(channels, lambda: kind(channels, num_heads=1, qkv_bias=False), "attn")
        self.norm = norm


def attention_block(kind: str, channels: int, memory_size: int = 64, ea_norm: str = "double") -> nn.Module:
    """The ``block`` of a head (module docstring); ``memory_size`` and ``ea_norm`` are EA's."""
    if kind == "ea":
        return ExternalAttentionConv(channels, memory_size, norm=ea_norm)
    return SelfAttentionConv(channels, "softmax" if kind == "sa" else "double")


class Head(nn.Module):
    """The decoder head (module docstring): ``kind`` one of :data:`HEADS`; widths ``in_channels`` (default
    ``channels``) -> ``channels`` -> ``out_channels`` (default ``channels``) -> ``num_classes``."""

    def __init__(self, channels: int, num_classes: int, kind: str = "ea", memory_size: int = 64,
                 ea_norm: str = "double", dropout: float = 0.1, *, in_channels: int | None = None,
                 out_channels: int | None = None) -> None:  # fmt: skip
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, got {kind!r}")
        if ea_norm not in EA_NORMS:
            raise ValueError(f"ea_norm must be one of {', '.join(EA_NORMS)}, got {ea_norm!r}")
        if memory_size < 1:
            raise ValueError(f"memory_size must be >= 1, got {memory_size}")
        c_in, c_out = in_channels or channels, out_channels or channels
        layers: list[nn.Module] = [conv_bn_relu(c_in, channels, 3)]
        if kind != "plain":
            layers.append(attention_block(kind, channels, memory_size, ea_norm))
        if kind != "plain" or c_out != channels:
            layers.append(conv_bn_relu(channels, c_out, 3))
        layers += [nn.Dropout2d(dropout), nn.Conv2d(c_out, num_classes, 1)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class FCNHead(nn.Sequential):
    """The auxiliary head: 3x3 conv-BN-ReLU ``in_channels -> channels`` -> Dropout2d -> 1x1 classifier."""

    def __init__(self, in_channels: int, channels: int, num_classes: int, dropout: float = 0.1) -> None:
        super().__init__(conv_bn_relu(in_channels, channels, 3), nn.Dropout2d(dropout),
                         nn.Conv2d(channels, num_classes, 1))  # fmt: skip
