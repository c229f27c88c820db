"""JPEG decoding and the training crop on the GPU, for when the machine's cores cannot decode fast enough for the step.

A GPU training step can take more images per second than the CPU's workers decode and crop (DeiT-S in bf16 on
one H100 trains at thousands of images/s; one worker decodes a few hundred). This path moves the decode to the GPU:
the workers only read the files and their headers, the main process decodes the batch with nvJPEG
(``torchvision.io.decode_jpeg`` on a CUDA device; torchvision is optional, :func:`check_device_decode` says what is
missing in one line) and cuts and resamples every box on the GPU with the CPU path's own crop
(:func:`~.crop.crop_resize_pixels`). The boxes and flips are drawn from the headers exactly as the CPU path draws
them (:func:`~.geometry.train_boxes`), so the same seed gives the same boxes. The batch stage (RandAugment,
normalisation, random erasing) then runs on the GPU as it does after a CPU decode.

Where the two paths differ: the CPU decodes at the smallest DCT scale that covers the box (1/2, 1/4, 1/8), the GPU
decodes whole images, so their crops agree to within the resampling of the box at two scales (a few levels), not
bit for bit. Files that are not JPEGs (PNG, GIF, ...) are decoded on the CPU, at full size, and moved over.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from .crop import crop_resize_pixels
from .decode import decode, image_size
from .geometry import CropSpec, train_boxes
from .samplers import derive_seed

#: decodes JPEG files' bytes to ``uint8 (C, H, W)`` tensors on a device
Decoder = Callable[[Sequence[bytes], torch.device, int], list[Tensor]]
_JPEG_START = b"\xff\xd8"  # the start-of-image marker every JPEG file begins with


def device_decode_available(device: torch.device | str) -> bool:
    """Whether JPEGs can be decoded on ``device``: a CUDA device and torchvision's nvJPEG decoder."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("torchvision") is not None


def check_device_decode(device: torch.device | str) -> None:
    """One-line ValueError when :func:`device_decode_available` is false, saying what to do."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"decoding on the device needs a CUDA device, got {device!r}; decode in the workers instead")
    if importlib.util.find_spec("torchvision") is None:
        raise ValueError(
            "decoding on the GPU needs torchvision (its nvJPEG decoder): install the torchvision build matching "
            "torch, or decode in the workers"
        )


def nvjpeg_decode(files: Sequence[bytes], device: torch.device, channels: int) -> list[Tensor]:
    """JPEG bytes -> ``uint8 (C, H, W)`` tensors on the CUDA ``device``, one batched nvJPEG call."""
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    data = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    return list(decode_jpeg(data, mode=mode, device=device)) if data else []


def _decode_all(files: Sequence[bytes], device: torch.device, channels: int, jpeg: Decoder) -> list[Tensor]:
    """Every file's whole pixels on ``device``: the JPEGs in one call of ``jpeg``, the rest on the CPU (and all of
    them there when the batched call refuses one, e.g. a CMYK JPEG, which nvJPEG does not decode)."""
    is_jpeg = [bytes(f[:2]) == _JPEG_START for f in files]
    try:
        decoded = iter(jpeg([f for f, j in zip(files, is_jpeg, strict=True) if j], device, channels))
    except RuntimeError:
        is_jpeg, decoded = [False] * len(files), iter(())
    out = []
    for f, j in zip(files, is_jpeg, strict=True):
        if j:
            out.append(next(decoded))
        else:  # not a JPEG: Pillow at full size, then to the device
            pixels = decode(f, None, channels, "pillow").pixels
            out.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).to(device))
    return out


def decode_crops(
    files: Sequence[bytes],
    sizes: Sequence[tuple[int, int]],
    spec: CropSpec,
    g: torch.Generator,
    device: torch.device | str,
    jpeg: Decoder = nvjpeg_decode,
) -> Tensor:
    """The training crops ``uint8 (B, C, h, w)`` of image files (their bytes and (H, W) from the headers), decoded
    and cut on ``device``: RandomResizedCrop's boxes and the flips drawn from ``g`` as the CPU path draws them,
    the crop and resample of :func:`~.crop.crop_resize_pixels` at scale 1. ``jpeg`` decodes the JPEGs (nvJPEG by
    default; the tests pass a CPU decoder)."""
    if not spec.train:
        raise ValueError("decode_crops cuts training boxes; evaluation decodes in the workers")
    dev = torch.device(device)
    boxes = train_boxes(list(sizes), spec, g)
    crops = []
    for pixels, size, box in zip(_decode_all(files, dev, spec.channels, jpeg), sizes, boxes, strict=True):
        scale = (pixels.shape[1] / size[0], pixels.shape[2] / size[1])
        crop = crop_resize_pixels(resampled_as(pixels), scale, box, spec)[0]
        crops.append(crop.round_().clamp_(0, 255).to(torch.uint8) if crop.is_floating_point() else crop)
    return torch.stack(crops)


def resampled_as(pixels: Tensor) -> Tensor:
    """The pixels in the type the device resamples: uint8 on the CPU (its antialiased uint8 kernels), float32 on
    a GPU (whose antialiased interpolation takes floating images; rounded back to uint8 after the resample)."""
    return pixels if pixels.device.type == "cpu" else pixels.float()


class HeaderDataset(torch.utils.data.Dataset):
    """A file's bytes, its (H, W) from the header and its label: all a worker does when the GPU decodes."""

    def __init__(self, source) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        path, label = self.source.read(i)
        data = Path(path).read_bytes()
        return data, image_size(data), label


class DeviceDecodeLoader:
    """Training batches ``(images, labels)`` of a folder source, decoded and cut (:func:`decode_crops`) and put
    through the transform's batch stage on ``device``; the workers only read files and headers. Batch ``b``'s
    boxes and augmentation come from a generator seeded with ``(seed, b)``, the order from ``seed`` (``jpeg``: as
    :func:`decode_crops`). What ``vitlab bench-data`` measures against the workers' decode; a file that cannot be
    read raises (the training loaders' substitution of damaged files is not here)."""

    def __init__(
        self,
        source,
        transform,
        batch_size: int,
        workers: int,
        device: str,
        jpeg: Decoder = nvjpeg_decode,
        seed: int = 0,
    ) -> None:
        self.transform, self.device, self.jpeg, self.seed = transform, device, jpeg, seed
        order = torch.Generator().manual_seed(seed)
        self.loader = torch.utils.data.DataLoader(HeaderDataset(source), batch_size, shuffle=True, num_workers=workers,
                                                  drop_last=True, collate_fn=list, persistent_workers=workers > 0,
                                                  generator=order)  # fmt: skip

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for b, items in enumerate(self.loader):
            g = torch.Generator().manual_seed(derive_seed(self.seed, b))
            files, sizes, labels = zip(*items, strict=True)
            x = decode_crops(files, sizes, self.transform.crop, g, self.device, self.jpeg)
            yield self.transform.batch(x, g), torch.tensor(labels)
