"""Batch transforms on float image tensors ``(B, C, H, W)`` in ``[0, 1]`` (normalised after ``Normalize``).

Each transform is a callable ``t(x, g=None) -> x`` that draws its per-sample parameters from the
``torch.Generator`` ``g`` (on the CPU; only small parameter tensors move to ``x.device``), so a batch's
augmentation is a pure function of the generator state, on any device. No Python loop over samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .augment import blend, gray, uniform
from .geometry import CropSpec, cut_crop, eval_geometry, resized_crop_boxes, sample_boxes

Size = int | tuple[int, int]
Transform = Callable[..., Tensor]
_MODES = ("nearest", "bilinear", "bicubic")


def _pair(size: Size) -> tuple[int, int]:
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    if h <= 0 or w <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    return int(h), int(w)


def _check_batch(x: Tensor, name: str) -> None:
    if x.ndim != 4 or not x.is_floating_point():
        raise ValueError(f"{name} expects a float batch (B, C, H, W), got {x.dtype} {tuple(x.shape)}")


def _check_mode(mode: str) -> str:
    if mode not in _MODES:
        raise ValueError(f"interpolation must be one of {_MODES}, got {mode!r}")
    return mode


def _noise_like(x: Tensor, g: torch.Generator | None) -> Tensor:
    """Standard normal noise shaped like ``x``, drawn on ``x.device`` from a generator derived from ``g``."""
    if g is not None and g.device != x.device:
        seed = int(torch.randint(2**62, (1,), generator=g, device=g.device))
        g = torch.Generator(x.device).manual_seed(seed)
    return torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)


def resize(x: Tensor, size: Size, interpolation: str = "bilinear", antialias: bool = True) -> Tensor:
    """Resize a batch (e.g. to evaluate at another input size); antialiased when shrinking."""
    _check_batch(x, "resize")
    size, mode = _pair(size), _check_mode(interpolation)
    if tuple(x.shape[-2:]) == size:
        return x
    if mode == "nearest":
        return F.interpolate(x, size=size, mode=mode)
    return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=antialias)


def box_mask(top: Tensor, left: Tensor, h: Tensor, w: Tensor, height: int, width: int) -> Tensor:
    """Bool mask ``(B, 1, H, W)``, True inside each sample's box."""
    rows = torch.arange(height, device=top.device)
    cols = torch.arange(width, device=top.device)
    r = (rows >= top[:, None]) & (rows < (top + h)[:, None])
    c = (cols >= left[:, None]) & (cols < (left + w)[:, None])
    return (r[:, :, None] & c[:, None, :])[:, None]


class RandomCrop:
    """Zero-pad by ``padding`` then crop ``size`` at a uniform random offset per sample."""

    def __init__(self, size: Size, padding: int = 0) -> None:
        self.size, self.padding = _pair(size), int(padding)

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        _check_batch(x, "RandomCrop")
        B, C, H, W = x.shape
        (th, tw), p = self.size, self.padding
        if H + 2 * p < th or W + 2 * p < tw:
            raise ValueError(f"RandomCrop: crop {self.size} is larger than the padded image {(H + 2 * p, W + 2 * p)}")
        top = (uniform(B, g) * (H + 2 * p - th + 1)).long().to(x.device)
        left = (uniform(B, g) * (W + 2 * p - tw + 1)).long().to(x.device)
        # one gather over the flattened padded image (much faster than 3-D advanced indexing)
        rows = top[:, None] + torch.arange(th, device=x.device)
        cols = left[:, None] + torch.arange(tw, device=x.device)
        flat = (rows[:, :, None] * (W + 2 * p) + cols[:, None, :]).view(B, 1, th * tw).expand(-1, C, -1)
        return F.pad(x, (p, p, p, p)).flatten(2).gather(2, flat).view(B, C, th, tw)

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, padding={self.padding})"


class RandomResizedCrop:
    """Crop a random box (area fraction in ``scale``, aspect in ``ratio``) and resample it to ``size``."""

    def __init__(
        self,
        size: Size,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        interpolation: str = "bilinear",
    ) -> None:
        if not (0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"RandomResizedCrop: need 0 < scale <= 1 and 0 < ratio ascending, got {scale}, {ratio}")
        self.size, self.scale, self.ratio = _pair(size), tuple(scale), tuple(ratio)
        self.interpolation = _check_mode(interpolation)

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        _check_batch(x, "RandomResizedCrop")
        B, _, H, W = x.shape
        top, left, h, w = resized_crop_boxes(B, H, W, self.scale, self.ratio, g)
        theta = torch.zeros(B, 2, 3)
        theta[:, 0, 0], theta[:, 1, 1] = w / W, h / H
        theta[:, 0, 2], theta[:, 1, 2] = (2 * left + w) / W - 1, (2 * top + h) / H - 1
        grid = F.affine_grid(theta.to(x), [B, 1, *self.size], align_corners=False)
        return F.grid_sample(x, grid, mode=self.interpolation, padding_mode="border", align_corners=False)

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        flip = (uniform(x.shape[0], g) < self.p).to(x.device).view(-1, 1, 1, 1)
        return torch.where(flip, x.flip(-1), x)

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class Normalize:
    """``(x - mean) / std`` per channel; ``denormalize`` inverts it."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != len(std) or min(std) <= 0:
            raise ValueError(f"Normalize: mean and std need one value per channel and std > 0, got {mean}, {std}")
        self.mean, self.std = tuple(mean), tuple(std)

    def _stats(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.shape[1] != len(self.mean):
            raise ValueError(f"Normalize: {len(self.mean)} channel stats for a batch with {x.shape[1]} channels")
        as_t = lambda v: torch.tensor(v, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)  # noqa: E731
        return as_t(self.mean), as_t(self.std)

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        mean, std = self._stats(x)
        return (x - mean).div_(std)  # one temporary, the same rounding as (x - mean) / std

    def normalize_(self, x: Tensor) -> Tensor:
        """In place on ``x`` (the same rounding as ``(x - mean) / std``)."""
        mean, std = self._stats(x)
        return x.sub_(mean).div_(std)

    def denormalize(self, x: Tensor) -> Tensor:
        mean, std = self._stats(x)
        return x * std + mean

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"


class Resize:
    """Resize to ``size`` (no-op when the batch already has it)."""

    def __init__(self, size: Size, interpolation: str = "bilinear") -> None:
        self.size, self.interpolation = _pair(size), _check_mode(interpolation)

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        return resize(x, self.size, self.interpolation)

    def __repr__(self) -> str:
        return f"Resize(size={self.size}, interpolation={self.interpolation!r})"


class RandomErasing:
    """Random erasing (Zhong et al. 2020, timm's defaults): with probability ``p`` replace a box of area
    fraction in ``scale`` and aspect in ``ratio`` by N(0, 1) noise (``mode="pixel"``, meant for normalised
    input) or by ``value`` (``mode="const"``).
    """

    def __init__(
        self,
        p: float = 0.25,
        scale: Sequence[float] = (0.02, 1 / 3),
        ratio: Sequence[float] = (0.3, 3.3),
        mode: str = "pixel",
        value: float = 0.0,
    ) -> None:
        if mode not in ("pixel", "const"):
            raise ValueError(f"RandomErasing: mode must be 'pixel' or 'const', got {mode!r}")
        self.p, self.scale, self.ratio, self.mode, self.value = p, tuple(scale), tuple(ratio), mode, value

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        _check_batch(x, "RandomErasing")
        B, _, H, W = x.shape
        top, left, h, w, ok = sample_boxes(B, H, W, self.scale, self.ratio, g, strict=True)
        ok &= uniform(B, g) < self.p
        box = [t.to(x.device) for t in (top, left, h, w)]
        mask = box_mask(*box, H, W) & ok.to(x.device).view(-1, 1, 1, 1)
        fill = _noise_like(x, g) if self.mode == "pixel" else torch.full_like(x, self.value)
        return torch.where(mask, fill, x)

    def __repr__(self) -> str:
        return f"RandomErasing(p={self.p}, scale={self.scale}, ratio={self.ratio}, mode={self.mode!r})"


class ColorJitter:
    """torchvision's ColorJitter without hue: brightness, contrast and saturation factors drawn uniformly from
    ``[max(0, 1 - v), 1 + v]`` and applied in a random order per sample, each as PIL's ImageEnhance blend (the
    same ops RandAugment's Brightness, Contrast and Color use)."""

    def __init__(self, brightness: float = 0.4, contrast: float = 0.4, saturation: float = 0.4) -> None:
        if min(brightness, contrast, saturation) < 0:
            raise ValueError(f"ColorJitter strengths must be >= 0, got {brightness}, {contrast}, {saturation}")
        self.strengths = (brightness, contrast, saturation)

    @staticmethod
    def _degenerate(x: Tensor, op: int) -> Tensor | float:
        if op == 0:
            return 0.0
        return gray(x).mean((1, 2, 3), keepdim=True) if op == 1 else gray(x)

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        _check_batch(x, "ColorJitter")
        B = x.shape[0]
        factors = [1 + v * (2 * uniform(B, g) - 1) for v in self.strengths]  # U[1 - v, 1 + v]
        order = torch.stack([torch.randperm(3, generator=g) for _ in range(B)])  # (B, 3) op per slot
        for slot in range(3):
            out = x
            for op, (v, f) in enumerate(zip(self.strengths, factors)):
                sel = (order[:, slot] == op).to(x.device).view(-1, 1, 1, 1)
                if v > 0 and bool(sel.any()):
                    out = torch.where(sel, blend(self._degenerate(x, op), x, f.clamp(min=0).to(x)), out)
            x = out
        return x

    def __repr__(self) -> str:
        b, c, s = self.strengths
        return f"ColorJitter(brightness={b}, contrast={c}, saturation={s})"


class ResizeCenterCrop:
    """The evaluation transform on a batch: resize the shorter side to ``floor(size / crop_pct)`` (``squash``:
    both sides), cut the centred ``size`` square (:func:`vitlab.data.crop.eval_geometry`)."""

    def __init__(self, size: Size, crop_pct: float = 0.875, interpolation: str = "bicubic", crop_mode: str = "center"):
        self.spec = CropSpec(
            _pair(size), train=False, crop_pct=crop_pct, crop_mode=crop_mode, interpolation=interpolation
        )

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        _check_batch(x, "ResizeCenterCrop")
        (rh, rw), (top, left) = eval_geometry(tuple(x.shape[-2:]), self.spec)
        x = resize(x, (rh, rw), self.spec.interpolation)
        return cut_crop(x, (top, left), self.spec.size)

    def __repr__(self) -> str:
        s = self.spec
        return f"ResizeCenterCrop(size={s.size}, crop_pct={s.crop_pct}, crop_mode={s.crop_mode!r})"


class Compose:
    """Apply steps in order; a uint8 batch is first scaled to float ``[0, 1]``."""

    def __init__(self, steps: Sequence[Transform]) -> None:
        self.steps = list(steps)

    def __call__(self, x: Tensor, g: torch.Generator | None = None) -> Tensor:
        steps = self.steps
        if x.dtype == torch.uint8:
            x = x.float().div_(255)
            if steps and isinstance(steps[0], Normalize):  # the buffer just made is ours: normalise it in place
                x, steps = steps[0].normalize_(x), steps[1:]
        for step in steps:
            x = step(x, g)
        return x

    def __repr__(self) -> str:
        return "Compose(\n" + "".join(f"  {s!r},\n" for s in self.steps) + ")"
