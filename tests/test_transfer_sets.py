"""The transfer sets (CIFAR-100, Oxford-IIIT Pets, Flowers-102) read from generated files in the layouts their
publishers distribute, through the dataset specs every tool takes; a model trains on each."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import open_source
from vitlab.data.spec import DataSpec
from vitlab.data.transfer_sets import cifar100, flowers102, oxford_pets
from vitlab.engine.config import TrainConfig
from vitlab.engine.loop import train

BREEDS = ("Abyssinian", "american_bulldog", "Bengal")  # class ids 1, 2, 3 (cats capitalised, as the release)


def write_cifar100(root: Path, n_train: int = 6, n_test: int = 4) -> dict[str, np.ndarray]:
    """``cifar-100-python/{train,test,meta}`` as the release: protocol-2 pickles with bytes keys."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    data = {}
    for name, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        fine = [int(x) for x in rng.integers(0, 100, n)]
        record = {b"filenames": [b"x.png"] * n, b"batch_label": b"x", b"fine_labels": fine,
                  b"coarse_labels": [f // 5 for f in fine], b"data": images}  # fmt: skip
        (folder / name).write_bytes(pickle.dumps(record, protocol=2))
        data[name], data[f"{name}_labels"] = images, np.array(fine)
    meta = {b"fine_label_names": [f"class{i}".encode() for i in range(100)], b"coarse_label_names": [b"c"] * 20}
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    return data


def jpeg(path: Path, colour: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), (colour, 255 - colour, 128)).save(path, "JPEG")


def write_pets(root: Path) -> None:
    """``images/<Breed>_<n>.jpg`` and ``annotations/{trainval,test}.txt`` (image, class id, species, breed id)."""
    (root / "annotations").mkdir(parents=True)
    lines = {"trainval.txt": [], "test.txt": []}
    for cid, breed in enumerate(BREEDS, 1):
        for k in range(1, 4):
            jpeg(root / "images" / f"{breed}_{k}.jpg", 60 * cid)
            lines["trainval.txt" if k < 3 else "test.txt"].append(f"{breed}_{k} {cid} {1 + (cid > 1)} {cid}")
    for name, rows in lines.items():
        (root / "annotations" / name).write_text("#Image CLASS-ID SPECIES BREED ID\n" + "\n".join(rows) + "\n")


def write_flowers(root: Path) -> np.ndarray:
    """``jpg/image_NNNNN.jpg``, ``imagelabels.mat`` (1-based labels) and ``setid.mat`` (trnid, valid, tstid)."""
    sio = pytest.importorskip("scipy.io")
    labels = np.array([[1, 2, 102, 1, 2, 102, 5, 5]], dtype=np.uint8)
    for i in range(1, labels.shape[1] + 1):
        jpeg(root / "jpg" / f"image_{i:05d}.jpg", 20 * i)
    sio.savemat(root / "imagelabels.mat", {"labels": labels})
    ids = {"trnid": np.array([[1, 2]], np.uint16), "valid": np.array([[3, 7]], np.uint16)}
    sio.savemat(root / "setid.mat", {**ids, "tstid": np.array([[4, 5, 6, 8]], np.uint16)}, do_compression=True)
    return labels[0]


def test_cifar100_reads_the_python_release(tmp_path):
    data = write_cifar100(tmp_path)
    train, test = cifar100(tmp_path, "train"), cifar100(tmp_path / "cifar-100-python", "test")
    assert train.images.shape == (6, 3, 32, 32) and train.num_classes == 100 and len(test) == 4
    np.testing.assert_array_equal(train.images.numpy().reshape(6, -1), data["train"])  # rows R, G, B planes
    np.testing.assert_array_equal(test.labels.numpy(), data["test_labels"])  # the fine labels
    assert train.class_names[7] == "class7"
    same = open_source(f"cifar100:{tmp_path}", "val")
    assert torch.equal(same.images, test.images) and DataSpec.parse(f"cifar100:{tmp_path}").native_shape == (3, 32)


def test_cifar100_mistakes_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"CIFAR-100 folder .* does not exist"):
        cifar100(tmp_path / "none")
    (tmp_path / "train").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, 2))
    with pytest.raises(ValueError, match="no 'data' array and 'fine_labels'"):
        cifar100(tmp_path)
    (tmp_path / "train").write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"fine_labels": [100]}))
    with pytest.raises(ValueError, match=r"fine labels outside 0\.\.99"):
        cifar100(tmp_path)
    with pytest.raises(ValueError, match="split must be"):
        cifar100(tmp_path, "all")


def test_pets_reads_the_split_files(tmp_path):
    write_pets(tmp_path)
    train, test = oxford_pets(tmp_path, "train"), open_source(f"pets:{tmp_path}", "val")
    assert len(train) == 6 and len(test) == 3 and train.num_classes == 37
    assert train.classes[:3] == list(BREEDS) and train.labels.tolist() == [0, 0, 1, 1, 2, 2]
    path, label = test.read(2)
    assert path == tmp_path / "images" / "Bengal_3.jpg" and label == 2
    (tmp_path / "annotations" / "test.txt").write_text("Bengal_3 99 1 1\n")
    with pytest.raises(ValueError, match=r"test\.txt line 1: expected '<image> <class id 1\.\.37>"):
        oxford_pets(tmp_path, "test")
    (tmp_path / "annotations" / "test.txt").write_text("Sphynx_9 3 1 1\n")
    with pytest.raises(FileNotFoundError, match=r"image .*Sphynx_9\.jpg does not exist"):
        oxford_pets(tmp_path, "test")


def test_flowers_reads_the_mat_files(tmp_path):
    labels = write_flowers(tmp_path)
    train, test = flowers102(tmp_path, "train"), open_source(f"flowers102:{tmp_path}", "test")
    assert train.num_classes == 102 and len(train) == 4 and len(test) == 4
    assert [train.read(i)[0].name for i in range(4)] == [f"image_{i:05d}.jpg" for i in (1, 2, 3, 7)]
    assert train.labels.tolist() == [labels[i - 1] - 1 for i in (1, 2, 3, 7)] == [0, 1, 101, 4]
    assert test.labels.tolist() == [0, 1, 101, 4]
    (tmp_path / "setid.mat").write_bytes(b"not a mat file")
    with pytest.raises(ValueError, match=r"setid\.mat is not a readable MATLAB file"):
        flowers102(tmp_path, "train")


def test_a_model_trains_on_each_transfer_set(tmp_path):
    write_cifar100(tmp_path / "c100")
    write_pets(tmp_path / "pets")
    write_flowers(tmp_path / "flowers")
    specs = [f"cifar100:{tmp_path / 'c100'}", f"pets:{tmp_path / 'pets'}", f"flowers102:{tmp_path / 'flowers'}"]
    for i, spec in enumerate(specs):
        cfg = TrainConfig(model="deit_mini", model_args={"depth": 1}, data=spec, img_size=32, epochs=1, batch_size=2,
                          eval_batch_size=2, threads=1, progress=False, device="cpu", out=str(tmp_path / f"run{i}"))  # fmt: skip
        summary = train(cfg, lambda line: None)
        assert summary["final"]["val_top1"] is not None, spec
