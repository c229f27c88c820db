"""The teacher of a distillation run (Touvron et al. 2021, DeiT, Sec. 4): loaded, checked, run on a batch.

The teacher is a vitlab checkpoint, a program saved by ``torch.export.save`` (``.pt2``) or a TorchScript
file, so a CNN trained elsewhere (DeiT's RegNetY-16GF) plugs in without its code. None of them runs code from
the file: checkpoints are read with ``weights_only``; a ``.pt2`` program or TorchScript file is checked before
it is deserialised or run (no string it carries is evaluated, every operator is a tensor operation of an
allowlist, no loop) and anything else is refused with one :class:`TeacherError` line (:mod:`.safety`). The
teacher runs in eval mode without gradients, on the batch resized to its own input size; a program exported
with a static batch size (or a bounded dynamic one) is called on chunks of the sizes it takes, a short last
chunk padded and its padding's outputs dropped.

What a file's teacher does is not known until it runs, so its calls are guarded too: a program's input channels
(and fixed input size) are known from the file and checked against the data before the first batch
(:attr:`Teacher.in_chans`); a teacher that raises is one :class:`TeacherError` line naming its file; and the
first call runs under a time bound (``timeout`` seconds, ``--teacher-timeout``): a watchdog thread that, when the
bound passes, prints one line and ends the process, since a teacher stuck inside torch's C++ cannot be
interrupted from Python.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from ..checkpoint import load_checkpoint
from ..checkpoint.safeload import one_line
from ..common.options import positive_float
from ..common.runtime import is_out_of_memory
from ..data import resize
from ..interop.pretrained import load_model
from .safety import TeacherError as TeacherError  # load_teacher's one-line error, importable from here
from .safety import no_pickled_code as _no_pickled_code  # noqa: F401 -- the name tests and callers use
from .safety import read_export, read_torchscript

#: seconds a teacher's first call may take (``--teacher-timeout``): far more than any teacher needs for one batch
DEFAULT_TIMEOUT_S = 300.0
#: the exit code of a process whose teacher did not answer in time (vitlab's code for a one-line error)
TIMEOUT_EXIT_CODE = 2


class Teacher(nn.Module):
    """A frozen teacher, the input size it takes (None: any) and the batch sizes it takes: ``batch_range`` =
    (lowest, highest or None), ``(B, B)`` for a program exported with a static batch ``B``. ``source`` names it in
    messages (its file); ``timeout`` bounds its first call in seconds (None: no bound; see the module docstring).
    ``in_chans`` is the number of input channels it takes, when its file says (None: not known)."""

    def __init__(
        self,
        model: nn.Module,
        input_size: tuple[int, int] | None,
        num_classes: int | None = None,
        batch_range: tuple[int, int | None] = (1, None),
        source: str | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.model, self.input_size, self.num_classes, self.batch_range = model, input_size, num_classes, batch_range
        self.in_chans: int | None = None
        self.source, self.timeout, self.answered = source or type(model).__name__, timeout, False

    def check_channels(self, in_chans: int) -> None:
        """One :class:`TeacherError` line unless the teacher takes ``in_chans``-channel images (or does not say)."""
        if self.in_chans is not None and self.in_chans != in_chans:
            raise TeacherError(
                f"teacher {self.source} takes {self.in_chans}-channel images, the data has {in_chans}; "
                "use a teacher made for this data"
            )

    @torch.no_grad()
    def predict(self, x: Tensor) -> Tensor:
        """The model's (first) output for ``x``, called on chunks of at most the highest batch size it takes; a
        chunk below the lowest is padded with zero images whose outputs are dropped (a static-batch program
        then serves any batch, the last short one of an epoch included)."""
        lower, upper = self.batch_range
        step = upper or len(x)
        outs = []
        with self._first_call_bound():
            for start in range(0, len(x), step):
                chunk = x[start : start + step]
                n = len(chunk)
                if n < lower:
                    chunk = torch.cat([chunk, chunk.new_zeros(lower - n, *chunk.shape[1:])])
                out = self._call(chunk)
                outs.append((out[0] if isinstance(out, (tuple, list)) else out)[:n])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _call(self, chunk: Tensor) -> object:
        """The model on one chunk; what it raises (but running out of memory) is one line naming the teacher."""
        try:
            return self.model(chunk)
        except Exception as e:
            if is_out_of_memory(e):
                raise
            raise TeacherError(
                f"teacher {self.source} failed on a batch of shape {tuple(chunk.shape)} ({_reason(e)}); check that "
                "it is made for this data"
            ) from e

    @contextlib.contextmanager
    def _first_call_bound(self) -> Iterator[None]:
        """Around the first call: a watchdog that ends the process with one line if the call outlasts
        ``timeout`` (a C++ loop ignores Python's signals and exceptions: only ending the process stops it)."""
        if self.answered or self.timeout is None:
            yield
            return
        watchdog = threading.Timer(self.timeout, self._expired)
        watchdog.daemon = True
        watchdog.start()
        try:
            yield
        finally:
            watchdog.cancel()
        self.answered = True

    def _expired(self) -> None:
        # os.write and os._exit take no lock the stuck main thread might hold (print and sys.exit could wait on it)
        line = (
            f"vitlab: error: teacher {self.source} gave no answer to its first batch within {self.timeout:g} s "
            "(a loop that never ends, or a teacher far too slow for this machine); check the teacher, or allow "
            "it more time with --teacher-timeout SECONDS\n"
        )
        os.write(2, line.encode(errors="replace"))
        os._exit(TIMEOUT_EXIT_CODE)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_size is not None and tuple(x.shape[-2:]) != self.input_size:
            x = resize(x, self.input_size)
        return self.predict(x).float()


def _exported_input(program) -> Tensor | None:
    """The example (fake) tensor of an exported program's first user input, with its static or symbolic shape."""
    user = program.graph_signature.user_inputs
    node = next((n for n in program.graph.nodes if n.op == "placeholder" and n.name == user[0]), None)
    val = getattr(node, "meta", {}).get("val") if node is not None else None
    return val if isinstance(val, Tensor) and val.dim() == 4 else None


def _reason(e: BaseException) -> str:
    """The gist of a teacher's error as one line, ``Type: message``: for TorchScript the error its code raised,
    the last line after its interpreter's traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["no message"]
    if isinstance(e, torch.jit.Error):
        return one_line(lines[-1].removeprefix("builtins."), 200)
    return one_line(f"{type(e).__name__}: {lines[0]}", 200)


def _exported_channels(program) -> int | None:
    """The input channels of an exported program (None when symbolic or not an image input)."""
    val = _exported_input(program)
    return int(val.shape[1]) if val is not None and isinstance(val.shape[1], int) else None


def _exported_input_size(program) -> tuple[int, int] | None:
    """The (H, W) an exported program was traced at (None when symbolic)."""
    val = _exported_input(program)
    if val is None or not all(isinstance(s, int) for s in val.shape[-2:]):
        return None
    return int(val.shape[-2]), int(val.shape[-1])


def _exported_batch_range(program) -> tuple[int, int | None]:
    """The batch sizes an exported program takes, (lowest, highest or None): ``(B, B)`` for a static batch ``B``,
    the range torch.export recorded for a dynamic one (``Dim.AUTO`` takes 2 and more)."""
    val = _exported_input(program)
    if val is None:
        return 1, None
    batch = val.shape[0]
    if isinstance(batch, int):
        return batch, batch
    bounds = program.range_constraints.get(batch.node.expr)
    if bounds is None:
        return 1, None
    upper = int(bounds.upper) if bool(bounds.upper < 2**62) else None  # torch's integer infinity: no bound
    return max(1, int(bounds.lower)), upper


def _archive_kind(path: Path) -> str:
    """ "export" (a ``.pt2`` name, or a torch.export archive under another), "torchscript" or "vitlab" (anything
    else: the checkpoint reader explains)."""
    if path.suffix == ".pt2":
        return "export"
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):  # not a zip, or a damaged one
        return "vitlab"
    if any(n.endswith("/models/model.json") for n in names) and any(n.endswith("/archive_format") for n in names):
        return "export"
    if any("/code/" in n for n in names) and any(n.endswith("constants.pkl") for n in names):
        return "torchscript"
    return "vitlab"


def load_teacher(
    path: str | Path,
    device: torch.device | str = "cpu",
    img_size: int | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> Teacher:
    """A frozen teacher in eval mode from a vitlab checkpoint, a ``.pt2`` program or a TorchScript file;
    ``img_size`` overrides the input size the file says (a TorchScript file says none: the batch's size);
    ``timeout``: the seconds its first call may take before the process ends (None: no bound)."""
    path = Path(path).expanduser()
    if path.is_dir() and (path / "last.pt").is_file():  # a `vitlab train` output folder
        path = path / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(f"teacher {path}: no such file")
    if timeout is not None:
        positive_float.check(timeout, "the teacher's time bound (seconds)")
    kind = _archive_kind(path)
    size = (img_size, img_size) if img_size else None
    batches: tuple[int, int | None] = (1, None)
    chans = None
    if kind == "export":
        program, module = read_export(path)
        fixed, chans = _exported_input_size(program), _exported_channels(program)
        if size is not None and fixed is not None and size != fixed:
            raise TeacherError(
                f"teacher {path} was exported for {fixed[0]}x{fixed[1]} inputs only, not the {img_size}x{img_size} "
                f"asked for; drop the teacher's input size (images are resized to {fixed[0]}x{fixed[1]})"
            )
        size, classes, batches = size or fixed, None, _exported_batch_range(program)
    elif kind == "torchscript":
        module, classes = read_torchscript(path), None
    else:
        ckpt = load_checkpoint(path)
        module = load_model(ckpt["model_name"], ckpt)
        size, classes = size or tuple(module.meta["input_size"][1:]), module.num_classes
    if hasattr(module, "eval") and kind != "export":  # an exported program's module has no train/eval switch
        module = module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    teacher = Teacher(module, size, classes, batches, str(path), timeout).to(device)
    teacher.in_chans = module.in_chans if kind == "vitlab" else chans
    return teacher
