"""Distillation from a teacher (Touvron et al. 2021, DeiT, Sec. 4), soft or hard, with a distillation token.

With ``Z_s`` the student's class-token logits, ``Z_d`` its distillation-token logits, ``Z_t`` the teacher's,
``psi`` the softmax and ``lambda = alpha``:

- hard (DeiT's "hard-label distillation"): ``L = (1 - lambda) CE(psi(Z_s), y) + lambda CE(psi(Z_d), argmax Z_t)``
  (DeiT uses lambda = 1/2);
- soft (DeiT Eq. 2): ``L = (1 - lambda) CE(psi(Z_s), y) + lambda tau^2 KL(psi(Z_t / tau) || psi(Z_d / tau))``.
  The KL's reduction (``reduction``): ``"deit"`` (the default) does what DeiT's released code does, the pointwise
  terms ``p_t (log p_t - log p_d)`` summed over the batch and the classes and divided by their number ``B x C``;
  ``"batchmean"`` divides the sum by ``B`` only (the KL per sample as the paper writes it, averaged), ``C`` times
  the default (1000x on ImageNet at the same ``alpha``).

The student has a distillation token and head (``dist_token=True``); in training with
``distilled_training = True`` it returns ``(cls_logits, dist_logits)``, at test time their average.

The teacher is a vitlab checkpoint, a program saved by ``torch.export.save`` (``.pt2``) or a TorchScript
file, so a CNN trained elsewhere (DeiT's RegNetY-16GF) plugs in without its code. None of them runs code from
the file: checkpoints are read with ``weights_only``; a ``.pt2`` program or TorchScript file is checked before
it is deserialised or run (no string it carries is evaluated, every operator is a tensor operation of an
allowlist) and anything else is refused with one :class:`TeacherError` line (:mod:`.teacher_safety`). The teacher runs in eval mode without gradients, on the batch resized to its own input size; a program
exported with a static batch size (or a bounded dynamic one) is called on chunks of the sizes it takes, a short
last chunk padded and its padding's outputs dropped.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint import load_checkpoint
from ..data import resize, soft_target_cross_entropy
from ..interop.pretrained import load_model
from .safety import TeacherError as TeacherError  # load_teacher's one-line error, importable from here
from .safety import no_pickled_code as _no_pickled_code  # noqa: F401 -- the name tests and callers use
from .safety import read_export, read_torchscript


class Teacher(nn.Module):
    """A frozen teacher, the input size it takes (None: any) and the batch sizes it takes: ``batch_range`` =
    (lowest, highest or None), ``(B, B)`` for a program exported with a static batch ``B``."""

    def __init__(
        self,
        model: nn.Module,
        input_size: tuple[int, int] | None,
        num_classes: int | None = None,
        batch_range: tuple[int, int | None] = (1, None),
    ) -> None:
        super().__init__()
        self.model, self.input_size, self.num_classes, self.batch_range = model, input_size, num_classes, batch_range
        self.in_chans = None

    @torch.no_grad()
    def predict(self, x: Tensor) -> Tensor:
        """The model's (first) output for ``x``, called on chunks of at most the highest batch size it takes; a
        chunk below the lowest is padded with zero images whose outputs are dropped (a static-batch program
        then serves any batch, the last short one of an epoch included)."""
        lower, upper = self.batch_range
        step = upper or len(x)
        outs = []
        for start in range(0, len(x), step):
            chunk = x[start : start + step]
            n = len(chunk)
            if n < lower:
                chunk = torch.cat([chunk, chunk.new_zeros(lower - n, *chunk.shape[1:])])
            out = self.model(chunk)
            outs.append((out[0] if isinstance(out, (tuple, list)) else out)[:n])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

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


def load_teacher(path: str | Path, device: torch.device | str = "cpu", img_size: int | None = None) -> Teacher:
    """A frozen teacher in eval mode from a vitlab checkpoint, a ``.pt2`` program or a TorchScript file;
    ``img_size`` overrides the input size the file says (a TorchScript file says none: the batch's size)."""
    path = Path(path).expanduser()
    if path.is_dir() and (path / "last.pt").is_file():  # a `vitlab train` output folder
        path = path / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(f"teacher {path}: no such file")
    kind = _archive_kind(path)
    size = (img_size, img_size) if img_size else None
    batches: tuple[int, int | None] = (1, None)
    if kind == "export":
        program, module = read_export(path)
        size, classes, batches = size or _exported_input_size(program), None, _exported_batch_range(program)
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
    teacher = Teacher(module, size, classes, batches).to(device)
    if kind == "vitlab":
        teacher.in_chans = module.in_chans
    return teacher


def check_student(model: nn.Module) -> None:
    if getattr(model, "head_dist", None) is None:
        raise ValueError(
            "distillation needs a student with a distillation token and head; add --dist-token "
            "(a ViT-family model) or drop --teacher"
        )


SOFT_REDUCTIONS = ("deit", "batchmean")


class DistillationLoss(nn.Module):
    """DeiT's soft or hard distillation loss (module docstring). ``base`` is soft-target cross-entropy (labels
    may be Mixup/CutMix soft targets with label smoothing, as in DeiT); the teacher sees the same augmented
    images, resized to its own input size if that differs."""

    def __init__(
        self,
        teacher: Teacher,
        kind: str = "hard",
        alpha: float = 0.5,
        tau: float = 1.0,
        smoothing: float = 0.0,
        reduction: str = "deit",
    ) -> None:
        super().__init__()
        if kind not in ("hard", "soft"):
            raise ValueError(f"distillation must be 'hard' or 'soft', got {kind!r}")
        if reduction not in SOFT_REDUCTIONS:
            raise ValueError(f"the soft distillation reduction must be one of {SOFT_REDUCTIONS}, got {reduction!r}")
        self.teacher, self.kind, self.alpha, self.tau, self.smoothing = teacher, kind, alpha, tau, smoothing
        self.reduction = reduction

    def check_student(self, student: nn.Module, in_chans: int) -> None:
        check_student(student)
        t, s = self.teacher.num_classes, getattr(student, "num_classes", None)
        if t is not None and s is not None and t != s:
            raise ValueError(f"the teacher predicts {t} classes, the student {s}; use a teacher trained on this data")
        if self.teacher.in_chans is not None and self.teacher.in_chans != in_chans:
            raise ValueError(f"the teacher takes {self.teacher.in_chans}-channel images, the data has {in_chans}")

    def distill_term(self, dist_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        if teacher_logits.shape != dist_logits.shape:
            raise ValueError(
                f"the teacher gives {tuple(teacher_logits.shape)} scores, the student {tuple(dist_logits.shape)}"
            )
        if self.kind == "hard":
            return F.cross_entropy(dist_logits, teacher_logits.argmax(-1))
        t = self.tau
        log_student = F.log_softmax(dist_logits.float() / t, -1)
        log_teacher = F.log_softmax(teacher_logits.float() / t, -1)
        total = F.kl_div(log_student, log_teacher, reduction="sum", log_target=True)
        count = dist_logits.numel() if self.reduction == "deit" else dist_logits.shape[0]
        return total * (t * t) / count

    def forward(self, x: Tensor, outputs: tuple[Tensor, Tensor], target: Tensor, dense=None) -> Tensor:
        if not isinstance(outputs, tuple):
            raise ValueError("the student must return (cls_logits, dist_logits): set model.distilled_training = True")
        cls_logits, dist_logits = outputs
        base = soft_target_cross_entropy(cls_logits, target, self.smoothing)
        return (1 - self.alpha) * base + self.alpha * self.distill_term(dist_logits, self.teacher(x))


def HardDistillationLoss(teacher: nn.Module, smoothing: float = 0.0, alpha: float = 0.5) -> DistillationLoss:
    """DeiT's hard distillation from a vitlab model (kept for callers of the earlier class)."""
    size = tuple(teacher.meta["input_size"][1:]) if hasattr(teacher, "meta") else None
    wrapped = Teacher(teacher.eval().requires_grad_(False), size, getattr(teacher, "num_classes", None))
    wrapped.in_chans = getattr(teacher, "in_chans", None)
    return DistillationLoss(wrapped, "hard", alpha, 1.0, smoothing)
