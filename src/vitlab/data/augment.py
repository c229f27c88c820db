"""RandAugment (Cubuk et al. 2020) on float batches in ``[0, 1]``, vectorised over the batch.

The op set and magnitude mapping follow timm's "increasing" RandAugment used by DeiT
(``rand-m9-mstd0.5-inc1``): every op gets stronger as the magnitude M in [0, 10] grows; signed ops
(rotate, shear, translate, colour factors) take a random sign. Each of the ``num_ops`` layers picks one op
per sample and applies it with probability ``prob``. Pixel ops work on 8-bit levels as PIL does; geometric
ops use one ``affine_grid``/``grid_sample`` about the image centre (PIL shears about the corner) with a
constant ``fill``.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor


def uniform(n: int, g: torch.Generator | None) -> Tensor:
    """``n`` draws of U(0, 1) from ``g`` on the generator's device (the CPU without one): the per-sample
    parameters of every random transform come from here."""
    return torch.rand(n, generator=g, device=g.device if g is not None else "cpu")


def gray(x: Tensor) -> Tensor:
    if x.shape[1] == 1:
        return x
    w = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x * w).sum(1, keepdim=True)


def blend(degenerate: Tensor | float, x: Tensor, factor: Tensor) -> Tensor:
    """PIL ImageEnhance: ``degenerate + factor * (x - degenerate)``, clipped."""
    return (degenerate + factor.view(-1, 1, 1, 1) * (x - degenerate)).clamp_(0, 1)


def _levels(x: Tensor) -> Tensor:
    return (x * 255).round().clamp(0, 255)


def _factor(m: Tensor, s: Tensor) -> Tensor:  # timm _enhance_increasing_level_to_arg
    return (1 + 0.9 * m * s).clamp(min=0.1)


def auto_contrast(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    lo, hi = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    scale = torch.where(hi > lo, 1 / (hi - lo).clamp(min=1e-8), torch.ones_like(hi))
    return torch.where(hi > lo, (x - lo) * scale, x).clamp(0, 1)


def equalize(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    """PIL ImageOps.equalize per channel: ``lut[i] = (step // 2 + cdf[i - 1]) // step``."""
    b, c, h, w = x.shape
    q = _levels(x).long().view(b * c, h * w)
    hist = torch.zeros(b * c, 256, dtype=torch.long, device=x.device).scatter_add_(1, q, torch.ones_like(q))
    last = 255 - (hist > 0).flip(1).int().argmax(1)  # highest level present
    step = (h * w - hist.gather(1, last[:, None])[:, 0]) // 255
    cdf_prev = hist.cumsum(1) - hist
    lut = ((step[:, None] // 2 + cdf_prev) // step.clamp(min=1)[:, None]).clamp(max=255)
    out = lut.gather(1, q).to(x.dtype) / 255
    return torch.where((step > 0)[:, None], out, x.reshape(b * c, h * w)).view(b, c, h, w)


def invert(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    return 1 - x


def posterize(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    shift = (8 - (4 - (m * 4).floor().long())).view(-1, 1, 1, 1)  # keep 4 - int(4 M/10) bits
    return ((_levels(x).long() >> shift) << shift).to(x.dtype) / 255


def solarize(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    v, thresh = _levels(x), (256 - (m * 256).floor()).view(-1, 1, 1, 1)
    return torch.where(v >= thresh, 255 - v, v) / 255


def solarize_add(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    v, add = _levels(x), (m * 110).floor().view(-1, 1, 1, 1)
    return torch.where(v < 128, (v + add).clamp(max=255), v) / 255


def color(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    return blend(gray(x), x, _factor(m, s))


def contrast(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    return blend(gray(x).mean((1, 2, 3), keepdim=True), x, _factor(m, s))


def brightness(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    return blend(0.0, x, _factor(m, s))


def sharpness(x: Tensor, m: Tensor, s: Tensor) -> Tensor:
    c = x.shape[1]
    k = torch.tensor([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=x.dtype, device=x.device) / 13
    smooth = x.clone()  # PIL leaves the one-pixel border unfiltered
    smooth[..., 1:-1, 1:-1] = F.conv2d(x, k.expand(c, 1, 3, 3), groups=c)
    return blend(smooth, x, _factor(m, s))


def warp(x: Tensor, a: Tensor, t: Tensor, fill: float) -> Tensor:
    """Sample input at ``a @ p + t`` for each output pixel offset ``p`` from the centre (pixel units),
    bilinear; pixels from outside the image get ``fill``."""
    h, w = x.shape[-2:]
    S = torch.tensor([w / 2, h / 2], dtype=x.dtype, device=x.device)
    theta = torch.cat([a * S[None, None, :] / S[None, :, None], (t / S)[..., None]], 2)
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    # an extra channel of ones tells, after sampling, how much of each pixel came from inside the image
    out = F.grid_sample(torch.cat([x, torch.ones_like(x[:, :1])], 1), grid, align_corners=False)
    return out[:, :-1] + fill * (1 - out[:, -1:])


def _eye(m: Tensor) -> tuple[Tensor, Tensor]:
    return torch.eye(2, dtype=m.dtype, device=m.device).repeat(len(m), 1, 1), m.new_zeros(len(m), 2)


# geometric ops give the affine map (a, t) of ``warp`` for magnitudes m, signs s and image size (h, w)
def rotate(m: Tensor, s: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
    r = torch.deg2rad(30 * m * s)  # PIL's rotate: counter-clockwise for positive angles
    cos, sin = torch.cos(r), torch.sin(r)
    return torch.stack([torch.stack([cos, -sin], 1), torch.stack([sin, cos], 1)], 1), m.new_zeros(len(m), 2)


def _shear(axis: int):
    def op(m: Tensor, s: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
        a, t = _eye(m)
        a[:, axis, 1 - axis] = 0.3 * m * s
        return a, t

    return op


def _translate(axis: int):
    def op(m: Tensor, s: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
        a, t = _eye(m)
        t[:, axis] = 0.45 * m * s * (w if axis == 0 else h)  # a fraction of the image side
        return a, t

    return op


def apply_geometric(name: str, x: Tensor, m: Tensor, s: Tensor, fill: float = 0.5) -> Tensor:
    return warp(x, *GEOMETRIC_OPS[name](m, s, *x.shape[-2:]), fill)


PIXEL_OPS = {
    "AutoContrast": auto_contrast, "Equalize": equalize, "Invert": invert, "Posterize": posterize,
    "Solarize": solarize, "SolarizeAdd": solarize_add, "Color": color, "Contrast": contrast,
    "Brightness": brightness, "Sharpness": sharpness,
}  # fmt: skip
GEOMETRIC_OPS = {
    "Rotate": rotate, "ShearX": _shear(0), "ShearY": _shear(1), "TranslateX": _translate(0),
    "TranslateY": _translate(1),
}  # fmt: skip
ALL_OPS = [*PIXEL_OPS, *GEOMETRIC_OPS]


class RandAugment:
    """``num_ops`` layers of (op chosen uniformly per sample, applied with probability ``prob``), magnitude
    ``N(magnitude, magnitude_std)`` clipped to [0, 10] per sample and layer.
    """

    def __init__(
        self,
        num_ops: int = 2,
        magnitude: float = 9,
        magnitude_std: float = 0.5,
        prob: float = 0.5,
        ops: list[str] | None = None,
        fill: float = 0.5,
    ) -> None:
        unknown = set(ops or []) - set(ALL_OPS)
        if unknown or not 0 <= magnitude <= 10:
            raise ValueError(
                f"RandAugment: ops must be among {ALL_OPS} and 0 <= magnitude <= 10, got {ops}, {magnitude}"
            )
        self.num_ops, self.magnitude, self.magnitude_std, self.prob = num_ops, magnitude, magnitude_std, prob
        self.ops, self.fill = list(ops or ALL_OPS), fill

    @classmethod
    def from_spec(cls, spec: str) -> RandAugment:
        """timm-style spec ``rand-m9-n2-mstd0.5[-p0.5][-inc1]`` (inc is implied: ops are all increasing)."""
        parts = spec.split("-")
        if parts[0] != "rand":
            raise ValueError(f"auto_augment spec must look like 'rand-m9-n2-mstd0.5', got {spec!r}")
        keys = {"m": "magnitude", "n": "num_ops", "mstd": "magnitude_std", "p": "prob"}
        kw = {}
        for part in parts[1:]:
            match = re.fullmatch(r"([a-z]+)([0-9.]+)", part)
            if not match or match[1] not in (*keys, "inc"):
                raise ValueError(f"auto_augment spec {spec!r}: unknown part {part!r} (known: m, n, mstd, p, inc)")
            if match[1] != "inc":
                kw[keys[match[1]]] = int(match[2]) if match[1] == "n" else float(match[2])
        return cls(**kw)

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        B = x.shape[0]
        for _ in range(self.num_ops):
            # draw everything up front so the stream of random numbers never depends on the images
            op = (uniform(B, g) * len(self.ops)).long().clamp(max=len(self.ops) - 1)
            on = uniform(B, g) < self.prob
            mag = self.magnitude + self.magnitude_std * torch.randn(B, generator=g, device=op.device)
            if self.magnitude_std <= 0:
                mag.fill_(self.magnitude)
            mag = (mag.clamp(0, 10) / 10).to(x)
            sign = torch.where(uniform(B, g) < 0.5, -1.0, 1.0).to(x)
            out = x.clone()
            a, t = _eye(mag)
            geo = torch.zeros_like(on)
            for k, name in enumerate(self.ops):
                sel = (op == k) & on
                if not sel.any():
                    continue
                idx = torch.nonzero(sel)[:, 0].to(x.device)
                if name in PIXEL_OPS:
                    out[idx] = PIXEL_OPS[name](x[idx], mag[idx], sign[idx])
                else:  # collect the affine maps; one warp below serves all geometric ops
                    a[idx], t[idx] = GEOMETRIC_OPS[name](mag[idx], sign[idx], *x.shape[-2:])
                    geo |= sel
            if geo.any():
                idx = torch.nonzero(geo)[:, 0].to(x.device)
                out[idx] = warp(x[idx], a[idx], t[idx], self.fill)
            x = out
        return x

    def __repr__(self) -> str:
        return (
            f"RandAugment(num_ops={self.num_ops}, magnitude={self.magnitude}, "
            f"magnitude_std={self.magnitude_std}, prob={self.prob}, ops={len(self.ops)})"
        )
