"""``vitlab data``: make and convert image data -- ``synth`` writes a synthetic ImageNet-layout JPEG folder,
``shards`` writes an image folder as WebDataset tar shards, ``info`` describes a data spec."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..common import options as opt
from ..common.io import check_writable_folder
from ..data.spec import KINDS, SPEC_HELP, data_spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("synth", help="write a synthetic ImageNet-layout folder of JPEGs (train/ and val/)")
    s.add_argument("out", help="folder to write (OUT/train/<class>/*.JPEG, OUT/val/<class>/*.JPEG)")
    s.add_argument("--classes", type=opt.Int(2), default=10, help="number of classes (default 10)")
    s.add_argument(
        "--train-per-class", type=opt.positive_int, default=100, help="training images per class (default 100)"
    )
    s.add_argument(
        "--val-per-class", type=opt.non_negative_int, default=20, help="validation images per class (default 20)"
    )
    s.add_argument(
        "--size",
        type=opt.image_size,
        nargs=2,
        default=None,
        metavar=("W", "H"),
        help="one image size (default: ImageNet's mix)",
    )
    s.add_argument("--quality", type=opt.Int(1, 100), default=90, help="JPEG quality (default 90)")
    s.add_argument("--seed", type=opt.seed, default=0)
    s.add_argument("--force", action="store_true", help="OUT holds a set already: move it aside and write anew")
    w = sub.add_parser("shards", help="write an image folder (ImageNet layout) as WebDataset tar shards")
    w.add_argument(
        "src",
        type=opt.Validated(image_folder, "an image folder"),
        help="image folder, as `vitlab train --data` takes it (folder:PATH) or a plain path: SRC/train/<class>/* "
        "and SRC/val/<class>/*",
    )
    w.add_argument("out", help="folder for OUT/<split>-NNNNNN.tar and OUT/shards.json (read back as wds:OUT)")
    w.add_argument("--shard-size", type=opt.positive_int, default=1000, help="samples per shard (default 1000)")
    w.add_argument("--force", action="store_true", help="OUT holds shards already: move them aside and write anew")
    i = sub.add_parser("info", help="what a data spec holds: images, classes, per-class counts")
    i.add_argument("spec", type=data_spec, help=f"a dataset spec: {SPEC_HELP}")
    i.add_argument("--split", default="train", choices=["train", "val"])


def image_folder(spec: str) -> str:
    """The folder of an image-folder spec: ``folder:PATH`` (as ``vitlab train --data`` takes it) or a plain
    path; a spec of another kind of data (``mnist``, ``wds:...``) is one line saying what SRC takes."""
    kind, sep, path = spec.strip().partition(":")
    kind = kind.strip().lower()
    if sep and kind == "folder":
        if not path.strip():
            raise ValueError(f"{spec!r} needs a path: write folder:/path/to/images")
        return path.strip()
    embedded = not sep and kind == "mnist" and not Path(spec).expanduser().is_dir()  # a folder named mnist: a path
    if (sep and kind in KINDS) or embedded:
        raise ValueError(
            f"{spec!r} is {kind} data; vitlab data shards writes an image folder (folder:PATH or a plain path)"
        )
    return spec


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.action == "synth":
        from ..data.synth import synthesize

        check_writable_folder(args.out, "OUT")
        size = tuple(args.size) if args.size else None
        info = synthesize(args.out, num_classes=args.classes, train_per_class=args.train_per_class,
                          val_per_class=args.val_per_class, size=size, quality=args.quality, seed=args.seed,
                          force=args.force)  # fmt: skip
        mb = info["bytes"] / 2**20
        print(f"wrote {info['images']} JPEGs ({mb:.1f} MiB, {info['classes']} classes) to {args.out} "
              f"in {time.perf_counter() - t0:.1f} s; use it as --data folder:{args.out}")  # fmt: skip
        return 0
    if args.action == "shards":
        from ..data.shard_writer import write_shards

        check_writable_folder(args.out, "OUT")
        meta = write_shards(args.src, args.out, shard_size=args.shard_size, force=args.force)
        parts = ", ".join(
            f"{k}: {sum(v['counts'])} samples in {len(v['shards'])} shards" for k, v in meta["splits"].items()
        )
        print(f"wrote {parts} to {args.out} in {time.perf_counter() - t0:.1f} s; use it as --data wds:{args.out}")
        return 0
    from ..data.factory import open_source

    src = open_source(args.spec, args.split)
    counts = src.class_counts() if hasattr(src, "class_counts") else None
    classes = None if getattr(src, "classes", ()) is None else src.num_classes  # plain shards: not known
    print(json.dumps({"source": repr(src), "images": len(src), "classes": classes, "class_counts": counts}))
    return 0
