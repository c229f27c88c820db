"""vitlab train on streaming data: the recipe's transforms, mid-epoch resume, recipes as files, distillation
from exported teachers, token labelling, torchrun on a generated folder, vitlab eval with the model's crop."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.checkpoint import load_checkpoint
from vitlab.cli import main as cli_main
from vitlab.data import CropSpec, ResizeCenterCrop, eval_geometry
from vitlab.data.synth import synthesize
from vitlab.engine import TrainConfig, train
from vitlab.engine.recipes import find_recipe, load_recipe, shipped_recipes
from vitlab.interop.pretrained import load_model

# a tiny DeiT on 32-px crops: 4x4 grid of 8-px patches, one block of width 32
TINY = dict(model="deit_mini", model_args={"patch_size": 8, "depth": 1, "embed_dim": 32}, img_size=32)
TINY_FLAGS = ["--model", "deit_mini", "--model-arg", "patch_size=8", "--model-arg", "depth=1"]
TINY_FLAGS += ["--model-arg", "embed_dim=32", "--img-size", "32", "--threads", "1", "--no-progress"]
TINY_FLAGS += ["--device", "cpu"]  # the CPU suite (gloo, exact resumes), also where a GPU is present


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synth") / "data"
    synthesize(root, num_classes=4, train_per_class=16, val_per_class=4, size=(64, 48), seed=0)
    return root


def quiet(line: str) -> None:
    pass


# --------------------------------------------------------------------------- the evaluation crop


@pytest.mark.parametrize("size", [(375, 500), (500, 375), (224, 224)])
def test_eval_crop_pct_above_one_pads_as_centre_crop_does(size):
    """crop_pct 1.13 (Refined-ViT-L): the shorter side resized to floor(224 / 1.13) = 198 < 224 is padded with
    zeros, (224 - 198) // 2 = 13 before, the rest after (torchvision's CenterCrop); the longer side is cut."""
    spec = CropSpec((224, 224), train=False, crop_pct=1.13)
    (rh, rw), (top, _) = eval_geometry(size, spec)
    scale = math.floor(224 / 1.13)
    assert min(rh, rw) == scale == 198
    x = torch.rand(1, 3, *size, dtype=torch.float64)
    out = ResizeCenterCrop(224, crop_pct=1.13)(x)
    # naive: resize, pad each short side as torchvision's CenterCrop, cut at round((H - 224) / 2)
    r = F.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True, align_corners=False)
    ph, pw = max(0, 224 - rh), max(0, 224 - rw)
    r = F.pad(r, [pw // 2, (pw + 1) // 2, ph // 2, (ph + 1) // 2])
    t, lft = round((r.shape[-2] - 224) / 2), round((r.shape[-1] - 224) / 2)
    assert out.shape == (1, 3, 224, 224)
    torch.testing.assert_close(out, r[..., t : t + 224, lft : lft + 224])
    if rh < 224:
        assert top == -13 and (out[..., :13, :] == 0).all() and (out[..., 13, :] != 0).any()


# --------------------------------------------------------------------------- training on a folder


def test_folder_training_streams_with_the_recipe_transforms(folder, tmp_path):
    """folder: data goes through the StreamLoader (workers), with RandAugment, erasing, repeated augmentation,
    Mixup/CutMix, accumulation and the batch-scaled learning rate; run.json records what produced the run."""
    cfg = TrainConfig(**TINY, data=f"folder:{folder}", out=str(tmp_path / "r"), epochs=1, batch_size=8,
                      base_lr=4e-3, accum_steps=2, workers=1, aug_repeats=3, reprob=0.25, mixup=0.8, cutmix=1.0,
                      auto_augment="rand-m9-mstd0.5-inc1", threads=1, progress=False)  # fmt: skip
    summary = train(cfg, quiet)
    record = json.loads((tmp_path / "r" / "run.json").read_text())
    assert record["global_batch"] == 16 and record["lr"] == pytest.approx(4e-3 * 16 / 512)
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["vitlab"] == vitlab.__version__
    assert record["data_cfg"]["crop_pct"] == 1.0  # deit_mini's own crop (whole small images)
    # 64 images, 3 repeats, 8 per batch -> 8 batches, 2 per step -> 4 optimizer steps
    assert summary["final"]["step"] == 4 and summary["log"][0]["val_top1"] >= 0
    ckpt = load_checkpoint(tmp_path / "r")
    assert ckpt["loader"]["batch"] == 8 and ckpt["data_cfg"]["crop_pct"] == 1.0


def _losses(out: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> Path:
    """The folder as WebDataset shards written by `vitlab data shards`: 8 train and 2 val shards of 8."""
    pytest.importorskip("webdataset")
    out = tmp_path_factory.mktemp("wds") / "shards"
    assert cli_main(["data", "shards", str(folder), str(out), "--shard-size", "8"]) == 0
    return out


def train_stopped_after_third_save(cfg: TrainConfig, monkeypatch) -> list[int]:
    """Train ``cfg`` and stop it (as a kill would) right after its third mid-epoch checkpoint; the steps saved at."""
    import vitlab.engine.loop as engine

    real, saves = engine.save_position, []

    def stop_after_third(run, epoch, tally):
        real(run, epoch, tally)
        saves.append(run.step)
        if len(saves) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(engine, "save_position", stop_after_third)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, quiet)
    monkeypatch.setattr(engine, "save_position", real)
    return saves


@pytest.mark.parametrize("kind", ["folder", pytest.param("wds", marks=pytest.mark.slow)])
def test_resume_mid_epoch_with_two_workers_is_bit_identical(kind, request, tmp_path, monkeypatch):
    """A run stopped right after a mid-epoch checkpoint and resumed ends with the same weights, EMA, log rows
    and per-step losses, bit for bit, as the run never stopped (2 DataLoader workers, augmentation on): on a
    folder (sampler position) and on shards (each worker's place in its shard stream)."""

    data = f"{kind}:{request.getfixturevalue('folder' if kind == 'folder' else 'shards')}"
    base = dict(TINY, data=data, epochs=2, batch_size=8, workers=2, ema=0.9, mixup=0.8, cutmix=1.0,
                auto_augment="rand-m9-mstd0.5-inc1", reprob=0.25, threads=1, progress=False, save_every=3)  # fmt: skip
    train(TrainConfig(**base, out=str(tmp_path / "whole")), quiet)

    saves = train_stopped_after_third_save(TrainConfig(**base, out=str(tmp_path / "cut")), monkeypatch)
    # an odd batch of the second epoch: the worker that makes the next batch is not worker 0's usual one
    assert saves == [3, 6, 9] and load_checkpoint(tmp_path / "cut")["loader"] | {"num_batches": 8} == {
        "epoch": 1, "batch": 1, "seed": 0, "num_batches": 8} | ({"workers": 2} if kind == "wds" else {})  # fmt: skip
    train(TrainConfig(**base, out=str(tmp_path / "cut"), resume="auto"), quiet)
    whole, cut = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "cut")
    for key in ("model", "optimizer"):
        flat_a, flat_b = _flat(whole[key]), _flat(cut[key])
        assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), key
    assert all(torch.equal(whole["ema"]["module"][k], cut["ema"]["module"][k]) for k in whole["ema"]["module"])
    strip = lambda rows: [{k: v for k, v in r.items() if "_s" not in k and "time" not in k} for r in rows]  # noqa: E731
    assert strip(whole["log"]) == strip(cut["log"])
    assert _losses(tmp_path / "whole") == _losses(tmp_path / "cut") and len(_losses(tmp_path / "cut")) == 16


def test_a_resumed_epoch_reports_the_figures_of_the_uninterrupted_one(folder, tmp_path, monkeypatch):
    """Every figure of a resumed epoch's row is the uninterrupted run's: with a clock that moves one second per
    training batch, both runs' epoch 2 took 8 s for 64 images (8 img/s), the part trained before the kill
    included; a row that divided the epoch's images by the resumed part's time alone would read 64 / 7."""
    import vitlab.engine.loop as engine
    from vitlab.engine.config import EpochTally

    clock = [0.0]
    monkeypatch.setattr(EpochTally, "clock", staticmethod(lambda: clock[0]))
    real_step = engine.forward_backward

    def one_second_per_batch(*args, **kwargs):
        clock[0] += 1.0
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "forward_backward", one_second_per_batch)
    base = dict(TINY, data=f"folder:{folder}", epochs=2, batch_size=8, threads=1, progress=False, save_every=3)
    whole = train(TrainConfig(**base, out=str(tmp_path / "whole")), quiet)["log"]
    assert train_stopped_after_third_save(TrainConfig(**base, out=str(tmp_path / "cut")), monkeypatch) == [3, 6, 9]
    cut = train(TrainConfig(**base, out=str(tmp_path / "cut"), resume="auto"), quiet)["log"]
    timing = ("elapsed_s", "eval_img_s")  # wall-clock figures outside the training steps
    assert [{k: v for k, v in r.items() if k not in timing} for r in cut] == [
        {k: v for k, v in r.items() if k not in timing} for r in whole
    ]
    assert cut[1]["train_time_s"] == 8.0 and cut[1]["train_img_s"] == 8.0


def _flat(tree, prefix="") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}/{i}").items()}
    return {prefix: torch.tensor(float(tree))} if isinstance(tree, (int, float)) else {}


# --------------------------------------------------------------------------- recipes


REPO = Path(__file__).resolve().parents[1]


def test_every_paper_model_has_a_recipe_that_validates():
    from vitlab.models import get_config

    assert len(shipped_recipes()) >= 30
    for name, path in shipped_recipes().items():
        assert load_recipe(name)[0] == path
        _, options, reference = load_recipe(str(path))
        get_config(options["model"])  # a registered model
        TrainConfig(**options)  # every value in its range
        assert reference["source"] and ("top1" in reference), path
        assert reference["top1"] is None or 60 < reference["top1"] < 100, path  # ImageNet, or a transfer set
    deit = load_recipe("deit_tiny")[1]
    cfg = TrainConfig(**deit)
    assert cfg.global_batch == 1024 and cfg.peak_lr == pytest.approx(1e-3) and cfg.aug_repeats == 3


def _documented_recipes() -> list[str]:
    """The recipe names of the table in docs/training.md."""
    text = (REPO / "docs" / "training.md").read_text()
    return [line.split("`")[1] for line in text.splitlines() if line.startswith("| `")]


def test_every_recipe_resolves_by_name_from_the_installed_package(tmp_path, monkeypatch):
    """Each recipe of the docs' table is package data: `--config NAME` finds it through importlib.resources,
    from any working directory (none holds a recipes/ folder here), and reads it."""
    from importlib import resources

    monkeypatch.chdir(tmp_path)
    names = _documented_recipes()
    assert len(names) >= 30 and sorted(names) == sorted(shipped_recipes())
    for name in names:
        packaged = shipped_recipes()[name]  # recipes/<paper>/<name>.yaml inside the installed package
        assert packaged.parent.parent == Path(str(resources.files("vitlab") / "recipes")), packaged
        assert packaged.is_file() and find_recipe(name) == Path(str(packaged)), name
    (tmp_path / "recipes").mkdir()  # a user's own recipe of a shipped name comes first
    (tmp_path / "recipes" / "deit_tiny.toml").write_text('model = "deit_mini"\nepochs = 3\n')
    assert load_recipe("deit_tiny")[1] == {"model": "deit_mini", "epochs": 3}
    with pytest.raises(FileNotFoundError, match="shipped: aft_conv_base_384_ft, "):
        find_recipe("deit_nano")


@pytest.mark.slow
def test_the_wheel_carries_the_recipes(tmp_path):
    """`pip wheel` of the project (offline, no build isolation) puts every recipe into the wheel."""
    import zipfile

    src = tmp_path / "project"  # a copy: the build writes build/ and an egg-info beside the sources
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "w"),
           str(src)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "w").glob("vitlab-*.whl")
    with zipfile.ZipFile(wheel) as z:
        inside = sorted(
            Path(n).stem
            for n in z.namelist()
            if n.startswith("vitlab/recipes/") and n.endswith(".yaml") and n.count("/") == 3
        )
    assert inside == sorted(_documented_recipes()) and len(inside) >= 30


def test_recipe_keys_are_checked_and_the_command_line_wins(tmp_path, capsys, monkeypatch):
    import vitlab.engine.loop as engine

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: deit_mini\nepochz: 3\n")
    assert cli_main(["train", "--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'epochz'" in err
    bad.write_text("model: deit_mini\nreprob: 2\n")
    assert cli_main(["train", "--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "reprob" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(engine, "train", lambda cfg: seen.setdefault("cfg", cfg))
    assert cli_main(["train", "--config", "deit_tiny", "--epochs", "2", "--lr", "0.01", "--out", str(tmp_path)]) == 0
    cfg = seen["cfg"]
    assert cfg.epochs == 2 and cfg.peak_lr == 0.01 and cfg.base_lr is None  # --lr replaces the recipe's base_lr
    assert cfg.model == "deit_tiny_patch16_224" and cfg.aug_repeats == 3 and cfg.recipe.endswith("deit_tiny.yaml")


# --------------------------------------------------------------------------- distillation


def _student() -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", img_size=32, num_classes=4, patch_size=8, depth=1, embed_dim=32,
                                dist_token=True)  # fmt: skip
    model.distilled_training = True
    return model.train()


class SmallCnn(torch.nn.Module):
    """A teacher of another kind, at its own input size (24 px)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.conv(x).relu().mean((2, 3)))


@pytest.mark.parametrize("kind", ["export", "torchscript"])
def test_soft_and_hard_distillation_equal_deit_equations_for_exported_teachers(tmp_path, kind):
    from vitlab.distill.loss import DistillationLoss
    from vitlab.distill.teacher import load_teacher

    torch.manual_seed(1)
    cnn = SmallCnn().eval()
    example = torch.randn(2, 3, 24, 24)
    path = tmp_path / ("t.pt2" if kind == "export" else "t.pt")
    if kind == "export":
        batch = {"x": {0: torch.export.Dim("batch", min=1, max=1024)}}  # any batch size
        torch.export.save(torch.export.export(cnn, (example,), dynamic_shapes=batch), path)
    else:
        torch.jit.trace(cnn, example).save(str(path))
    teacher = load_teacher(path, img_size=None if kind == "export" else 24)
    assert teacher.input_size == (24, 24)
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 3, 1])
    with torch.no_grad():
        z_t = cnn(F.interpolate(x, size=(24, 24), mode="bilinear", antialias=True, align_corners=False)).double()
    student = _student()
    cls, dist = out = student(x)
    hard = DistillationLoss(teacher, "hard", 0.5, 1.0, 0.0)(x, out, y)
    naive_hard = 0.5 * F.cross_entropy(cls, y) + 0.5 * F.cross_entropy(dist, z_t.argmax(-1))
    torch.testing.assert_close(hard, naive_hard, rtol=1e-5, atol=1e-6)
    tau, alpha = 3.0, 0.7
    p_t, log_p_s = (z_t / tau).softmax(-1), (dist.double() / tau).log_softmax(-1)
    pointwise = p_t * (p_t.log() - log_p_s)  # (B, C): DeiT's code sums these and divides by B x C by default
    for reduction, kl in (("deit", pointwise.sum() / pointwise.numel()), ("batchmean", pointwise.sum(-1).mean())):
        soft = DistillationLoss(teacher, "soft", alpha, tau, 0.0, reduction)(x, out, y)
        naive_soft = (1 - alpha) * F.cross_entropy(cls.double(), y) + alpha * tau**2 * kl
        torch.testing.assert_close(soft.double(), naive_soft, rtol=1e-5, atol=1e-6)
    assert DistillationLoss(teacher, "soft", alpha, tau).reduction == "deit"
    soft.backward()  # the student learns, the teacher does not
    assert student.head_dist.weight.grad is not None
    assert all(not p.requires_grad for p in teacher.parameters())


class DenseCnn(SmallCnn):
    """The same CNN without its global pool: class scores at every location, (B, 4, 11, 11) at 24 px."""

    def forward(self, x):
        return self.fc(self.conv(x).relu().permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


EXPORTS = {  # the batch dimension as exported, and the batch range the teacher reads from the program
    "static": (None, (2, 2)),
    "auto": ({"x": {0: torch.export.Dim.AUTO}}, (2, None)),  # torch.export's AUTO batch takes 2 and more
    "bounded": ({"x": {0: torch.export.Dim("batch", min=1, max=3)}}, (1, 3)),
}


def _export(model: torch.nn.Module, path: Path, batch: str) -> Path:
    dims, _ = EXPORTS[batch]
    torch.export.save(torch.export.export(model.eval(), (torch.randn(2, 3, 24, 24),), dynamic_shapes=dims), path)
    return path


@pytest.mark.parametrize("batch", sorted(EXPORTS))
def test_a_pt2_teacher_of_any_batch_dimension_serves_every_batch_size(tmp_path, batch):
    """A program exported with a static batch of 2 (or a dynamic batch with bounds) is called on chunks it takes,
    a short chunk padded: its logits equal the eager teacher's for batches below, at and above those sizes."""
    from vitlab.distill.teacher import load_teacher

    torch.manual_seed(2)
    cnn = SmallCnn().eval()
    teacher = load_teacher(_export(cnn, tmp_path / "t.pt2", batch))
    assert teacher.batch_range == EXPORTS[batch][1] and teacher.input_size == (24, 24)
    for n in (1, 2, 3, 5):
        x = torch.randn(n, 3, 32, 32)
        with torch.no_grad():
            eager = cnn(F.interpolate(x, size=(24, 24), mode="bilinear", antialias=True, align_corners=False))
        torch.testing.assert_close(teacher(x), eager)  # float32 tolerances: same math, other batch shapes


def test_relabel_with_a_static_batch_program_equals_the_eager_teacher(folder, tmp_path):
    """`vitlab relabel` with a dense teacher exported at batch 2, fed 3 images per call (a full chunk and a
    padded one): the written maps are the eager teacher's top-k probabilities and classes."""
    from vitlab.data import create_transform
    from vitlab.distill.relabel import image_files, top_k_maps

    torch.manual_seed(3)
    cnn = DenseCnn().eval()
    path = _export(cnn, tmp_path / "dense.pt2", "static")
    assert cli_main(["relabel", str(path), str(folder), "--top-k", "2", "--batch-size", "3", "--out",
                     str(tmp_path / "maps"), "--threads", "1"]) == 0  # fmt: skip
    files = image_files(folder)
    tf = create_transform((24, 24), crop_mode="squash", crop_pct=1.0)
    with torch.no_grad():
        eager = top_k_maps(cnn(torch.stack([tf(f) for f in files])), 2)
    written = np.stack([np.load(tmp_path / "maps" / f"{f.relative_to(folder)}.tl.npy") for f in files])
    assert written.shape == eager.shape == (80, 2, 2, 11, 11)
    eps = float(np.finfo(np.float16).eps)  # one float16 step of a probability <= 1 (float32 sums differ below it)
    np.testing.assert_allclose(written[:, 0], eager[:, 0], atol=eps, rtol=0)
    apart = np.abs(eager[:, 0, 0] - eager[:, 0, 1]) > 2 * eps  # the top classes are decided where not tied
    assert apart.mean() > 0.9
    assert np.array_equal(written[:, 1, 0][apart], eager[:, 1, 0][apart])


def test_a_pt2_teacher_with_pickled_objects_is_refused(tmp_path, monkeypatch):
    from vitlab.distill import teacher as distill

    real_load = torch.load
    torch.export.save(torch.export.export(SmallCnn().eval(), (torch.randn(1, 3, 24, 24),)), tmp_path / "t.pt2")
    real_loads, real_obj = pickle.loads, torch._C._pickle_load_obj
    with distill._no_pickled_code(tmp_path / "t.pt2"):
        for unpickle in (pickle.loads, torch._C._pickle_load_obj):  # what the archive reader may call
            with pytest.raises(ValueError, match="pickled Python objects"):
                unpickle(pickle.dumps(SmallCnn))
        with pytest.raises(Exception, match=r"[Ww]eights only|weights_only|Unsupported"):
            torch.load(_pickled_object(tmp_path), weights_only=False)
        assert isinstance(torch.export.load(tmp_path / "t.pt2"), torch.export.ExportedProgram)  # tensors still load
    assert (torch.load, pickle.loads, torch._C._pickle_load_obj) == (real_load, real_loads, real_obj)  # restored


def _pickled_object(tmp_path: Path) -> Path:
    path = tmp_path / "obj.pt"
    torch.save({"f": SmallCnn}, path)  # a class: weights_only refuses it
    return path


# --------------------------------------------------------------------------- token labelling


def test_token_label_step_equals_the_naive_loss(tmp_path):
    """One training step's loss with dense targets = CE(cls logits, y) + 0.5 mean_n CE(aux logits_n, y_n)."""
    from vitlab.data import crop_dense
    from vitlab.data.geometry import Box
    from vitlab.engine.losses import TokenLabelLoss

    torch.manual_seed(0)
    model = vitlab.create_model("refiner_vit_mini", img_size=32, num_classes=5, patch_size=8, aux_head=True)
    model.token_label_training = True
    model.train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 4])
    rng = np.random.default_rng(0)
    maps = [np.stack([rng.random((3, 6, 6)), rng.integers(0, 5, (3, 6, 6))]).astype(np.float16) for _ in range(2)]
    boxes = [Box(5.0, 3.0, 30.0, 40.0, (48, 64), flip=b) for b in (False, True)]
    parts = [crop_dense(m, b, (4, 4)) for m, b in zip(maps, boxes)]
    dense = (torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    cls, tokens = out = model(x)
    loss = TokenLabelLoss(0.5, 0.0)(x, out, y, dense)
    # naive: every patch's target, class by class, renormalised; the mean over patches of its cross-entropy
    naive_dense = 0.0
    for b in range(2):
        for n in range(16):
            t = torch.zeros(5, dtype=torch.float64)
            for c, w in zip(dense[0][b, n].tolist(), dense[1][b, n].tolist()):
                t[c] += w
            t = t / t.sum()
            naive_dense += -(t * tokens[b, n].double().log_softmax(-1)).sum() / 32
    naive = F.cross_entropy(cls.double(), y) + 0.5 * naive_dense
    torch.testing.assert_close(loss.double(), naive, rtol=1e-5, atol=1e-6)


def test_token_labelling_trains_from_relabelled_maps(folder, tmp_path):
    """vitlab relabel writes dense maps beside a copy of the images from a teacher checkpoint; a Refiner
    then trains on them with MixToken and the aux loss."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(folder, data)
    cfg = dict(
        model="refiner_vit_mini",
        model_args={"patch_size": 8, "aux_head": True},
        img_size=32,
        threads=1,
        progress=False,
        epochs=1,
        batch_size=8,
    )
    train(TrainConfig(**cfg, data=f"folder:{data}", out=str(tmp_path / "teacher")), quiet)
    assert cli_main(["relabel", str(tmp_path / "teacher"), str(data), "--top-k", "3", "--threads", "1"]) == 0
    maps = sorted(data.rglob("*.tl.npy"))
    assert len(maps) == 80
    m = np.load(maps[0])
    assert m.shape == (2, 3, 4, 4) and m.dtype == np.float16 and (np.diff(m[0], axis=0) <= 0).all()
    summary = train(TrainConfig(**cfg, data=f"folder:{data}", out=str(tmp_path / "tl"), token_label=True,
                                cutmix=1.0, workers=1), quiet)  # fmt: skip
    assert math.isfinite(summary["final"]["train_loss"])


# --------------------------------------------------------------------------- processes, recipe, eval


def test_two_torchrun_processes_train_on_a_generated_folder(folder, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "vitlab.cli",
           "train", *TINY_FLAGS, "--data", f"folder:{folder}", "--epochs", "1", "--batch-size", "16",
           "--aug-repeats", "2", "--workers", "1", "--out", str(tmp_path / "ddp")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 processes (DDP)" in done.stdout
    assert load_checkpoint(tmp_path / "ddp")["step"] == 4  # 64 images / 8 per process per batch


def _recipe_run(folder: Path, out: Path, epochs: int) -> int:
    return cli_main(["train", "--config", "deit_tiny", "--data", f"folder:{folder}", "--img-size", "64",
                     "--model", "deit_mini",
                     "--model-arg", "patch_size=8", "--model-arg", "depth=2", "--model-arg", "embed_dim=64",
                     "--batch-size", "32", "--workers", "2", "--epochs", str(epochs), "--threads", "2",
                     "--warmup-epochs", "1", "--lr", "2e-3", "--aug-repeats", "1", "--reprob", "0", "--mixup", "0", "--cutmix", "0",
                     "--auto-augment", "rand-m5-mstd0.5-inc1", "--drop-path", "0", "--no-progress",
                     "--out", str(out)])  # fmt: skip


def test_the_deit_recipe_runs_on_a_generated_folder_and_eval_reads_its_val(folder, tmp_path, capsys):
    """Smoke: `vitlab train --config deit_tiny --data folder:... --img-size 64` (the recipe's options, a tiny
    model), then `vitlab eval CKPT --data folder:ROOT/val`: top-1/top-5 with the model's crop."""
    assert _recipe_run(folder, tmp_path / "run", 1) == 0
    rows_file = tmp_path / "eval.json"
    assert (
        cli_main(["eval", str(tmp_path / "run"), "--data", f"folder:{folder / 'val'}", "--json", str(rows_file)]) == 0
    )
    (row,) = json.loads(rows_file.read_text())
    assert row["n"] == 16 and 0 <= row["top1"] <= row["top5"] <= 100
    # the checkpoint knows its classes by name: eval labels a val folder by them, not by its own sorted order
    classes = sorted(p.name for p in (folder / "train").iterdir())
    assert load_model(str(tmp_path / "run")).pretrained_cfg["label_names"] == classes
    other = tmp_path / "other_val"
    shutil.copytree(folder / "val", other)
    (other / classes[0]).rename(other / "not_a_trained_class")
    assert cli_main(["eval", str(tmp_path / "run"), "--data", f"folder:{other}"]) == 2
    assert "class folders the training split does not have: not_a_trained_class" in capsys.readouterr().err


@pytest.mark.slow
def test_the_deit_recipe_learns_a_generated_folder(tmp_path):
    root = tmp_path / "data"
    synthesize(root, num_classes=4, train_per_class=150, val_per_class=25, size=(96, 72), seed=1)
    assert _recipe_run(root, tmp_path / "run", 12) == 0
    rows_file = tmp_path / "eval.json"
    assert cli_main(["eval", str(tmp_path / "run"), "--data", f"folder:{root / 'val'}", "--json", str(rows_file)]) == 0
    (row,) = json.loads(rows_file.read_text())
    assert row["top1"] > 60  # chance: 25 %
