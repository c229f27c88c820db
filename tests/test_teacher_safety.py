"""Teachers that cannot run code: crafted ``.pt2`` programs and TorchScript files are refused with one line and
leave no trace on disk; malformed files are one line; real exported and traced models still load and agree.

Every crafted file carries a payload that would write a marker file (or folder) if anything in it ran: an
operator that opens files, a Python callable as a node target, a shape expression or guard that torch would
``eval``/``exec``, a pickle torch would unpickle unsafely, a compiled library, a custom object, a TorchScript
``forward`` or ``__setstate__`` that creates a file. The loader refuses each before torch reads it (or, for
TorchScript, before its forward runs), through ``load_teacher``, ``vitlab relabel`` and a recipe's ``teacher``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vitlab
from vitlab.checkpoint import save_checkpoint
from vitlab.cli import main as cli_main
from vitlab.data.synth import synthesize
from vitlab.distill.safety import check_expression, check_guard, check_target
from vitlab.distill.teacher import TeacherError, load_teacher


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, stride=2), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.conv(x).relu().mean((2, 3)))


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """A real program (static batch 2, 24 px) that the crafted files are edited from."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("good") / "good.pt2"
    torch.export.save(torch.export.export(SmallCnn().eval(), (torch.randn(2, 3, 24, 24),)), path)
    return path


def files_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def craft(src: Path, dst: Path, edit: Callable[[dict], None] | None = None, members: dict | None = None) -> Path:
    """A copy of the program ``src`` with its JSON edited and members added or replaced (names below the root)."""
    with zipfile.ZipFile(src) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    root = next(iter(entries)).split("/")[0]
    if edit is not None:
        model = json.loads(entries[f"{root}/models/model.json"])
        edit(model)
        entries[f"{root}/models/model.json"] = json.dumps(model).encode()
    for name, blob in (members or {}).items():
        entries[f"{root}/{name}"] = blob
    with zipfile.ZipFile(dst, "w") as z:
        for name, blob in entries.items():
            z.writestr(name, blob)
    return dst


def node(model: dict, target: str) -> dict:
    return next(n for n in model["graph_module"]["graph"]["nodes"] if n["target"] == target)


RELU = "torch.ops.aten.relu.default"


def calls(target: str, marker: Path) -> Callable[[dict], None]:
    """Replace the relu by a call of ``target`` on the marker's path (what a file-writing call would take)."""

    def edit(model: dict) -> None:
        n = node(model, RELU)
        n["target"] = target
        n["inputs"] = [
            {"name": "filename", "arg": {"as_string": str(marker)}, "kind": 1},
            {"name": "shared", "arg": {"as_bool": True}, "kind": 2},
            {"name": "size", "arg": {"as_int": 4}, "kind": 2},
        ]

    return edit


def _set(path: list, value) -> Callable[[dict], None]:
    def edit(model: dict) -> None:
        obj = model
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return edit


def _operator_argument(model: dict) -> None:
    node(model, RELU)["inputs"].append({"name": "op", "arg": {"as_operator": "torch.ops.aten.from_file.default"}})


def _shape_expression(marker: Path) -> Callable[[dict], None]:
    code = f"__import__('os').mkdir({str(marker)!r})"
    return lambda m: m["graph_module"]["graph"]["tensor_values"]["conv2d"]["sizes"].__setitem__(
        0, {"as_expr": {"expr_str": code, "hint": {"as_int": 2}}}
    )


def _node_name(marker: Path) -> Callable[[dict], None]:
    return lambda m: node(m, RELU).__setitem__("name", f"relu = __import__('os').mkdir({str(marker)!r})")


class MakeDir:
    """A pickle whose loading creates a folder (``os.mkdir``): what unpickling untrusted data can do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _pickled_weight(marker: Path) -> tuple[Callable | None, dict]:
    def members(src: Path) -> dict:
        with zipfile.ZipFile(src) as z:
            name = next(n for n in z.namelist() if n.endswith("model_weights_config.json"))
            config = json.loads(z.read(name))
        config["config"]["conv.weight"]["use_pickle"] = True
        return {"data/weights/model_weights_config.json": json.dumps(config).encode(), "data/weights/weight_0":
                pickled(MakeDir(marker))}  # fmt: skip

    return None, members


def crafted_cases(marker: Path) -> dict[str, tuple]:
    """name -> (edit of the JSON, members to add or a function of the source giving them, words of the refusal)."""
    mk = f"__import__('os').mkdir({str(marker)!r})"
    return {
        "aten.from_file": (calls("torch.ops.aten.from_file.default", marker), {}, "aten::from_file"),
        "torch.from_file (a Python function)": (calls("torch.from_file", marker), {}, "not a tensor operator"),
        "os.system": (calls("os.system", marker), {}, "not a tensor operator"),
        "builtins.eval": (calls("builtins.eval", marker), {}, "not a tensor operator"),
        "custom namespace": (calls("torch.ops.evil.touch.default", marker), {}, "custom namespace"),
        "torchbind call": (calls("torch.ops.higher_order.call_torchbind", marker), {}, "higher-order"),
        "operator argument": (_operator_argument, {}, "aten::from_file"),
        "shape expression": (_shape_expression(marker), {}, "shape expression"),
        "guard code": (_set(["guards_code"], [f"{mk} == 0"]), {}, "guard"),
        "node name": (_node_name(marker), {}, "not a plain identifier"),
        "custom object": (
            _set(["graph_module", "graph", "custom_obj_values"], {"o": {"name": "o", "class_fqn": "os.system"}}),
            {},
            "custom",
        ),
        "pickled sample inputs": (None, {"data/sample_inputs/model.pt": pickled(MakeDir(marker))}, "sample inputs"),
        "pickled weight": (*_pickled_weight(marker), "pickle"),
        "compiled library": (None, {"data/aotinductor/model/model.so": b"\x7fELF" + b"\0" * 60}, "aotinductor"),
        "pickled custom object": (None, {"data/constants/custom_obj_0": pickled(MakeDir(marker))}, "custom_obj_0"),
    }


CASES = sorted(crafted_cases(Path("m")))


def assert_refused(path: Path, marker: Path, words: str, load=load_teacher) -> None:
    before = files_under(path.parent)
    with pytest.raises(TeacherError) as e:
        load(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith("refusing teacher") and words in message, message
    assert not marker.exists() and files_under(path.parent) == before  # no trace on disk


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_program_is_refused_without_a_trace(program, tmp_path, case):
    marker = tmp_path / "marker"
    edit, members, words = crafted_cases(marker)[case]
    path = craft(program, tmp_path / "crafted.pt2", edit, members(program) if callable(members) else members)
    assert_refused(path, marker, words)


@pytest.mark.parametrize("case", ["guard code", "pickled sample inputs"])
def test_the_payloads_are_live_without_the_check(program, tmp_path, case):
    """Under torch's own loader the payloads run (why the check exists): torch.export builds the module by
    exec-ing the guard code it carries (run at the first call), and retries sample inputs with ``weights_only=False``."""
    marker = tmp_path / "marker"
    edit, members, _ = crafted_cases(marker)[case]
    path = craft(program, tmp_path / "crafted.pt2", edit, members)
    with contextlib.suppress(Exception):
        torch.export.load(path).module()(torch.randn(2, 3, 24, 24))  # guards run with the first call
    assert marker.exists()


def test_relabel_and_a_recipe_refuse_the_same_way(program, tmp_path, capsys):
    """`vitlab relabel` prints the refusal as one line; a recipe's teacher goes through the same loader."""
    from vitlab.engine.config import TrainConfig
    from vitlab.engine.losses import make_criterion
    from vitlab.engine.recipes import load_recipe

    marker = tmp_path / "marker"
    path = craft(program, tmp_path / "crafted.pt2", calls("torch.ops.aten.from_file.default", marker))
    (tmp_path / "images").mkdir()
    capsys.readouterr()
    assert cli_main(["relabel", str(path), str(tmp_path / "images"), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing teacher" in err and "Traceback" not in err
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"teacher = {json.dumps(str(path))}\ndist_token = true\n")
    _, values, _ = load_recipe(str(recipe))
    student = vitlab.create_model("deit_mini", img_size=24, num_classes=4, patch_size=8, depth=1, dist_token=True)
    cfg = TrainConfig(**values)

    def via_recipe(p: Path) -> None:
        make_criterion(cfg, student, 3, torch.device("cpu"))

    assert_refused(path, marker, "aten::from_file", via_recipe)


def test_code_like_metadata_never_reaches_torch(program, tmp_path):
    """Stack traces and module paths are free text: left out of what torch reads, so the file loads as it is."""
    marker = tmp_path / "marker"

    def edit(model: dict) -> None:
        for n in model["graph_module"]["graph"]["nodes"]:
            n["metadata"]["stack_trace"] = f"\n__import__('os').mkdir({str(marker)!r})\n"
            n["metadata"]["nn_module_stack"] = "L__self__,,os.system"
        model["graph_module"]["metadata"] = {"custom": "{}"}

    teacher = load_teacher(craft(program, tmp_path / "meta.pt2", edit))
    assert teacher(torch.randn(1, 3, 24, 24)).shape == (1, 4) and not marker.exists()


# --------------------------------------------------------------------------- TorchScript


class FromFileForward(nn.Module):
    """A forward that creates a file (``torch.from_file(..., shared=True)``)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x):
        return x + torch.from_file(self.marker, shared=True, size=4).sum()


class FromFileSetState(nn.Module):
    """A module whose ``__setstate__`` (run by ``torch.jit.load``) creates a file."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x):
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return self.marker, self.training

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.marker, self.training = state[0], state[1]
        torch.from_file(self.marker, shared=True, size=4)


class PrintForward(nn.Module):
    def forward(self, x):
        print("teacher says hello")
        return x


SCRIPTS = {
    "from_file in forward": (FromFileForward, "aten::from_file"),
    "__setstate__": (FromFileSetState, "__setstate__"),
    "print in forward": (PrintForward, "prim::Print"),
}


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_a_crafted_torchscript_teacher_is_refused_without_a_trace(tmp_path, case):
    marker = tmp_path / "marker"
    cls, words = SCRIPTS[case]
    module = cls(str(marker)) if cls is not PrintForward else cls()
    path = tmp_path / "crafted.pt"
    torch.jit.script(module).save(str(path))
    assert not marker.exists()  # scripting and saving ran nothing
    assert_refused(path, marker, words, lambda p: load_teacher(p, img_size=24))


# --------------------------------------------------------------------------- malformed files


def malformed(program: Path, tmp_path: Path) -> dict[str, Path]:
    """Files named .pt2 that are not programs, and damaged ones (TorchScript too)."""
    data = program.read_bytes()
    rng = np.random.default_rng(0)
    files: dict[str, bytes] = {
        "text": b"this is not a program\n",
        "empty": b"",
        "random bytes": rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        **{f"truncated at {n}": data[:n] for n in (4, 30, len(data) // 3, len(data) // 2, len(data) - 22)},
    }
    paths = {name: tmp_path / f"{i}.pt2" for i, name in enumerate(files)}
    for name, blob in files.items():
        paths[name].write_bytes(blob)
    state = {"model_name": "deit_mini", "model_kwargs": {}, "model": {}}
    paths["a vitlab checkpoint renamed"] = save_checkpoint(state, tmp_path / "ckpt.pt2")
    script = tmp_path / "script.pt2"
    torch.jit.trace(SmallCnn().eval(), torch.randn(1, 3, 24, 24)).save(str(script))
    paths["a TorchScript file renamed"] = script
    paths["model.json not JSON"] = craft(program, tmp_path / "json.pt2", members={"models/model.json": b"{not json"})
    paths["truncated TorchScript"] = tmp_path / "short.pt"
    paths["truncated TorchScript"].write_bytes(script.read_bytes()[:-200])
    return paths


def test_every_malformed_teacher_is_one_line(program, tmp_path, capsys):
    paths = malformed(program, tmp_path)
    for name, path in paths.items():
        with pytest.raises(ValueError) as e:
            load_teacher(path, img_size=24)
        assert "\n" not in str(e.value) and str(path) in str(e.value), (name, str(e.value))
    (tmp_path / "images").mkdir()
    capsys.readouterr()
    for name in ("random bytes", "a vitlab checkpoint renamed", "truncated at 30"):
        assert cli_main(["relabel", str(paths[name]), str(tmp_path / "images"), "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, (name, err)


# --------------------------------------------------------------------------- real teachers still load


def _deit() -> nn.Module:
    torch.manual_seed(3)
    return vitlab.create_model("deit_mini", img_size=32, num_classes=5, patch_size=8, depth=1, embed_dim=32).eval()


@pytest.mark.parametrize("dynamic", [False, True])
def test_an_exported_vitlab_model_loads_and_gives_its_logits(tmp_path, dynamic):
    """deit_mini through torch.export (its fast paths' registered operator included, shape expressions for a
    dynamic batch): the checked load gives the model's logits."""
    model, x = _deit(), torch.randn(2, 3, 32, 32)
    path = tmp_path / "deit.pt2"
    dims = {"x": {0: torch.export.Dim("batch", min=1, max=8)}} if dynamic else None
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes=dims), path)
    teacher = load_teacher(path)
    assert teacher.input_size == (32, 32) and teacher.batch_range == ((1, 8) if dynamic else (2, 2))
    for n in (1, 3):
        x = torch.randn(n, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(teacher(x), model(x))


def test_a_traced_vitlab_model_loads_and_gives_its_logits(tmp_path):
    model, x = _deit(), torch.randn(2, 3, 32, 32)
    path = tmp_path / "deit.pt"
    with torch.no_grad():
        torch.jit.trace(model, x).save(str(path))
    teacher = load_teacher(path, img_size=32)
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), model(x))


# --------------------------------------------------------------------------- the checks themselves


@pytest.mark.parametrize(
    "name, allowed",
    [
        ("torch.ops.aten.conv2d.default", True),
        ("torch.ops.prims.convert_element_type.default", True),
        ("torch.ops.higher_order.cond", True),
        ("_operator.getitem", True),
        ("torch.sym_max", True),
        ("torch.ops.aten.from_file.default", False),
        ("torch.ops.aten._print.default", False),
        ("torch.ops.vitlab.onednn_linear.default", True),  # vitlab's own (a fast-path export calls it)
        ("torch.ops.vitlab.run.default", False),
        ("torch.ops.higher_order.call_torchbind", False),
        ("torch.save", False),
        ("#custom:op", False),
    ],
)
def test_operator_allowlist(name, allowed):
    assert (check_target(name) is None) == allowed


def test_expressions_and_guards():
    srepr = "Add(Mul(Integer(2), Symbol('s77', positive=True, integer=True)), Float('-1.5e-3', precision=53))"
    for ok in ("s77", "2*s0 + 1", "FloorDiv(s77, 2)", "Eq(Mod(s0, 4), 0)", "-s1 + Max(1, s2)", srepr):
        assert check_expression(ok) is None, ok
    for bad in ("__import__('os')", "s0.__class__", "lambdify(s0, 'x')", "s0; 1", "'abc'", "Symbol('os.system')"):
        assert check_expression(bad) is not None, bad
    for ok in ("L['x'].size()[0] <= 1024", "L['x'].size()[2] == L['x'].size()[3] and 2 <= L['x'].size()[0]"):
        assert check_guard(ok) is None, ok
    for bad in ("__import__('os').system('x')", "L['x'].__class__", "open('f')", "L['x'].size(0) == (lambda: 1)()"):
        assert check_guard(bad) is not None, bad


def test_wrong_weights_and_oversized_archives_are_one_line_before_loading(program, tmp_path, monkeypatch):
    """A weight with fewer bytes than its shape needs is named (not torch's deserialisation error); a member
    that would inflate past the bound (a zip bomb) and a file larger than any teacher are refused unread."""
    import vitlab.distill.safety as safety

    short = craft(program, tmp_path / "short.pt2", members={"data/weights/weight_0": b"\0" * 8})
    with pytest.raises(TeacherError, match=r"'conv.weight' holds 8 bytes where its shape and dtype need 864"):
        load_teacher(short, img_size=24)
    bomb = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(program) as src, zipfile.ZipFile(bomb, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
        dst.writestr("good/extra", b"\0" * 2**22, compress_type=zipfile.ZIP_DEFLATED)  # 4 MiB -> ~4 KiB
    with pytest.raises(TeacherError, match="would unpack to"):
        load_teacher(bomb, img_size=24)
    monkeypatch.setattr(safety, "MAX_TEACHER_BYTES", 1000)
    with pytest.raises(TeacherError, match="more than any teacher"):
        load_teacher(program, img_size=24)


# --------------------------------------------------------------------------- teachers that never answer, or fail


class EndlessLoop(nn.Module):
    """A forward whose loop never ends (TorchScript compiles it to ``prim::Loop``)."""

    def forward(self, x):
        i = 0
        while i >= 0:
            i = i + 1
        return x.mean((2, 3))


def add_three_times(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = x + 1
    return x


class LoopInACalledFunction(nn.Module):
    def forward(self, x):
        return add_three_times(x).mean((2, 3))


class LoopInABranch(nn.Module):
    def forward(self, x):
        if x.shape[0] > 0:
            for _ in range(x.shape[1]):
                x = x * 2
        return x.mean((2, 3))


class DimensionsTimesAMillion(nn.Module):
    def forward(self, x):
        for _ in range(len(x.size()) * 1000000):
            x = x + 1
        return x.mean((2, 3))


class LoopInALoop(nn.Module):
    """Two loops over the dimensions, one within the other (nesting multiplies what each bounds)."""

    def forward(self, x):
        for _ in range(x.dim()):
            for _ in range(x.dim()):
                x = x + 1
        return x.mean((2, 3))


class RepeatedList(nn.Module):
    def forward(self, x):
        for _ in range(len([1] * 1000000)):
            x = x + 1
        return x.mean((2, 3))


LOOPS = [EndlessLoop, LoopInACalledFunction, LoopInABranch, DimensionsTimesAMillion, LoopInALoop, RepeatedList]


@pytest.mark.parametrize("cls", LOOPS, ids=[c.__name__ for c in LOOPS])
def test_a_torchscript_teacher_with_a_loop_is_refused(tmp_path, cls):
    """A loop could run forever inside C++, where nothing interrupts it: refused wherever it is (the forward, a
    function it calls, a sub-block), before anything runs; a ``for`` over a tensor's dimensions passes only with
    its count unchanged (give or take a little) and not within another loop."""
    path = tmp_path / "loop.pt"
    torch.jit.script(cls()).save(str(path))
    assert_refused(path, tmp_path / "marker", "prim::Loop", lambda p: load_teacher(p, img_size=24))


class NormsAndResize(nn.Module):
    """Layers whose scripted code loops over a tensor's dimensions (BatchNorm's and GroupNorm's batch-size checks,
    the output size of an interpolation): what a scripted CNN holds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.gn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.gn(self.bn(self.conv(x)))
        return self.fc(nn.functional.interpolate(x, scale_factor=0.5, mode="bilinear").mean((2, 3)))


def test_a_scripted_cnn_with_loops_over_its_dimensions_still_teaches(tmp_path):
    torch.manual_seed(0)
    model, path = NormsAndResize().eval(), tmp_path / "cnn.pt"
    script = torch.jit.script(model)
    graph = script.forward.inlined_graph
    assert graph.findAllNodes("prim::Loop", True)  # the loops are there, and pass
    script.save(str(path))
    x = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(load_teacher(path, img_size=24)(x), model(x))


def test_an_exported_while_loop_is_refused(tmp_path):
    import warnings

    from torch._higher_order_ops.while_loop import while_loop

    class Endless(nn.Module):
        def forward(self, x):
            _, y = while_loop(lambda i, y: i >= 0, lambda i, y: (i + 1, y.clone()), (torch.tensor(0), x))
            return y.mean((2, 3))

    path = tmp_path / "loop.pt2"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.export.save(torch.export.export(Endless(), (torch.randn(2, 3, 24, 24),)), path)
    except Exception as e:  # a torch that cannot export while_loop cannot make such a file either
        pytest.skip(f"torch.export cannot export while_loop here: {type(e).__name__}")
    assert_refused(path, tmp_path / "marker", "'while_loop', which may never end")
    assert check_target("torch.ops.higher_order.while_loop") is not None


class Raises(nn.Module):
    """A TorchScript teacher that raises on the data it is given (it wants 7 channels)."""

    def forward(self, x):
        if x.shape[1] != 7:
            raise RuntimeError("wants 7 channels")
        return x.mean((2, 3))


# a tiny student with a distillation token on the embedded MNIST (1 x 28 x 28, 10 classes)
STUDENT = ["--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg",
           "embed_dim=32", "--dist-token", "--train-limit", "32", "--holdout", "100", "--batch-size", "16",
           "--epochs", "1", "--threads", "1", "--no-progress"]  # fmt: skip


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_teachers_that_do_not_fit_the_data_or_raise_are_one_line(tmp_path, capsys):
    """A program's input channels are checked against the data before the first batch (train: MNIST's 1 channel,
    relabel: RGB), as is a fixed input size against the one asked for; a teacher that raises is one line naming
    its file, in `vitlab train` and `vitlab relabel`."""
    rgb, gray, raises = tmp_path / "rgb.pt2", tmp_path / "gray.pt2", tmp_path / "raises.pt"
    torch.export.save(torch.export.export(SmallCnn().eval(), (torch.randn(2, 3, 24, 24),)), rgb)
    gray_cnn = nn.Sequential(nn.Conv2d(1, 4, 3)).eval()  # dense scores: what relabelling takes
    torch.export.save(torch.export.export(gray_cnn, (torch.randn(2, 1, 24, 24),)), gray)
    torch.jit.script(Raises()).save(str(raises))
    images = tmp_path / "images"
    synthesize(images, num_classes=2, train_per_class=2, val_per_class=1, size=(32, 32))
    capsys.readouterr()
    assert cli_main(["train", *STUDENT, "--teacher", str(rgb), "--out", str(tmp_path / "a")]) == 2
    assert "the teacher takes 3-channel images, the data has 1" in one_line(capsys)
    assert cli_main(["relabel", str(gray), str(images), "--threads", "1"]) == 2
    assert f"teacher {gray} takes 1-channel images, the data has 3" in one_line(capsys)
    assert cli_main(["relabel", str(gray), str(images), "--img-size", "32", "--threads", "1"]) == 2
    assert f"teacher {gray} was exported for 24x24 inputs only, not the 32x32 asked for" in one_line(capsys)
    assert cli_main(["train", *STUDENT, "--teacher", str(raises), "--out", str(tmp_path / "b")]) == 2
    err = one_line(capsys)
    assert f"teacher {raises} failed on a batch of shape (16, 1, 28, 28) (RuntimeError: wants 7 channels)" in err
    assert cli_main(["relabel", str(raises), str(images), "--img-size", "24", "--threads", "1"]) == 2
    assert f"teacher {raises} failed on a batch" in one_line(capsys)
    assert not list(images.rglob("*.tl.npy"))


# a `vitlab` command whose TorchScript teachers never answer (a stand-in for a loop inside C++: a sleep)
HUNG_TEACHER = """
import sys, time
import vitlab.distill.safety as safety
safety.ScriptTeacher.forward = lambda self, x: time.sleep(600)
from vitlab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_teacher_that_never_answers_ends_the_run_with_one_line(tmp_path):
    """The first call runs under --teacher-timeout: past it, a watchdog prints one line and ends the process
    (exit code 2), in `vitlab train` and `vitlab relabel`; the default bound is generous."""
    import subprocess
    import sys
    import time

    from vitlab.distill.teacher import DEFAULT_TIMEOUT_S
    from vitlab.engine.config import TrainConfig

    assert TrainConfig().teacher_timeout == DEFAULT_TIMEOUT_S >= 60
    teacher, images = tmp_path / "t.pt", tmp_path / "images"
    torch.jit.script(Raises()).save(str(teacher))
    synthesize(images, num_classes=2, train_per_class=1, val_per_class=1, size=(32, 32))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    for argv in (["train", *STUDENT, "--teacher", str(teacher), "--out", str(tmp_path / "run")],
                 ["relabel", str(teacher), str(images), "--img-size", "24", "--threads", "1"]):  # fmt: skip
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", HUNG_TEACHER, *argv, "--teacher-timeout", "1"],
                              capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert f"teacher {teacher} gave no answer to its first batch within 1 s" in done.stderr
        assert "--teacher-timeout" in done.stderr
        assert time.monotonic() - start < 120  # far below the teacher's 600 s
