"""EANet's external-attention module for CNN feature maps (Guo et al. 2021, the segmentation head's block).

On a feature map ``x`` (B, C, H, W)::

    y = Conv_1×1(x)                              (with bias)
    y = M_v(DoubleNorm(M_k(y)))                  external attention over the H·W positions (paper Algorithm 1)
    out = ReLU(x + BN(Conv_1×1(y)))              (the conv without bias)

The external attention is :class:`vitlab.mixers.ExternalAttention` on the positions as tokens (S = 64 memory
slots, memories without bias, ``M_v`` initialised as ``M_kᵀ``). The official module's memories are 1-D
convolutions (``linear_0``, ``linear_1``); :mod:`vitlab.interop` (source ``eanet``) loads them.

The frame around the attention (:class:`PositionMixerConv`) takes any token mixer over the positions: the
segmentation heads put self-attention in it, so that the heads compared differ in the mixer only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor, nn

from ..mixers import ExternalAttention


class PositionMixerConv(nn.Module):
    """EANet's block frame around a token mixer over a feature map's positions (module docstring, with
    ``mixer`` in place of the external attention): ``ReLU(x + BN(Conv_1x1(mixer(Conv_1x1(x)))))``.

    ``make_mixer()`` builds the mixer (after the first conv, so the initial weights follow EANet's order of
    construction); it is kept under ``name`` (``ea``: the official layout of the state dict). Convolutions are
    initialised as the official code: normal(0, sqrt(2 / (k·k·C_out))), BatchNorm (1, 0).
    """

    def __init__(self, channels: int, make_mixer: Callable[[], nn.Module], name: str = "mixer") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.mixer_name = name
        self.add_module(name, make_mixer())
        self.conv2 = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels))
        self.act = nn.ReLU(inplace=True)
        self.channels = channels
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels)))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.channels:
            raise ValueError(
                f"{type(self).__name__}: expected a feature map (B, {self.channels}, H, W), got {tuple(x.shape)}"
            )
        b, c, h, w = x.shape
        y = self.conv1(x).flatten(2).transpose(1, 2)  # (B, H·W, C): the positions are the tokens
        y = getattr(self, self.mixer_name)(y).transpose(1, 2).reshape(b, c, h, w)
        return self.act(x + self.conv2(y))


class ExternalAttentionConv(PositionMixerConv):
    """EANet's ``External_attention`` block: 1×1 conv → external attention → 1×1 conv + BatchNorm → + x → ReLU.

    Initialised as the official code (:class:`PositionMixerConv`), then the memories' ``M_v = M_kᵀ`` (as a copy:
    the two train independently, docs/semantics.md Decision E1).
    """

    def __init__(self, channels: int, memory_size: int = 64, norm: str = "double") -> None:
        super().__init__(channels, lambda: ExternalAttention(channels, memory_size=memory_size, norm=norm), "ea")
        self.ea.reset_parameters()
