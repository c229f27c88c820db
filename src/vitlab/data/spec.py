"""The dataset spec every tool takes (``--data``), parsed once into a value: :class:`DataSpec`.

::

    spec = DataSpec.parse("folder:/data/imagenet")   # DataSpec(kind="folder", path="/data/imagenet")
    spec.streaming                                   # True: decoded per sample in DataLoader workers
    str(spec)                                        # "folder:/data/imagenet", the text as given

The forms: ``mnist`` (the embedded digits), ``cifar10:<folder>``, ``mnist-idx:<folder>`` (``mnist:<folder>``
too), ``folder:<path>`` (an image folder, ImageNet layout or one subfolder per class), ``wds:<shards>``
(WebDataset shards: a folder with ``shards.json`` or a brace pattern), or a bare folder path, recognised by
its contents. The text is what checkpoints and run records keep (and what crosses process boundaries);
inside a process the tools pass the parsed value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..common.options import Validated
from .readers import CIFAR_FIX, MNIST_FIX

#: every kind of dataset, and those that stream through DataLoader workers (the others are read into memory)
KINDS = ("mnist", "cifar10", "mnist-idx", "folder", "wds", "cifar100", "pets", "flowers102")
STREAMING = ("folder", "wds", "pets", "flowers102")
#: the dataset specs ``vitlab train`` (and every tool that reads data) takes
SPEC_HELP = (
    "mnist (embedded), cifar10:<folder>, mnist-idx:<folder>, folder:<path>, wds:<shards>, the transfer sets "
    "cifar100:<folder>, pets:<folder>, flowers102:<folder>, or a bare folder path"
)
USE = (
    "use 'mnist', 'cifar10:<folder>', 'mnist-idx:<folder>', 'folder:<path>', 'wds:<shards>', 'cifar100:<folder>', "
    "'pets:<folder>' or 'flowers102:<folder>'"
)
# (channels, side) of the sets whose images all have one size; folders and shards are resized to the model's
NATIVE_SHAPES = {"mnist": (1, 28), "mnist-idx": (1, 28), "cifar10": (3, 32), "cifar100": (3, 32)}

FOLDER_FIX = "point to a folder laid out root/<class>/<image>"
# the transfer sets (vitlab.data.transfer_sets): what their folder holds, and what to do
TRANSFER_LAYOUTS = {
    "cifar100": ("train, test and meta (cifar-100-python)", "download the python version of CIFAR-100"),
    "pets": ("images/ and annotations/ (Oxford-IIIT Pets)", "extract images.tar.gz and annotations.tar.gz there"),
    "flowers102": ("jpg/, imagelabels.mat and setid.mat (Flowers-102)", "put the three there"),
}
WDS_FIX = (
    "write shards with `vitlab data shards SRC OUT`, or give a brace pattern: wds:/data/train-{000000..000009}.tar"
)


@dataclass(frozen=True)
class DataSpec:
    """A parsed dataset spec: its ``kind`` (one of :data:`KINDS`) and ``path`` ("" for the embedded MNIST).

    ``text`` is the spec as written (``str(spec)`` gives it back); two specs naming the same data in different
    words (a bare folder and ``folder:`` + the folder) compare equal.
    """

    kind: str
    path: str = ""
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        shown = repr(self.text or self.kind)
        if self.kind not in KINDS:
            raise ValueError(f"unknown dataset {shown} (not a known kind, nor an existing folder); {USE}")
        if self.kind != "mnist" and not self.path:
            raise ValueError(f"dataset {shown} needs a path: write {self.kind}:/path/to/data")

    @classmethod
    def parse(cls, text: str | DataSpec) -> DataSpec:
        """The spec of ``text`` (a :class:`DataSpec` is returned as it is); ValueError naming what is wrong (an
        empty spec, an unknown kind, a kind without its path) and what to write instead. Looks at nothing on
        disk but a bare path's folder (its contents tell CIFAR batches, idx files and class folders apart)."""
        if isinstance(text, DataSpec):
            return text
        if not isinstance(text, str):
            raise ValueError(f"a dataset spec is text such as 'mnist' or 'folder:/data', got {type(text).__name__}")
        spec = text.strip()
        if not spec:
            raise ValueError(f"the dataset spec is empty; {USE}")
        kind, sep, path = spec.partition(":")
        if not sep and Path(spec).expanduser().is_dir():
            kind, path = guess_kind(Path(spec).expanduser()), spec
        kind = kind.strip().lower()
        if kind == "mnist" and path:
            kind = "mnist-idx"  # mnist:<folder> reads idx files
        return cls(kind, path, text)  # __post_init__: an unknown kind, a missing path

    @property
    def streaming(self) -> bool:
        """Whether the data streams through DataLoader workers (``folder:``, ``wds:``) or is read into memory."""
        return self.kind in STREAMING

    @property
    def native_shape(self) -> tuple[int, int | None]:
        """(channels, side) of the images as stored: MNIST 1 x 28, CIFAR-10 3 x 32; (3, None) for folders and
        shards, whose images are resized to the model's input size."""
        return NATIVE_SHAPES.get(self.kind, (3, None))

    def check(self) -> DataSpec:
        """This spec when its folder exists (a missing folder, or a file where the folder should be, raises
        the reader's one line). Reads no data: a quick check of a command-line option before any work."""
        if self.kind == "cifar10":
            data_dir(self.path, "CIFAR-10", "data_batch_1..5 and test_batch (cifar-10-batches-py)", CIFAR_FIX)
        elif self.kind == "mnist-idx":
            data_dir(self.path, "MNIST", "the idx files (train-/t10k- images and labels)", MNIST_FIX)
        elif self.kind == "folder":
            data_dir(self.path, "image", "one subfolder of images per class", FOLDER_FIX)
        elif self.kind in TRANSFER_LAYOUTS:
            data_dir(self.path, self.kind, *TRANSFER_LAYOUTS[self.kind])
        elif (
            self.kind == "wds"
            and "{" not in self.path
            and "=" not in self.path
            and not Path(self.path).expanduser().is_file()
        ):
            data_dir(self.path, "shard", "shards.json and the shards `vitlab data shards` writes", WDS_FIX)
        return self

    def __str__(self) -> str:
        return self.text or (f"{self.kind}:{self.path}" if self.path else self.kind)


def parse_data(text: str | DataSpec) -> DataSpec:
    """:meth:`DataSpec.parse` then :meth:`DataSpec.check`: the argparse type of every ``--data`` option."""
    return DataSpec.parse(text).check()


def data_dir(root: str | Path, what: str, holding: str, fix: str) -> Path:
    """``root`` as an existing folder, or one line saying it is missing or a file (``holding``: what it should hold)."""
    root = Path(root).expanduser()
    if root.is_dir():
        return root
    if root.exists():
        raise ValueError(f"{what} path {root} is a file; expected the folder holding {holding}; {fix}")
    raise FileNotFoundError(f"{what} folder {root} does not exist; {fix}")


def guess_kind(path: Path) -> str:
    """The kind of a bare folder by its contents: CIFAR-10 batches, MNIST idx files, else an image folder."""
    # look only where the readers look, never walk the tree (an ImageNet folder holds a million files)
    if any((d / "test_batch").is_file() or any(d.glob("data_batch_*")) for d in (path, path / "cifar-10-batches-py")):
        return "cifar10"
    if any(any(d.glob("*-ubyte*")) for d in (path, path / "raw", path / "MNIST" / "raw")):
        return "mnist-idx"
    return "folder"


#: the argparse type of every ``--data`` option: the parsed, checked :class:`DataSpec`
data_spec = Validated(parse_data, "a dataset spec")
