"""Position encodings: learned tables (resampled to a new grid), fixed sinusoids, and CPVT's PEG."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mixers.base import TokenLayout, grid_residual


def resample_pos_embed(
    pos: Tensor,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int],
    num_prefix: int,
    mode: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resample a learned table ``(1, P + h*w, C)`` to another patch grid; prefix rows are kept.

    The patch rows are interpolated as a ``C``-channel image (bicubic, align_corners=False) with
    antialiasing, as timm resamples tables (its ``resample_abs_pos_embed``), so a vitlab model at another
    size computes what timm's does. The antialiased bicubic kernel (a = -0.5) differs from the plain one
    (a = -0.75) when enlarging too; DeiT's own fine-tuning script used the plain one (``antialias=False``).
    """
    if tuple(new_grid) == tuple(old_grid):
        return pos
    prefix, grid = pos[:, :num_prefix], pos[:, num_prefix:]
    c = pos.shape[-1]
    grid = grid.reshape(1, *old_grid, c).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=tuple(new_grid), mode=mode, align_corners=False, antialias=antialias)
    grid = grid.to(pos.dtype)
    return torch.cat([prefix, grid.permute(0, 2, 3, 1).reshape(1, -1, c)], dim=1)


def sincos_2d(dim: int, grid: tuple[int, int], temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D sin-cos table ``(h*w, dim)`` (MoCo v3 / MAE form): a quarter of the channels per sin/cos x row/col."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos position encoding needs dim divisible by 4, got {dim}")
    h, w = grid
    yy, xx = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    y = yy.flatten()[:, None] * omega[None]
    x = xx.flatten()[:, None] * omega[None]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).float()


def sinusoid_1d(num_positions: int, dim: int) -> Tensor:
    """Transformer sinusoid table ``(num_positions, dim)``: sin on even, cos on odd channels (T2T-ViT's encoding)."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    i = torch.arange(dim, dtype=torch.float64)[None]
    angle = pos / torch.pow(10000.0, 2 * torch.div(i, 2, rounding_mode="floor") / dim)
    table = torch.where(i.long() % 2 == 0, angle.sin(), angle.cos())
    return table.float()


#: the forms of CPVT's PEG the paper compares (docs/semantics.md, Decision C2)
PEG_KINDS = ("dw", "separable", "fc")
PEG_PADDINGS = ("zero", "circular", "replicate")


class PositionEncodingGenerator(nn.Module):
    """CPVT's PEG (Chu et al., Algorithm 1): ``x + F(x)`` over the patch grid; by default ``F`` is one depth-wise
    k×k conv with bias and zero padding k//2.

    The conditional encoding comes from the zero padding at the borders; prefix
    tokens (class token) skip the convolution and are re-attached unchanged.
    Works at any grid size, which is why CPVT needs no position table.

    The paper's ablations (Decision C2): ``kind="separable"`` makes ``F`` a stack of ``layers`` depth-wise k×k +
    point-wise 1×1 convolutions (``d·l·k² + l·d²`` weights), ``kind="fc"`` a stack of ``layers`` token-wise
    Linear maps (1×1 convolutions, no locality); ``padding="circular"`` / ``"replicate"`` pads the grid by
    wrapping around / repeating the border instead of with zeros; ``frozen=True`` keeps the random initial
    weights (no gradient). There is no nonlinearity inside ``F``.
    """

    def __init__(
        self,
        dim: int,
        kernel_size: int = 3,
        kind: str = "dw",
        layers: int = 1,
        padding: str = "zero",
        frozen: bool = False,
    ) -> None:
        super().__init__()
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"PEG kernel size must be odd (zero padding k//2 keeps the grid), got {kernel_size}")
        if kind not in PEG_KINDS or padding not in PEG_PADDINGS or layers < 1:
            raise ValueError(
                f"PEG: kind must be one of {PEG_KINDS}, padding one of {PEG_PADDINGS} and layers >= 1; "
                f"got kind={kind!r}, padding={padding!r}, layers={layers}"
            )
        k = 1 if kind == "fc" else kernel_size
        self.pad = (k // 2,) * 4 if padding != "zero" and k > 1 else None
        self.padding_mode = padding
        if kind == "dw" and layers == 1:
            self.proj = self._depthwise(dim, k)  # the official single conv (Twins' PosCNN ``proj.0``)
        else:
            convs: list[nn.Module] = []
            for _ in range(layers):
                convs += [self._depthwise(dim, k)] if kind != "fc" else []
                convs += [nn.Conv2d(dim, dim, 1)] if kind != "dw" else []
            self.proj = nn.Sequential(*convs)
        if frozen:
            self.proj.requires_grad_(False)

    def _depthwise(self, dim: int, k: int) -> nn.Conv2d:
        conv = nn.Conv2d(dim, dim, k, 1, k // 2 if self.pad is None else 0, groups=dim)
        # Twins initialises the PEG conv as a conv layer: normal(0, sqrt(2 / fan_out))
        nn.init.normal_(conv.weight, 0.0, math.sqrt(2.0 / k**2))  # fan_out of a depth-wise conv
        nn.init.zeros_(conv.bias)
        return conv

    def transform(self, grid: Tensor) -> Tensor:
        """``F`` on a ``(B, C, H, W)`` grid; non-zero padding is applied before each depth-wise conv."""
        if self.pad is None:
            return self.proj(grid)
        for layer in self.proj if isinstance(self.proj, nn.Sequential) else [self.proj]:
            if layer.groups > 1:
                grid = F.pad(grid, self.pad, mode=self.padding_mode)
            grid = layer(grid)
        return grid

    def forward(self, x: Tensor, layout: TokenLayout) -> Tensor:
        return grid_residual(x, layout, self.transform)
