"""Position encodings of DETR's encoder feature map, the switch ``pos = "sine" | "learned" | "peg" | "none"``.

The map is ``(B, d, H, W)`` with its padding mask ``(B, H, W)`` (True on padding). ``"sine"`` and ``"learned"``
give a ``(B, d, H, W)`` encoding that DETR adds to the queries and keys of every attention reading the map (the
encoder's self-attention, the keys of the decoder's cross-attention), never to the values.

``"sine"`` (DETR's ``PositionEmbeddingSine``, normalised): the coordinates count the non-padded pixels only, so
an image's encoding is the same whatever padding its batch adds::

    ŷ(i, j) = Σ_{i' <= i} [not pad(i', j)],   x̂(i, j) = Σ_{j' <= j} [not pad(i, j')]
    y       = 2π · ŷ / (ŷ(H-1, j) + ε),       x = 2π · x̂ / (x̂(i, W-1) + ε)         (ε = 1e-6)
    ω_k     = T^(-2⌊k/2⌋ / F),  k = 0 .. F-1,  F = d / 2,  T = 10000
    PE_y(k) = sin(y ω_k) (k even), cos(y ω_k) (k odd);  PE_x alike;  PE = [PE_y ; PE_x]    (d channels)

``"learned"`` (DETR's ``PositionEmbeddingLearned``): ``PE(i, j) = [col(j) ; row(i)]``, two learned tables of 50
rows of d / 2 (uniform init); the padding is not consulted, and maps wider or taller than 50 are refused.

``"peg"`` (CPVT's PEG for detection, Chu et al. 2021): no encoding is added anywhere; instead, after the first
encoder layer (CPVT: position 0 is best), the map is conditioned on its neighbourhood::

    x'  = x with padded positions set to 0
    out = x + ReLU(BN(DWConv_3x3(x')))     at non-padded positions
    out = x                                 at padded positions

Zeroing before the convolution (our choice; CPVT's module keeps padded inputs as they are) makes a padded
position look exactly like the convolution's own zero border: the non-padded outputs depend on the non-padded
inputs only, as DETR's masked attention does, and an image's features do not change with its batch's padding.
BatchNorm's batch statistics count every position, padded ones included (as CPVT's module does); they too see
only the zeroed values, so they depend on the non-padded inputs only.

``"none"``: no position information at all (CPVT's DETR experiment: 33.7 AP with sine drops to 32.8; PEG gives 33.9).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

POSITIONS = ("sine", "learned", "peg", "none")
LEARNED_SIZE = 50  # DETR's tables: maps up to 50 x 50 (1600 x 1600 px at stride 32)


def sine_position(mask: Tensor, dim: int, temperature: float = 10000.0, eps: float = 1e-6) -> Tensor:
    """DETR's normalised 2-D sine encoding ``(B, dim, H, W)`` of a padding mask ``(B, H, W)`` (True on padding;
    module docstring). ``dim`` must be a multiple of 4 (sine and cosine pairs on each axis)."""
    valid = (~mask).float()
    y, x = valid.cumsum(1), valid.cumsum(2)
    y, x = 2 * math.pi * y / (y[:, -1:] + eps), 2 * math.pi * x / (x[:, :, -1:] + eps)
    f = dim // 2
    omega = temperature ** (-2 * (torch.arange(f, device=mask.device) // 2) / f)

    def encode(t: Tensor) -> Tensor:
        a = t[..., None] * omega
        return torch.stack((a[..., 0::2].sin(), a[..., 1::2].cos()), -1).flatten(-2)  # sin, cos interleaved

    return torch.cat((encode(y), encode(x)), -1).permute(0, 3, 1, 2)


class SinePosition(nn.Module):
    """:func:`sine_position` as a module: ``forward(mask) -> (B, dim, H, W)``."""

    def __init__(self, dim: int, temperature: float = 10000.0) -> None:
        super().__init__()
        if dim % 4:
            raise ValueError(f"pos=sine needs d_model divisible by 4 (sin/cos pairs per axis), got {dim}")
        self.dim, self.temperature = dim, temperature

    def forward(self, mask: Tensor) -> Tensor:
        return sine_position(mask, self.dim, self.temperature)


class LearnedPosition(nn.Module):
    """Learned row and column tables (module docstring): ``forward(mask) -> (B, dim, H, W)``."""

    def __init__(self, dim: int, size: int = LEARNED_SIZE) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"pos=learned needs an even d_model (half for rows, half for columns), got {dim}")
        self.row, self.col = nn.Embedding(size, dim // 2), nn.Embedding(size, dim // 2)
        nn.init.uniform_(self.row.weight)
        nn.init.uniform_(self.col.weight)
        self.size = size

    def forward(self, mask: Tensor) -> Tensor:
        B, H, W = mask.shape
        if max(H, W) > self.size:
            raise ValueError(f"pos=learned has {self.size} rows/columns, the feature map is {H}x{W}; use pos=sine")
        col = self.col.weight[:W][None].expand(H, -1, -1)
        row = self.row.weight[:H][:, None].expand(-1, W, -1)
        return torch.cat((col, row), -1).permute(2, 0, 1)[None].expand(B, -1, -1, -1)


class PEGDetection(nn.Module):
    """CPVT's position encoding generator for detection, mask-aware (module docstring):
    ``forward(x (B, C, H, W), mask (B, H, W) | None) -> (B, C, H, W)``."""

    def __init__(self, dim: int, kernel_size: int = 3) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size, 1, kernel_size // 2, groups=dim, bias=False),
            nn.BatchNorm2d(dim),
            nn.ReLU(),
        )

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return x + self.proj(x)
        pad = mask[:, None]
        return torch.where(pad, x, x + self.proj(x.masked_fill(pad, 0.0)))


def build_position(kind: str, dim: int) -> nn.Module | None:
    """The encoding added to queries and keys for ``kind`` (module docstring): a module ``mask -> (B, dim, H, W)``
    for "sine" / "learned", None for "peg" (a layer of the encoder instead) and "none"."""
    if kind not in POSITIONS:
        raise ValueError(f"pos must be one of {', '.join(POSITIONS)}, got {kind!r}")
    return {"sine": SinePosition, "learned": LearnedPosition}[kind](dim) if kind in ("sine", "learned") else None


__all__ = ["LEARNED_SIZE", "POSITIONS", "LearnedPosition", "PEGDetection", "SinePosition", "build_position",
           "sine_position"]  # fmt: skip
