"""A SAGAN-style GAN for small images (Zhang et al. 2019, Self-Attention Generative Adversarial Networks), with
its attention layer a switch: SAGAN's self-attention (``"sa"``), external attention in its place (``"ea"``:
External Attention's image-generation row, Guo et al. 2021) or none (``"none"``).

Generator: z ~ N(0, I) (``z_dim``) → Linear → C x 4 x 4 → residual up-blocks (x2 each) to the image size →
BatchNorm, ReLU, 3x3 conv → tanh. Discriminator: residual down-blocks (/2 each) to 4 x 4 → ReLU → sum over the
positions → Linear → one logit. Both have the attention layer on the feature map of half the image size (16 x 16
for 32 x 32 images, where SAGAN's CIFAR-sized models put it) and spectral normalisation on every weight
(SAGAN: in G and D). Widths are rows of :data:`GAN_SIZES` (one width C through each network, as SNGAN's CIFAR
models).

The attention layer, on the positions of a (B, C, H, W) map as N = H·W tokens, is SAGAN's residual form
``y = x + γ·o`` with a learned scalar γ starting at 0 (the network starts as its plain-conv form):

    sa:  f = W_f x, g = W_g x (C/8 channels), h = W_h x (C/2)
         β_ij = softmax_j(f_iᵀ g_j),  o_i = W_o Σ_j β_ij h_j
    ea:  t = W_i x;  α = DoubleNorm(M_k t) (softmax over the positions, ℓ1 over S memory slots)
         o = W_o (M_v α)                          (:class:`vitlab.mixers.ExternalAttention`, S = 64)

Losses (hinge, as SAGAN): ``L_D = E_x[max(0, 1 − D(x))] + E_z[max(0, 1 + D(G(z)))]``, ``L_G = −E_z[D(G(z))]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

from ...mixers import ExternalAttention

ATTENTIONS = ("sa", "ea", "none")
#: widths: z_dim, the generator's and the discriminator's channels C (paper: SNGAN / SAGAN's CIFAR-10 models)
GAN_SIZES: dict[str, dict[str, int]] = {
    "paper": dict(z_dim=128, g_channels=256, d_channels=128),
    "mini": dict(z_dim=64, g_channels=64, d_channels=64),
}


def sn_conv(c_in: int, c_out: int, k: int = 3) -> nn.Module:
    return spectral_norm(nn.Conv2d(c_in, c_out, k, padding=k // 2))


class SelfAttention2d(nn.Module):
    """SAGAN's self-attention over the positions of a feature map (module docstring, ``sa``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        if channels < 8:
            raise ValueError(f"SAGAN's self-attention needs at least 8 channels (C/8 for its keys), got {channels}")
        self.f = spectral_norm(nn.Conv2d(channels, channels // 8, 1, bias=False))
        self.g = spectral_norm(nn.Conv2d(channels, channels // 8, 1, bias=False))
        self.h = spectral_norm(nn.Conv2d(channels, channels // 2, 1, bias=False))
        self.out = spectral_norm(nn.Conv2d(channels // 2, channels, 1, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        f, g, h = (m(x).flatten(2) for m in (self.f, self.g, self.h))  # (B, c, N)
        beta = torch.softmax(f.transpose(1, 2) @ g, dim=-1)  # β_ij: row i over the positions j
        o = (h @ beta.transpose(1, 2)).view(x.shape[0], -1, *x.shape[2:])  # o_i = Σ_j β_ij h_j
        return self.out(o)


class ExternalAttention2d(nn.Module):
    """External attention over the positions of a feature map (module docstring, ``ea``): the memories are
    :class:`~vitlab.mixers.ExternalAttention`'s (``M_v = M_kᵀ`` at init), spectrally normalised as every other
    weight of a SAGAN."""

    def __init__(self, channels: int, memory_size: int = 64) -> None:
        super().__init__()
        self.inp = spectral_norm(nn.Conv2d(channels, channels, 1, bias=False))
        self.ea = ExternalAttention(channels, memory_size=memory_size)  # M_v = M_kᵀ: before the reparametrisation
        spectral_norm(self.ea.mk)
        spectral_norm(self.ea.mv)
        self.out = spectral_norm(nn.Conv2d(channels, channels, 1, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        t = self.inp(x).flatten(2).transpose(1, 2)  # (B, N, C): the positions are the tokens
        return self.out(self.ea(t).transpose(1, 2).reshape(b, c, h, w))


class Attention2d(nn.Module):
    """``y = x + γ·o(x)``, γ a learned scalar from 0; ``kind`` in :data:`ATTENTIONS` (``"none"``: identity)."""

    def __init__(self, kind: str, channels: int, memory_size: int = 64) -> None:
        super().__init__()
        if kind not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {kind!r}")
        self.kind = kind
        self.attn: nn.Module | None = None
        if kind == "sa":
            self.attn = SelfAttention2d(channels)
        elif kind == "ea":
            self.attn = ExternalAttention2d(channels, memory_size)
        self.gamma = nn.Parameter(torch.zeros(())) if self.attn is not None else None

    def forward(self, x: Tensor) -> Tensor:
        return x if self.attn is None else x + self.gamma * self.attn(x)


class UpBlock(nn.Module):
    """BN → ReLU → x2 (nearest) → 3x3 → BN → ReLU → 3x3, plus the upsampled input through a 1x1 conv."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(c_in), nn.BatchNorm2d(c_out)
        self.conv1, self.conv2, self.skip = sn_conv(c_in, c_out), sn_conv(c_out, c_out), sn_conv(c_in, c_out, 1)

    def forward(self, x: Tensor) -> Tensor:
        up = F.interpolate(x, scale_factor=2, mode="nearest")
        y = self.conv1(F.interpolate(F.relu(self.bn1(x)), scale_factor=2, mode="nearest"))
        return self.skip(up) + self.conv2(F.relu(self.bn2(y)))


class DownBlock(nn.Module):
    """(ReLU →) 3x3 → ReLU → 3x3 → /2 (average), plus the input through a 1x1 conv and /2; the first block takes
    the image itself (no ReLU in front, pooled before its 1x1 conv: SNGAN's optimised block)."""

    def __init__(self, c_in: int, c_out: int, first: bool = False) -> None:
        super().__init__()
        self.first = first
        self.conv1, self.conv2, self.skip = sn_conv(c_in, c_out), sn_conv(c_out, c_out), sn_conv(c_in, c_out, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv2(F.relu(self.conv1(x if self.first else F.relu(x))))
        skip = self.skip(F.avg_pool2d(x, 2)) if self.first else F.avg_pool2d(self.skip(x), 2)
        return F.avg_pool2d(y, 2) + skip


def check_size(img_size: int) -> int:
    """The number of x2 stages between 4 x 4 and ``img_size`` (a power of two >= 8)."""
    stages = int(math.log2(img_size / 4)) if img_size >= 8 else 0
    if stages < 1 or 4 * 2**stages != img_size:
        raise ValueError(f"img_size must be a power of two >= 8 (4 x 4 doubled), got {img_size}")
    return stages


class Generator(nn.Module):
    """z (B, z_dim) → images (B, out_chans, img_size, img_size) in [-1, 1] (module docstring)."""

    def __init__(
        self, z_dim: int = 128, channels: int = 256, img_size: int = 32, out_chans: int = 3, attention: str = "sa"
    ) -> None:
        super().__init__()
        stages = check_size(img_size)
        self.z_dim, self.channels = z_dim, channels
        self.fc = spectral_norm(nn.Linear(z_dim, channels * 16))
        blocks: list[nn.Module] = []
        for i in range(stages):
            blocks.append(UpBlock(channels, channels))
            if i == max(stages - 2, 0):  # on the map of half the image size (8-px images: of 8 px)
                blocks.append(Attention2d(attention, channels))
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(), sn_conv(channels, out_chans), nn.Tanh())

    def forward(self, z: Tensor) -> Tensor:
        return self.out(self.blocks(self.fc(z).view(len(z), self.channels, 4, 4)))

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` images from z ~ N(0, I) (drawn on the model's device)."""
        p = next(self.parameters())
        return self(torch.randn(n, self.z_dim, generator=generator, device=p.device, dtype=p.dtype))


class Discriminator(nn.Module):
    """images (B, in_chans, img_size, img_size) → logits (B,) (module docstring)."""

    def __init__(self, channels: int = 128, img_size: int = 32, in_chans: int = 3, attention: str = "sa") -> None:
        super().__init__()
        stages = check_size(img_size)
        blocks: list[nn.Module] = []
        for i in range(stages):
            blocks.append(DownBlock(in_chans if i == 0 else channels, channels, first=i == 0))
            if i == 0:  # after the first block: the map of half the image size
                blocks.append(Attention2d(attention, channels))
        self.blocks = nn.Sequential(*blocks)
        self.fc = spectral_norm(nn.Linear(channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(F.relu(self.blocks(x)).sum(dim=(2, 3))).squeeze(1)


def build_gan(
    size: str = "mini", img_size: int = 32, chans: int = 3, attention: str = "sa", **widths: int
) -> tuple[Generator, Discriminator]:
    """The generator and discriminator of a :data:`GAN_SIZES` row (``widths`` override its entries)."""
    if size not in GAN_SIZES:
        raise ValueError(f"size must be one of {', '.join(GAN_SIZES)}, got {size!r}")
    w = {**GAN_SIZES[size], **widths}
    g = Generator(w["z_dim"], w["g_channels"], img_size, chans, attention)
    return g, Discriminator(w["d_channels"], img_size, chans, attention)


def d_hinge_loss(real_logits: Tensor, fake_logits: Tensor) -> Tensor:
    """``E[max(0, 1 − D(x))] + E[max(0, 1 + D(G(z)))]``."""
    return F.relu(1 - real_logits).mean() + F.relu(1 + fake_logits).mean()


def g_hinge_loss(fake_logits: Tensor) -> Tensor:
    """``−E[D(G(z))]``."""
    return -fake_logits.mean()
