"""Streaming data: decoding, crop geometry, folder/shard sources, DataLoader workers, resume, token labels."""

from __future__ import annotations

import importlib.util
import io
import math
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vitlab.data import (
    Box,
    CropSpec,
    MixToken,
    RepeatedAugSampler,
    ShardedSampler,
    UnreadableImage,
    create_loader,
    create_transform,
    crop_dense,
    decode,
    dense_targets,
    eval_geometry,
    open_source,
)
from vitlab.data.crop import crop_resize, load_sample
from vitlab.data.decode import Decoded, min_decode_size, power_of_two_reduction
from vitlab.data.geometry import boxes_statistics, train_boxes
from vitlab.data.synth import synthesize


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    """A tiny ImageNet-layout folder: 3 classes, 8 train + 2 val JPEGs each, 48 x 40 pixels."""
    root = tmp_path_factory.mktemp("synth")
    synthesize(root, num_classes=3, train_per_class=8, val_per_class=2, size=(48, 40))
    return root


def _jpeg(arr: np.ndarray, mode: str | None = None, **kw) -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(arr)
    (im.convert(mode) if mode else im).save(buf, "JPEG", quality=95, **kw)
    return buf.getvalue()


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("decoder", ["pillow", "simplejpeg"])
def test_decode_colour_modes_end_as_rgb(decoder):
    pytest.importorskip("simplejpeg") if decoder == "simplejpeg" else None
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, (30, 40), dtype=np.uint8)
    cmyk = _jpeg(rgb, "CMYK")
    for data, want in [
        (_jpeg(rgb), None),
        (_jpeg(gray), np.repeat(gray[..., None], 3, -1)),
        (cmyk, np.asarray(Image.open(io.BytesIO(cmyk)).convert("RGB"))),
        (_png(Image.fromarray(np.dstack([rgb, gray]), "RGBA")), rgb),  # alpha dropped, as timm does
        (_png(Image.fromarray(gray.astype(np.uint16) * 257)), np.repeat(gray[..., None], 3, -1)),  # 16-bit scaled
    ]:
        out = decode(data, decoder=decoder)
        assert out.pixels.dtype == np.uint8 and out.pixels.shape == (30, 40, 3) and out.size == (30, 40)
        if want is not None:
            tol = 0 if data[:4] == b"\x89PNG" else 8  # JPEG gray->RGB / CMYK paths differ by rounding only
            assert np.abs(out.pixels.astype(int) - want.astype(int)).max() <= tol


@pytest.mark.parametrize("decoder", ["pillow", "simplejpeg"])
def test_corrupt_and_truncated_files_raise_one_named_error(tmp_path, decoder):
    pytest.importorskip("simplejpeg") if decoder == "simplejpeg" else None
    good = _jpeg(np.zeros((64, 64, 3), np.uint8))
    cases = {"junk.jpg": b"not an image at all", "empty.jpg": b"", "cut.jpg": good[: len(good) // 3]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UnreadableImage, match=name):
            load_sample(tmp_path / name, CropSpec((16, 16)), torch.Generator().manual_seed(0), decoder)


@pytest.mark.parametrize("decoder", ["pillow", "simplejpeg"])
def test_decoders_reduce_only_by_powers_of_two(decoder):
    """Both decoders take the largest of 1, 2, 4, 8 that still covers the minimum (libjpeg-turbo's other M/8
    scales are slower than a full decode); a minimum no power of two covers gets the whole image."""
    pytest.importorskip("simplejpeg") if decoder == "simplejpeg" else None
    data = _jpeg(np.random.default_rng(1).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    for need, shape in [((280, 350), (300, 400)), ((150, 200), (150, 200)), ((151, 10), (300, 400)),
                        ((70, 90), (75, 100)), ((1, 1), (38, 50)), (None, (300, 400))]:  # fmt: skip
        assert decode(data, need, decoder=decoder).pixels.shape[:2] == shape, (need, decoder)
    for size in [(300, 400), (301, 17), (8, 8), (1000, 3)]:  # the naive definition, over every minimum
        for mh in range(1, size[0] + 1, max(1, size[0] // 37)):
            for mw in range(1, size[1] + 1, max(1, size[1] // 29)):
                ok = [r for r in (1, 2, 4, 8) if math.ceil(size[0] / r) >= mh and math.ceil(size[1] / r) >= mw]
                assert power_of_two_reduction(size, (mh, mw)) == max(ok)


def test_draft_decodes_at_the_smallest_scale_covering_the_crop():
    data = _jpeg(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    need = min_decode_size((480, 640), (400, 500), (64, 64))  # the box spans 400 x 500 -> 64 x 64
    out = decode(data, need, decoder="pillow")
    assert out.pixels.shape[:2] == (120, 160)  # draft scale 1/4: the box becomes 100 x 125 >= 64
    assert 400 * out.scale[0] >= 64 and 500 * out.scale[1] >= 64
    assert decode(data, (480, 640), decoder="pillow").pixels.shape[:2] == (480, 640)


# --------------------------------------------------------------------------- geometry


def _torchvision_boxes(sizes, n_per, seed):
    from vitlab.bench.data import torchvision_box

    rnd = random.Random(seed)
    return [Box(*torchvision_box(w, h, rnd), size=(h, w)) for h, w in sizes for _ in range(n_per)]


def test_crop_sampler_matches_torchvisions_distribution():
    from scipy.stats import ks_2samp

    sizes = [(375, 500), (500, 333), (64, 300)]  # the last one often needs the fallback
    ours = []
    for k, size in enumerate(sizes):
        ours += train_boxes([size] * 3000, CropSpec((224, 224), hflip=0), torch.Generator().manual_seed(k))
    ref = _torchvision_boxes(sizes, 3000, 1)
    a, b = boxes_statistics(ours), boxes_statistics(ref)
    for key in a:
        assert ks_2samp(a[key], b[key]).pvalue > 1e-3, key
    # and the boxes always lie inside their image
    for bx in ours:
        assert bx.top >= 0 and bx.top + bx.height <= bx.size[0] and bx.left >= 0 and bx.left + bx.width <= bx.size[1]


@pytest.mark.parametrize("size", [(375, 500), (500, 333), (224, 224), (300, 301)])
@pytest.mark.parametrize("crop_pct, mode", [(0.875, "center"), (0.9, "center"), (1.0, "center"), (0.875, "squash")])
def test_eval_crop_geometry_equals_the_formula(size, crop_pct, mode):
    spec = CropSpec((224, 224), train=False, crop_pct=crop_pct, crop_mode=mode)
    (rh, rw), (top, left) = eval_geometry(size, spec)
    scale = math.floor(224 / crop_pct)
    h, w = size
    want = (
        (scale, scale) if mode == "squash" else (scale, int(scale * w / h)) if h <= w else (int(scale * h / w), scale)
    )
    assert (rh, rw) == want
    assert (top, left) == (round((rh - 224) / 2.0), round((rw - 224) / 2.0))


def test_eval_transform_is_resize_then_centre_crop():
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)
    tf = create_transform(64, crop_pct=0.8)
    x = tf(_png(Image.fromarray(arr)))  # PNG: no DCT scaling, the formula in full
    (rh, rw), (top, left) = eval_geometry((90, 120), tf.crop)
    full = torch.from_numpy(arr).permute(2, 0, 1)[None]
    ref = F.interpolate(full, size=(rh, rw), mode="bicubic", antialias=True)[0, :, top : top + 64, left : left + 64]
    ref = (ref.float() / 255 - torch.tensor(tf.batch.steps[0].mean).view(3, 1, 1)) / torch.tensor(
        tf.batch.steps[0].std
    ).view(3, 1, 1)
    assert torch.allclose(x, ref, atol=1e-5)
    # Pillow's two-step (resize, then crop) gives the same picture up to its rounding at the edges
    pil = np.asarray(Image.fromarray(arr).resize((rw, rh), Image.BICUBIC))[top : top + 64, left : left + 64]
    ours = F.interpolate(full, size=(rh, rw), mode="bicubic", antialias=True)[0, :, top : top + 64, left : left + 64]
    assert np.abs(ours.permute(1, 2, 0).numpy().astype(int) - pil.astype(int)).mean() < 1.0


# --------------------------------------------------------------------------- folder sources


def test_folder_source_scans_once_and_matches_val_classes_by_name(synth, tmp_path):
    train, val = open_source(f"folder:{synth}", "train"), open_source(f"folder:{synth}", "val")
    assert len(train) == 24 and len(val) == 6 and train.classes == val.classes and train.num_classes == 3
    assert train.class_counts() == [8, 8, 8]
    assert train.files.nbytes < 60 * len(train)  # the file list is packed: bytes per file, no objects
    # val lacking a class: labels still follow the training classes by name
    root = tmp_path / "partial"
    for split, classes in (("train", ["a", "b", "c"]), ("val", ["c"])):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(root / split / c / "x.png")
    with pytest.warns(UserWarning, match="lacks 2 of the 3"):
        v = open_source(f"folder:{root}", "val")
    assert v.labels.tolist() == [2]
    # val holding a class train does not have: one clear error
    (root / "val" / "zebra").mkdir()
    with pytest.raises(ValueError, match="training split does not have: zebra"):
        open_source(f"folder:{root}", "val")


def test_flat_folder_is_split_without_decoding(synth):
    flat = synth / "train"
    tr, te = open_source(f"folder:{flat}", "train", holdout=6), open_source(f"folder:{flat}", "val", holdout=6)
    assert len(tr) == 18 and len(te) == 6 and te.class_counts() == [2, 2, 2]
    assert not {tr.files.path(i) for i in range(len(tr))} & {te.files.path(i) for i in range(len(te))}


# --------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("n, world, repeats", [(10, 3, 3), (12, 4, 3), (7, 2, 2)])
def test_repeated_aug_sampler_covers_each_index_repeats_times(n, world, repeats):
    shards = [RepeatedAugSampler(n, repeats=repeats, rank=r, world_size=world, seed=4, full_epoch=True).indices(2)
              for r in range(world)]  # fmt: skip
    flat = torch.cat(shards)
    assert len({len(s) for s in shards}) == 1
    counts = torch.bincount(flat, minlength=n)
    padding = len(flat) - n * repeats  # DeiT pads the repeated list to a multiple of the world size
    assert counts.min() >= repeats and int((counts - repeats).sum()) == padding < world
    # the copies of one index sit on different ranks in the same step (when world >= repeats)
    if world >= repeats:
        step0 = [int(s[0]) for s in shards[:repeats]]
        assert len(set(step0)) == 1
    # DeiT's default epoch keeps a plain epoch's length
    plain = RepeatedAugSampler(n, repeats=repeats, rank=0, world_size=world, seed=4)
    assert plain.num_samples == n // world and torch.equal(plain.indices(2), shards[0][: n // world])


def test_eval_sampler_visits_every_sample_once():
    parts = [ShardedSampler(10, shuffle=False, rank=r, world_size=3, pad=False).indices(0) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))


# --------------------------------------------------------------------------- loaders


def _take(loader, k=None):
    out = []
    for i, b in enumerate(loader):
        out.append(b)
        if k is not None and i + 1 == k:
            break
    return out


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_resume_mid_epoch_with_two_workers_is_bit_identical(synth):
    src = open_source(f"folder:{synth}", "train")
    tf = create_transform(32, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    kw = dict(is_training=True, workers=2, seed=11, repeats=3)
    full = create_loader(src, tf, 4, **kw)
    full.set_epoch(1)
    whole = _take(full)
    assert len(whole) == len(full) == 6
    first = create_loader(src, tf, 4, **kw)
    first.set_epoch(1)
    _take(first, 2)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batch"] == 2
    resumed = create_loader(src, tf, 4, **kw)
    resumed.load_state_dict(state)
    rest = _take(resumed)
    assert len(rest) == 4 and all(_equal(a, b) for a, b in zip(rest, whole[2:]))
    x, y = whole[0]
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long


def test_worker_count_does_not_change_the_batches(synth):
    src = open_source(f"folder:{synth}", "train")
    tf = create_transform(24, is_training=True, color_jitter=None)  # no float reductions: bit-equal across threads
    a = _take(create_loader(src, tf, 5, is_training=True, workers=0, seed=3))
    b = _take(create_loader(src, tf, 5, is_training=True, workers=2, seed=3))
    assert len(a) == len(b) == 4 and all(_equal(p, q) for p, q in zip(a, b))
    # the batch stage in the workers (float batches cross over) instead of the main process: the same batches
    c = _take(create_loader(src, tf, 5, is_training=True, workers=2, seed=3, transform_on_device=False))
    assert all(_equal(p, q) for p, q in zip(a, c))


def test_eval_loader_and_in_memory_sets_share_the_interface(synth):
    val = open_source(f"folder:{synth}", "val")
    batches = _take(create_loader(val, create_transform(32), 4, is_training=False))
    assert [len(y) for _, y in batches] == [4, 2] and torch.cat([y for _, y in batches]).tolist() == [0, 0, 1, 1, 2, 2]
    mnist = open_source("mnist", "val", holdout=20)
    loader = create_loader(mnist, create_transform((1, 28, 28), mean=(0.5,), std=(0.5,)), 8, is_training=False)
    x, _ = next(iter(loader))
    assert x.shape == (8, 1, 28, 28) and loader.state_dict()["batch"] == 1


def test_unreadable_files_are_skipped_counted_and_fatal_past_the_fraction(synth, tmp_path):
    import shutil

    root = tmp_path / "damaged"
    shutil.copytree(synth, root)
    victims = sorted((root / "train" / "n00000001").iterdir())
    victims[0].write_bytes(victims[0].read_bytes()[:200])  # truncated
    victims[1].write_bytes(b"garbage")
    src = open_source(f"folder:{root}", "train")
    tf = create_transform(16, is_training=True)
    loader = create_loader(src, tf, 6, is_training=True, max_bad_fraction=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = _take(loader)
    assert all(len(y) == 6 for _, y in batches) and len(loader.bad_files) == 2
    assert sum("unreadable image skipped" in str(w.message) for w in caught) == 2
    assert {Path(p).name for p in loader.bad_files} == {victims[0].name, victims[1].name}
    strict = create_loader(src, tf, 6, is_training=True, max_bad_fraction=0.05, workers=2)
    with pytest.raises(ValueError, match=r"2 of 24 images cannot be decoded") as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _take(strict)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- token labelling


def _grid_sample_reference(maps: np.ndarray, box: Box, grid, num_classes):
    """Dense (C, Hm, Wm) map -> grid_sample at the output cell centres through the box (float64)."""
    scores, classes = maps[0].astype(np.float64), maps[1].astype(np.int64)
    dense = np.zeros((num_classes, *scores.shape[1:]))
    for k in range(scores.shape[0]):
        np.add.at(dense, (classes[k], *np.indices(scores.shape[1:])), scores[k])
    H, W = box.size
    gh, gw = grid
    u = (np.arange(gw) + 0.5) / gw
    u = 1 - u if box.flip else u
    v = (np.arange(gh) + 0.5) / gh
    xs, ys = (box.left + u * box.width) / W * 2 - 1, (box.top + v * box.height) / H * 2 - 1
    g = torch.from_numpy(np.stack(np.meshgrid(xs, ys), -1))[None]
    out = F.grid_sample(torch.from_numpy(dense)[None], g, mode="bilinear", padding_mode="border", align_corners=False)
    return out[0].permute(1, 2, 0).reshape(gh * gw, num_classes)


@pytest.mark.parametrize("flip", [False, True])
def test_dense_targets_follow_the_box_exactly(flip):
    rng = np.random.default_rng(0)
    k, hm, wm, C = 3, 7, 9, 11
    scores = rng.random((k, hm, wm))
    classes = np.stack([rng.permutation(C)[:k] for _ in range(hm * wm)], -1).reshape(k, hm, wm)
    maps = np.stack([scores, classes]).astype(np.float16)
    box = Box(17.0, 40.0, 120.0, 150.0, (210, 270), flip)
    idx, w = crop_dense(maps, box, (5, 6))
    got = dense_targets(idx[None], w[None].double(), C)[0]
    ref = _grid_sample_reference(maps, box, (5, 6), C)
    assert torch.allclose(got, ref, atol=1e-10)


def test_dense_crop_equals_the_image_crop_at_the_patch_grid():
    # a linear ramp is reproduced exactly by bilinear and bicubic resampling: the map of ramps (two classes
    # whose scores are x and y) and the image of the same ramps, cropped with one box, agree at every patch
    H, W, hm, wm, patch, out = 96, 128, 12, 16, 8, 32
    yy, xx = np.meshgrid((np.arange(H) + 0.5) / H, (np.arange(W) + 0.5) / W, indexing="ij")
    img = Decoded(np.stack([xx, yy, xx], -1).astype(np.float32), (H, W))
    my, mx = np.meshgrid((np.arange(hm) + 0.5) / hm, (np.arange(wm) + 0.5) / wm, indexing="ij")
    maps = np.stack([np.stack([mx, my]), np.stack([np.zeros_like(mx), np.ones_like(my)])]).astype(np.float32)
    spec = CropSpec((out, out), interpolation="bilinear")
    for flip in (False, True):
        crop, used = crop_resize(img, Box(20, 24, 64, 80, (H, W), flip), spec)
        pooled = F.avg_pool2d(crop[None].float(), patch)[0]  # per patch: the ramp at the patch centre
        idx, w = crop_dense(maps, used, (out // patch, out // patch))
        dense = dense_targets(idx[None], w[None], 2)[0].T.reshape(2, out // patch, out // patch)
        # the outer ring of patches sees the edge of the crop, where resampling filters are cut off
        assert torch.allclose(dense[:, 1:-1, 1:-1], pooled[:2, 1:-1, 1:-1], atol=1e-5)
        assert (dense - pooled[:2]).abs().max() < 0.02


def test_mixtoken_mixes_targets_exactly_as_it_mixes_tokens():
    torch.manual_seed(0)
    B, p, C, size = 4, 4, 5, 16
    x, y = torch.rand(B, 3, size, size), torch.tensor([0, 1, 2, 3])
    n = (size // p) ** 2
    dense = (torch.randint(0, C, (B, n, 6)), torch.rand(B, n, 6))
    mt = MixToken(p, alpha=1.0, label_smoothing=0.0, num_classes=C)
    g = torch.Generator().manual_seed(3)
    params = mt.sample(x, g)
    assert params.box is not None
    xm, ym, (im, wm) = mt.apply(x, y, dense, params)
    embed = torch.nn.Conv2d(3, 8, p, p)  # a patch embedding: each token sees its own patch only
    tokens, mixed_tokens = embed(x).flatten(2), embed(xm).flatten(2)
    top, left, h, w = params.box
    cells = torch.zeros(size // p, size // p, dtype=torch.bool)
    cells[top : top + h, left : left + w] = True
    cells = cells.flatten()
    expect = torch.where(cells, tokens.flip(0), tokens)
    assert torch.allclose(mixed_tokens, expect, atol=1e-6)
    assert torch.equal(im, torch.where(cells[None, :, None], dense[0].flip(0), dense[0]))
    assert torch.equal(wm, torch.where(cells[None, :, None], dense[1].flip(0), dense[1]))
    lam = 1 - cells.float().mean()
    assert abs(params.lam - lam.item()) < 1e-9
    assert torch.allclose(ym, lam * F.one_hot(y, C) + (1 - lam) * F.one_hot(y.flip(0), C))


def test_dense_targets_through_the_loader(synth, tmp_path):
    import shutil

    root = tmp_path / "tl"
    shutil.copytree(synth, root)
    src = open_source(f"folder:{root}", "train")
    for i in range(len(src)):
        path = src.dense_path(i)
        label = int(src.files.labels[i])
        maps = np.zeros((2, 2, 3, 3), np.float16)
        maps[0, 0], maps[1, 0], maps[0, 1], maps[1, 1] = 0.9, label, 0.1, (label + 1) % 3
        np.save(path, maps)
        assert path.name.endswith(".tl.npy")
    mix = MixToken(8, num_classes=3, label_smoothing=0.0)
    loader = create_loader(src, create_transform(32, True), 4, is_training=True, dense_grid=(4, 4), mix=mix)
    x, y, (idx, w) = next(iter(loader))
    assert x.shape == (4, 3, 32, 32) and y.shape == (4, 3) and idx.shape == (4, 16, 8) == w.shape
    dense = dense_targets(idx, w, 3)
    assert torch.allclose(dense.sum(-1), torch.ones(4, 16), atol=1e-3)  # constant maps: scores sum to 1


# --------------------------------------------------------------------------- WebDataset shards


def test_shards_written_from_a_folder_read_back_and_resume(synth, tmp_path):
    pytest.importorskip("webdataset")
    from vitlab.data.shard_writer import write_shards

    meta = write_shards(synth, tmp_path / "shards", shard_size=5)
    assert [sum(v["counts"]) for v in meta["splits"].values()] == [24, 6]
    val = open_source(f"wds:{tmp_path / 'shards'}", "val")
    labels = torch.cat([y for _, y in _take(create_loader(val, create_transform(16), 4, is_training=False))])
    assert sorted(labels.tolist()) == [0, 0, 1, 1, 2, 2]  # every sample exactly once
    pattern = str(tmp_path / "shards" / "train-{000000..000004}.tar")
    train = open_source(f"wds:{pattern}", "train")
    assert len(train) == 24 and train.num_classes == 3
    tf = create_transform(16, True)
    kw = dict(is_training=True, workers=2, seed=5, shuffle_buffer=8)
    whole = _take(create_loader(train, tf, 3, **kw))
    assert len(whole) == 8
    first = create_loader(train, tf, 3, **kw)
    _take(first, 3)
    resumed = create_loader(train, tf, 3, **kw)
    resumed.load_state_dict(first.state_dict())
    rest = _take(resumed)
    assert len(rest) == 5 and all(_equal(a, b) for a, b in zip(rest, whole[3:]))
    with pytest.raises(ValueError, match="workers"):
        create_loader(train, tf, 3, **(kw | {"workers": 1})).load_state_dict(first.state_dict())


def test_shard_streams_split_by_rank_and_worker_per_epoch_and_resume_on_every_rank(synth, tmp_path):
    """Every epoch hands each sample of each shard to exactly one (rank, worker), in a shard order that changes
    with the epoch; a rank's loader stopped mid-epoch and resumed from its state gives that rank's remaining
    batches."""
    pytest.importorskip("webdataset")
    from vitlab.data.shard_writer import write_shards
    from vitlab.data.wds import ShardStream

    write_shards(synth, tmp_path / "shards", shard_size=3)  # 8 train shards
    train = open_source(f"wds:{tmp_path / 'shards'}", "train")
    tf = create_transform(16, True, re_prob=0.25)
    streams = [ShardStream(train, tf.crop, tf.batch, batch_size=2, train=True, seed=3, rank=r, world_size=2,
                           workers=2) for r in range(2)]  # fmt: skip
    for epoch in (0, 1):
        reads = [(i, k) for s in streams for w in range(2) for i, skip, take in s.pieces(epoch, *s.worker_span(w))
                 for k in range(skip, skip + take)]  # fmt: skip
        assert sorted(reads) == [(i, k) for i in range(8) for k in range(3)]
    assert streams[0].shard_order(0) != streams[0].shard_order(1)
    for rank in (0, 1):
        kw = dict(is_training=True, workers=2, seed=3, rank=rank, world_size=2, shuffle_buffer=4)
        full = create_loader(train, tf, 2, **kw)
        full.set_epoch(1)
        whole = _take(full)
        first = create_loader(train, tf, 2, **kw)
        first.set_epoch(1)
        _take(first, 3)
        state = first.state_dict()
        assert state == {"epoch": 1, "batch": 3, "seed": 3, "num_batches": 6, "workers": 2}
        resumed = create_loader(train, tf, 2, **kw)
        resumed.load_state_dict(state)
        rest = _take(resumed)
        assert len(whole) == 6 and len(rest) == 3 and all(_equal(a, b) for a, b in zip(rest, whole[3:]))


def test_bad_specs_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(f"folder:{tmp_path / 'nope'}")
    with pytest.raises(ValueError, match="needs a path"):
        open_source("wds:")
    with pytest.raises(FileNotFoundError, match=r"shards\.json"):
        open_source(f"wds:{tmp_path}")
    missing = pytest.raises(FileNotFoundError, match="do not exist")
    if importlib.util.find_spec("braceexpand") is None:  # without the data extra: the line that names it
        missing = pytest.raises(ImportError, match=r"pip install 'vitlab\[data\]'")
    with missing:
        open_source(f"wds:{tmp_path}/x-{{0..3}}.tar")
    from vitlab.data.datasets import check_spec, load_dataset

    assert check_spec(f"wds:{tmp_path}") == f"wds:{tmp_path}"  # the option check of vitlab train/eval
    with pytest.raises(FileNotFoundError, match="vitlab data shards"):
        check_spec(f"wds:{tmp_path / 'nope'}")
    with pytest.raises(ValueError, match="wds data streams"):
        load_dataset(f"wds:{tmp_path}")


# --------------------------------------------------------------------------- transforms, CLI


def test_create_transform_takes_a_data_config_and_pil_images():
    cfg = {"input_size": (3, 40, 40), "interpolation": "bicubic", "crop_pct": 0.9, "mean": (0.5,) * 3,
           "std": (0.25,) * 3, "crop_mode": "center"}  # fmt: skip
    tf = create_transform(**cfg)
    x = tf(Image.new("RGB", (80, 60), (128, 128, 128)))
    assert x.shape == (3, 40, 40) and torch.allclose(x, torch.full_like(x, (128 / 255 - 0.5) / 0.25), atol=1e-5)
    train = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    names = [type(s).__name__ for s in train.batch.steps]
    assert names == ["RandAugment", "Normalize", "RandomErasing"]  # colour jitter is off under RandAugment
    assert [type(s).__name__ for s in create_transform(40, True).batch.steps] == ["ColorJitter", "Normalize"]
    batch = train(torch.randint(0, 256, (2, 3, 50, 60), dtype=torch.uint8), torch.Generator().manual_seed(0))
    assert batch.shape == (2, 3, 40, 40)


def test_color_jitter_is_the_enhance_blend():
    from vitlab.data import ColorJitter

    x = torch.rand(6, 3, 8, 8)
    assert torch.equal(ColorJitter(0, 0, 0)(x, torch.Generator().manual_seed(0)), x)
    g = torch.Generator().manual_seed(1)
    out = ColorJitter(0.4, 0, 0)(x, g)
    g = torch.Generator().manual_seed(1)
    f = 1 + 0.4 * (2 * torch.rand(6, generator=g) - 1)
    assert torch.allclose(out, (x * f.view(-1, 1, 1, 1)).clamp(0, 1))


def test_data_cli_synth_and_shards(tmp_path, capsys):
    pytest.importorskip("webdataset")
    from vitlab.cli import main

    assert main(["data", "synth", str(tmp_path / "s"), "--classes", "2", "--train-per-class", "3",
                 "--val-per-class", "1", "--size", "40", "30"]) == 0  # fmt: skip
    assert len(list((tmp_path / "s" / "train").rglob("*.JPEG"))) == 6
    with Image.open(next((tmp_path / "s" / "val").rglob("*.JPEG"))) as im:
        assert im.size == (40, 30) and im.format == "JPEG"
    assert main(["data", "shards", str(tmp_path / "s"), str(tmp_path / "w"), "--shard-size", "2"]) == 0
    assert (tmp_path / "w" / "shards.json").is_file() and len(list((tmp_path / "w").glob("train-*.tar"))) == 3
    assert main(["data", "info", f"folder:{tmp_path / 's'}"]) == 0
    assert '"images": 6' in capsys.readouterr().out
    assert main(["data", "synth", str(tmp_path / "x"), "--classes", "1"]) == 2
    assert "argument --classes: must be an integer >= 2, got '1'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_data_runs_and_reports(tmp_path):
    from vitlab.cli import main

    out = tmp_path / "bench"
    argv = ["bench-data", "--images", "20", "--workers", "0", "--batches", "1", "--rounds", "1", "--batch-size", "4",
            "--no-step", "--no-memory", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    import json

    doc = json.loads((out / "report.json").read_text())
    assert {r["pipeline"] for r in doc["throughput"]} == {"reference", "vitlab", "vitlab+recipe"}
    assert "vitlab/reference" in (out / "report.txt").read_text()
