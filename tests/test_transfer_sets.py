"""The transfer sets (CIFAR-100, Oxford-IIIT Pets, Flowers-102) read from generated files in the layouts their
publishers distribute, through the dataset specs every tool takes; a model trains on each."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hangs import deadline
from vitlab.checkpoint import load_checkpoint
from vitlab.data import create_loader, create_transform, open_source
from vitlab.data.readers import read_cifar_batch, read_cifar_meta
from vitlab.data.spec import DataSpec
from vitlab.data.transfer_sets import cifar100, flowers102, oxford_pets
from vitlab.engine.config import TrainConfig
from vitlab.engine.loop import train
from vitlab.interop.pretrained import load_model

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


# ------------------------------------------------------------------------------------------- hostile files
class System:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert message and "\n" not in message, message
    return message


def test_pets_refuses_images_outside_its_folder(tmp_path):
    root = tmp_path / "pets"
    write_pets(root)
    jpeg(tmp_path / "outside" / "secret.jpg", 9)  # what ../../outside/secret would read
    listing = root / "annotations" / "test.txt"
    listing.write_text("Bengal_3 3 1 3\n../../outside/secret 2 2 1\n")
    with pytest.raises(ValueError, match=r"test\.txt line 2 names '\.\./\.\./outside/secret\.jpg', which resolves to .*"
                                         r"outside the dataset folder") as e:  # fmt: skip
        oxford_pets(root, "test")
    assert "secret" in one_line(e)
    listing.write_text(f"Bengal_3 3 1 3\n{tmp_path / 'outside' / 'secret'} 2 2 1\n")
    with pytest.raises(ValueError, match=r"line 2 names the absolute path"):
        oxford_pets(root, "test")
    (root / "images" / "Bengal_9.jpg").symlink_to(tmp_path / "outside" / "secret.jpg")  # a link out of the root
    listing.write_text("Bengal_3 3 1 3\nBengal_9 3 1 3\n")
    with pytest.raises(ValueError, match="outside the dataset folder"):
        oxford_pets(root, "test")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_as_an_image_is_refused_not_waited_on(tmp_path):
    write_pets(tmp_path)
    image = tmp_path / "images" / "Bengal_3.jpg"
    image.unlink()
    os.mkfifo(image)
    with deadline(20), pytest.raises(ValueError, match=r"Bengal_3\.jpg is a named pipe, not a regular file") as e:
        oxford_pets(tmp_path, "test")
    one_line(e)
    # a pipe swapped in after the list was made: the reader's own check, in the DataLoader worker too
    jpeg(tmp_path / "images" / "swap.jpg", 5)
    image.unlink()
    (tmp_path / "images" / "swap.jpg").rename(image)
    test = oxford_pets(tmp_path, "test")
    image.unlink()
    os.mkfifo(image)
    with deadline(20), pytest.raises(ValueError, match="is a named pipe"):
        test.read(2)
    for workers in (0, 1):
        loader = create_loader(test, create_transform(32), 3, is_training=False, workers=workers)
        with deadline(60), pytest.raises(ValueError, match=r"Bengal_3\.jpg is a named pipe") as e:
            list(loader)
        one_line(e)


def test_pets_image_listed_twice(tmp_path):
    write_pets(tmp_path)
    listing = tmp_path / "annotations" / "test.txt"
    listing.write_text("Bengal_3 3 1 3\nAbyssinian_3 1 1 1\nBengal_3 2 2 2\n")
    with pytest.raises(
        ValueError, match=r"line 3 lists Bengal_3 as class 2, line 1 as class 3: an image has one class"
    ):
        oxford_pets(tmp_path, "test")
    listing.write_text("Bengal_3 3 1 3\nAbyssinian_3 1 1 1\nBengal_3 3 1 3\n")
    with pytest.warns(UserWarning, match=r"test\.txt lists 1 image\(s\) more than once"):
        test = oxford_pets(tmp_path, "test")
    assert len(test) == 2 and test.labels.tolist() == [2, 0]
    for bad in ("Bengal_3 ² 1 3", f"Bengal_3 {'9' * 5000} 1 3", "Bengal_3"):
        listing.write_text(bad + "\n")
        with pytest.raises(ValueError, match=r"test\.txt line 1: expected '<image> <class id 1\.\.37>"):
            oxford_pets(tmp_path, "test")


def test_transfer_sets_take_the_folder_their_archive_unpacks_to(tmp_path):
    write_pets(tmp_path / "a" / "oxford-iiit-pet")  # torchvision's layout
    for root in (tmp_path / "a", tmp_path / "a" / "oxford-iiit-pet", tmp_path / "a" / "oxford-iiit-pet" / "images"):
        assert len(oxford_pets(root, "train")) == 6, root
    write_flowers(tmp_path / "b" / "flowers-102")
    for root in (tmp_path / "b", tmp_path / "b" / "flowers-102", tmp_path / "b" / "flowers-102" / "jpg"):
        assert len(flowers102(root, "train")) == 4, root
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no images/ and annotations/ folders: expected images/<Breed>"):
        oxford_pets(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"holds no imagelabels\.mat: expected jpg/image_NNNNN\.jpg"):
        flowers102(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no 'train' file: expected train, test and meta"):
        cifar100(tmp_path / "empty")


def _mat(path: Path, **arrays) -> None:
    pytest.importorskip("scipy.io").savemat(path, arrays)


def test_flowers_labels_and_ids_must_be_vectors_of_integers(tmp_path):
    write_flowers(tmp_path)
    good = np.array([[1, 2, 102, 1, 2, 102, 5, 5]], np.uint8)
    cases = [
        (np.array([[1.5, 2, 102, 1, 2, 102, 5, 5]]), r"'labels' must be a vector of integers 1\.\.102, found 1\.5"),
        (np.arange(1, 13, dtype=np.uint8).reshape(3, 4), r"'labels' must be a vector .*, found a 3x4 array"),
        (np.array([[1, 2, 103, 1, 2, 102, 5, 5]], np.int32), r"found 103"),
        (np.array([[1, 2, 3]], np.uint8), r"labels 3 images but .*jpg holds 8 image_NNNNN\.jpg files"),
        (np.array([[1e30, 2, 3, 1, 2, 102, 5, 5]]), r"found 1e\+30"),
    ]
    for labels, message in cases:
        _mat(tmp_path / "imagelabels.mat", labels=labels)
        with pytest.raises(ValueError, match=message) as e:
            flowers102(tmp_path, "train")
        assert "imagelabels.mat" in one_line(e)
    _mat(tmp_path / "imagelabels.mat", labels=good)
    ids = {"trnid": np.array([[1, 2]]), "valid": np.array([[3, 7]]), "tstid": np.array([[4, 5, 6, 8]])}
    cases = [
        ({"trnid": np.array([[1.5, 2]])}, r"'trnid' must be a vector of integers 1\.\.8, found 1\.5"),
        ({"valid": np.array([[3, 7], [1, 2]])}, r"'valid' must be a vector .*found a 2x2 array"),
        ({"tstid": np.array([[4, 5, 6, 9]])}, r"'tstid' must be a vector of integers 1\.\.8, found 9"),
        ({"valid": np.array([[3, 1]])}, r"lists image 1 twice in trnid and valid"),
        ({"tstid": np.array([[4, 5, 6, 7]])}, r"lists image 7 in both the training .* and the test ids"),
    ]
    for change, message in cases:
        _mat(tmp_path / "setid.mat", **{**ids, **change})
        with pytest.raises(ValueError, match=message) as e:
            flowers102(tmp_path, "train")
        assert "setid.mat" in one_line(e)
    _mat(tmp_path / "setid.mat", **ids)
    assert flowers102(tmp_path, "test").labels.tolist() == [0, 1, 101, 4]


def test_cifar_label_and_batch_mistakes_name_the_file(tmp_path):
    write_cifar100(tmp_path)
    train = tmp_path / "cifar-100-python" / "train"
    images = np.zeros((2, 3072), np.uint8)
    cases = [
        ([0, 10**30], r"has fine labels outside 0\.\.99 \(1000000000000000000000000000000\)"),
        ([0, 1.5], r"has fine labels that are not integer class indices 0\.\.99 \(1\.5\)"),
        ([0, [1]], r"has fine labels that are not integer class indices"),
        ([0, True], r"not integer class indices 0\.\.99 \(True\)"),
    ]
    for labels, message in cases:
        train.write_bytes(pickle.dumps({b"data": images, b"fine_labels": labels}, protocol=2))
        with pytest.raises(ValueError, match=message) as e:
            cifar100(tmp_path)
        assert str(train) in one_line(e)
    train.write_bytes(pickle.dumps({b"data": np.zeros((0, 3072), np.uint8), b"fine_labels": []}, protocol=2))
    with pytest.raises(ValueError, match=r"CIFAR-100 file .*train holds no images") as e:
        cifar100(tmp_path)
    assert "run code" not in one_line(e)
    batch = tmp_path / "data_batch_1"
    for labels, message in (([0, 10**30], r"has labels outside 0\.\.9"), ([], "holds no images")):
        data = images[: len(labels)]
        batch.write_bytes(pickle.dumps({b"data": data, b"labels": labels}, protocol=2))
        with pytest.raises(ValueError, match=message) as e:
            read_cifar_batch(batch)
        assert str(batch) in one_line(e)


def test_a_cifar_meta_file_asking_to_run_code_is_named_in_a_warning(tmp_path):
    write_cifar100(tmp_path)
    marker = tmp_path / "pwned"
    meta = tmp_path / "cifar-100-python" / "meta"
    meta.write_bytes(pickle.dumps({b"fine_label_names": System(marker)}, protocol=2))
    with pytest.warns(UserWarning, match=r"CIFAR-100 meta file .*meta is not a plain data pickle .*system.*unnamed"):
        data = cifar100(tmp_path)
    assert data.class_names is None and len(data) == 6 and not marker.exists()
    meta.write_bytes(pickle.dumps({b"fine_label_names": [b"one", b"two"]}, protocol=2))
    with pytest.warns(UserWarning, match=r"holds no list of 100 class names"):
        cifar100(tmp_path)
    cifar10_meta = tmp_path / "batches.meta"
    cifar10_meta.write_bytes(pickle.dumps({b"label_names": System(marker)}, protocol=2))
    with pytest.warns(UserWarning, match=r"CIFAR-10 meta file .*batches\.meta .*run code"):
        assert read_cifar_meta(cifar10_meta) is None
    assert not marker.exists()


def test_cifar100_class_names_travel_into_the_checkpoint(tmp_path):
    write_cifar100(tmp_path / "c100", n_train=8)
    names = [f"class{i}" for i in range(100)]
    data = cifar100(tmp_path / "c100")
    assert data.classes == names and data.subset(torch.tensor([0, 2])).classes == names
    cfg = TrainConfig(model="deit_mini", model_args={"depth": 1}, data=f"cifar100:{tmp_path / 'c100'}", img_size=32,
                      epochs=1, batch_size=2, eval_batch_size=2, threads=1, progress=False, device="cpu",
                      train_limit=6, out=str(tmp_path / "run"))  # fmt: skip
    train(cfg, lambda line: None)
    assert load_checkpoint(tmp_path / "run" / "last.pt")["label_names"] == names
    assert load_model(str(tmp_path / "run")).pretrained_cfg["label_names"] == names


def test_one_pets_image_spelled_two_ways_is_one_image(tmp_path):
    write_pets(tmp_path)
    (tmp_path / "annotations" / "test.txt").write_text("Bengal_3 3 1 3\n../images/Bengal_3 2 2 2\n")
    with pytest.raises(ValueError, match=r"line 2 lists \.\./images/Bengal_3 as class 2, line 1 as class 3"):
        oxford_pets(tmp_path, "test")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_one_image_through_the_transform_or_the_decoder_never_waits_on_a_pipe(tmp_path):
    from vitlab.data.decode import UnreadableImage, decode, image_size

    os.mkfifo(tmp_path / "pipe.jpg")
    for read in (create_transform(32), lambda p: decode(p), lambda p: image_size(p)):
        with deadline(20), pytest.raises(UnreadableImage, match=r"pipe\.jpg: DataFileError: .* is a named pipe"):
            read(tmp_path / "pipe.jpg")
    jpeg(tmp_path / "ok.jpg", 3)
    assert create_transform(32)(tmp_path / "ok.jpg").shape == (3, 32, 32)
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(UnreadableImage, match=r"^\S*bad\.jpg: "):
        create_transform(32)(str(tmp_path / "bad.jpg"))
