"""FID (Heusel et al. 2017) of a generator against real images, through torchmetrics' ``FrechetInceptionDistance``:

    FID = ‖μ_r − μ_g‖² + Tr(Σ_r + Σ_g − 2 (Σ_r Σ_g)^½)

over the features of real and generated images (means μ, covariances Σ). torchmetrics' own Inception path loads
torch-fidelity, whose package imports torchvision (not usable beside vitlab's CPU torch), and downloads the weights
at run time; here its ``feature=`` argument takes :class:`~.inception.FIDInceptionV3` instead, built from a local
weights file (``--inception PATH`` or the ``VITLAB_INCEPTION`` variable), and any other feature module (a test's
small stand-in) the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...common.extras import require
from .inception import WEIGHTS_FILE, load_fid_inception

ENV = "VITLAB_INCEPTION"
MISSING = f"FID needs the Inception weights file ({WEIGHTS_FILE}); give --inception PATH"


def inception_file(path: str | os.PathLike | None = None) -> Path:
    """The weights file: ``path``, else ``$VITLAB_INCEPTION``; none (or no such file) is :data:`MISSING`."""
    given = path or os.environ.get(ENV)
    if not given:
        raise FileNotFoundError(MISSING)
    if not Path(given).is_file():
        raise FileNotFoundError(f"{MISSING} ({given} is not a file)")
    return Path(given)


def inception_features(path: str | os.PathLike | None = None) -> nn.Module:
    """FID's Inception-v3 from the local weights file (:func:`inception_file`)."""
    return load_fid_inception(inception_file(path))


def to_unit(images: Tensor) -> Tensor:
    """uint8 [0, 255] or generator output in [-1, 1] → float [0, 1] (what the feature modules take)."""
    if images.dtype == torch.uint8:
        return images.float() / 255
    return ((images.float() + 1) / 2).clamp(0, 1)


def frechet_distance(real: Iterable[Tensor], fake: Iterable[Tensor], feature: nn.Module) -> float:
    """FID between two streams of image batches (float [0, 1], (B, C, H, W)) in ``feature``'s space (a module
    with an int ``num_features``, as torchmetrics reads it)."""
    fid_module = require("torchmetrics.image.fid", purpose="FID", extra="gan")
    metric = fid_module.FrechetInceptionDistance(feature=feature, normalize=True)
    device = next(feature.parameters(), torch.empty(0)).device
    metric = metric.to(device)
    counts = {True: 0, False: 0}
    for is_real, stream in ((True, real), (False, fake)):
        for batch in stream:
            metric.update(batch.to(device), real=is_real)
            counts[is_real] += len(batch)
    if min(counts.values()) < 2:
        raise ValueError(f"FID needs at least 2 real and 2 generated images, got {counts[True]} and {counts[False]}")
    return float(metric.compute())


def real_batches(images: Tensor, img_size: int, batch_size: int) -> Iterable[Tensor]:
    """uint8 (N, C, H, W) images as float [0, 1] batches at the generator's size."""
    for i in range(0, len(images), batch_size):
        x = to_unit(images[i : i + batch_size])
        if x.shape[-1] != img_size or x.shape[-2] != img_size:
            x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False, antialias=True)
        yield x


@torch.no_grad()
def fake_batches(generator: nn.Module, n: int, batch_size: int, seed: int = 0) -> Iterable[Tensor]:
    """``n`` generated images as float [0, 1] batches, from a seeded z."""
    generator.eval()
    device = next(generator.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for start in range(0, n, batch_size):
        yield to_unit(generator.sample(min(batch_size, n - start), generator=gen))
