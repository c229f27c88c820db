"""Decoding and cutting the training crops on the device (``vitlab.data.device_decode``) against the CPU path.

nvJPEG needs a GPU and torchvision; on the CPU the tests hand the same function a Pillow decoder, so everything
but the JPEG decoder itself is checked here: the boxes and flips (the same as the CPU path's for the same seed),
the crop at scale 1 (bit-equal to the CPU crop of a full decode), and the CPU path's DCT-scaled crops within a
few levels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import device_decode as dd
from vitlab.data.crop import crop_resize, load_samples
from vitlab.data.decode import decode
from vitlab.data.geometry import CropSpec, train_boxes


def encoded(h: int, w: int, fmt: str = "JPEG", seed: int = 0) -> bytes:
    """A smooth random picture (JPEG-friendly: gradients and blobs), encoded in memory."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    pixels = np.stack([np.sin(6 * xx + rng.uniform(0, 6)) + np.cos(5 * yy * (c + 1)) for c in range(3)], -1)
    pixels = ((pixels - pixels.min()) / np.ptp(pixels) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, quality=95)
    return buf.getvalue()


def pillow_jpeg(files, device, channels):
    """The stand-in for nvJPEG: whole images through Pillow, as (C, H, W) tensors on ``device``."""
    return [torch.from_numpy(decode(f, None, channels).pixels.copy()).permute(2, 0, 1).to(device) for f in files]


FILES = [encoded(300, 400, seed=1), encoded(480, 360, seed=2), encoded(256, 256, "PNG", seed=3)]
SIZES = [(300, 400), (480, 360), (256, 256)]
SPEC = CropSpec((64, 64))


def test_crops_are_the_cpu_crops_of_whole_images_with_the_cpu_boxes():
    out = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(5), "cpu", jpeg=pillow_jpeg)
    boxes = train_boxes(SIZES, SPEC, torch.Generator().manual_seed(5))
    expected = torch.stack([crop_resize(decode(f, None), b, SPEC)[0] for f, b in zip(FILES, boxes, strict=True)])
    assert out.dtype == torch.uint8 and out.shape == (3, 3, 64, 64)
    assert torch.equal(out, expected)


def test_same_seed_same_crops_and_the_cpu_path_within_a_few_levels():
    first = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(7), "cpu", jpeg=pillow_jpeg)
    again = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(7), "cpu", jpeg=pillow_jpeg)
    other = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(8), "cpu", jpeg=pillow_jpeg)
    assert torch.equal(first, again) and not torch.equal(first, other)
    cpu = load_samples(FILES, SPEC, torch.Generator().manual_seed(7))  # DCT-scaled decodes, the same boxes
    cpu = torch.stack([img for img, _ in cpu])
    diff = (first.float() - cpu.float()).abs()
    assert diff.mean() < 1.5 and diff.quantile(0.99) < 8  # resampling at two scales, JPEG DCT scaling


def test_a_refused_batch_falls_back_to_the_cpu():
    def refuse(files, device, channels):
        raise RuntimeError("nvjpeg: unsupported colour space")

    out = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(5), "cpu", jpeg=refuse)
    ref = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(5), "cpu", jpeg=pillow_jpeg)
    assert torch.equal(out, ref)


def test_without_a_gpu_or_torchvision_one_line_says_what_to_do(monkeypatch):
    assert not dd.device_decode_available("cpu")
    with pytest.raises(ValueError, match="needs a CUDA device") as e:
        dd.check_device_decode("cpu")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(dd.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="needs torchvision"):
        dd.check_device_decode("cuda")
    with pytest.raises(ValueError, match="training boxes"):
        dd.decode_crops(FILES, SIZES, CropSpec((64, 64), train=False), torch.Generator(), "cpu", jpeg=pillow_jpeg)


@pytest.mark.skipif(not torch.cuda.is_available() or not dd.device_decode_available("cuda"), reason="needs nvJPEG")
def test_nvjpeg_on_the_gpu_matches_the_cpu_decoder():
    jpegs, sizes = FILES[:2], SIZES[:2]
    gpu = dd.decode_crops(jpegs, sizes, SPEC, torch.Generator().manual_seed(5), "cuda")
    cpu = dd.decode_crops(jpegs, sizes, SPEC, torch.Generator().manual_seed(5), "cpu", jpeg=pillow_jpeg)
    assert gpu.is_cuda and (gpu.cpu().float() - cpu.float()).abs().mean() < 2  # two IDCT implementations


def test_loader_yields_augmented_batches_the_same_for_the_same_seed(tmp_path):
    from vitlab.data import create_transform, open_source
    from vitlab.data.synth import synthesize

    synthesize(tmp_path / "synth", num_classes=2, train_per_class=4, val_per_class=1)
    source = open_source(f"folder:{tmp_path / 'synth'}", "train")
    tf = create_transform(32, True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)

    def first_batch(seed):
        return next(iter(dd.DeviceDecodeLoader(source, tf, 4, 0, "cpu", jpeg=pillow_jpeg, seed=seed)))

    (x, y), (x2, y2), (x3, _) = first_batch(1), first_batch(1), first_batch(2)
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (4,)
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, x3)
    assert -3 < x.mean() < 3  # normalised by the recipe's batch stage


def test_resampling_in_float_as_on_a_gpu_is_within_a_level_of_the_uint8_path(monkeypatch):
    """On a GPU the crops are resampled in float32 and rounded back: within one level of the CPU's uint8 kernel."""
    uint8 = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(5), "cpu", jpeg=pillow_jpeg)
    monkeypatch.setattr(dd, "resampled_as", lambda pixels: pixels.float())
    float_path = dd.decode_crops(FILES, SIZES, SPEC, torch.Generator().manual_seed(5), "cpu", jpeg=pillow_jpeg)
    assert float_path.dtype == torch.uint8 and (float_path.int() - uint8.int()).abs().max() <= 1
