"""Every flag is checked while the command line is parsed (vitlab.common.options): a bad value is one line naming the
flag, the value and what is allowed, exit code 2, before any work. Also: the corrected messages, out of memory
as one line in every command, non-finite weights and one-class data said, refused pickles never run."""

from __future__ import annotations

import argparse
import math
import os
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.checkpoint import save_checkpoint
from vitlab.checkpoint.safeload import NonFiniteWeightsWarning
from vitlab.cli import COMMANDS, build_parser
from vitlab.cli import main as cli_main
from vitlab.common import options as opt

REPO = Path(__file__).resolve().parents[1]
# a tiny DeiT on the embedded MNIST: 4x4 grid of 7-px patches, 1 block of width 32
KWARGS = dict(img_size=28, in_chans=1, num_classes=10, patch_size=7, depth=1, embed_dim=32)
TINY_RUN = [
    "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32",
    "--train-limit", "64", "--holdout", "100", "--batch-size", "32", "--threads", "1", "--no-progress", "--epochs", "1",
]  # fmt: skip


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and err.count("\n") == 0 and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- the types


def test_integer_ranges_name_the_range_and_the_value():
    assert opt.positive_int("7") == 7 and opt.non_negative_int("0") == 0 and opt.threads("1024") == 1024
    for check, text, words in [
        (opt.positive_int, "0", "must be an integer >= 1, got '0'"),
        (opt.positive_int, "-5", "got '-5'"),
        (opt.positive_int, "1.5", "an integer >= 1"),
        (opt.positive_int, "nan", "an integer >= 1"),
        (opt.non_negative_int, "-1", "an integer >= 0"),
        (opt.threads, "-3", "an integer in 0..1024 (0: torch's default), got '-3'"),
        (opt.image_size, "100000", "an integer in 1..8192"),
        (opt.seed, "-1", "an integer in 0..4294967295"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(words)):
            check(text)
    with pytest.raises(ValueError, match="--epochs must be an integer >= 1, got True"):
        opt.positive_int.check(True, "--epochs")  # a bool is not a count


@pytest.mark.parametrize(
    ("check", "good", "bad", "what"),
    [
        (opt.probability, ["0", "1", "0.5"], ["-0.1", "1.5", "nan", "inf"], "a number in [0, 1]"),
        (opt.rate, ["0", "0.999"], ["1", "-0.1", "nan"], "a number in [0, 1)"),
        (opt.positive_float, ["1e-8", "3"], ["0", "-1", "inf", "nan", "abc"], "a number > 0"),
        (opt.non_negative_float, ["0", "2.5"], ["-1", "-inf", "nan", "x"], "a number >= 0"),
    ],
)
def test_number_ranges_are_finite_and_closed_or_open_as_said(check, good, bad, what):
    for text in good:
        assert check(text) == float(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError) as e:
            check(text)
        assert str(e.value) == f"must be {what}, got {text!r}"
    assert math.isclose(check.check(float(good[-1]), "--x"), float(good[-1]))


def test_device_choice_and_key_value():
    for spec in ("auto", "cpu", "cuda", "cuda:0", "cuda:7", "mps"):
        assert opt.device(spec) == spec
    for spec in ("banana", "cuda:", "cuda:x", "cuda:-1", "gpu", "CPU"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be auto, cpu, mps, cuda or cuda:N"):
            opt.device(spec)
    assert opt.Choice(1, 3)("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be one of 1, 3, got '2'"):
        opt.Choice(1, 3)("2")
    assert opt.key_value("depth=6") == ("depth", 6)
    assert opt.key_value("soft_split=((7, 4, 2),)") == ("soft_split", ((7, 4, 2),))
    assert opt.key_value("mixer=aft_full") == ("mixer", "aft_full")  # a bare word stays a string
    for text in ("depth", "=3", "1x=2", "depth="):
        with pytest.raises(argparse.ArgumentTypeError, match="must be KEY=VALUE"):
            opt.key_value(text)


def test_keyword_values_are_checked_against_the_signature():
    def build(depth: int = 12, ratio: float = 4.0, flag: bool = True, size: int | tuple[int, int] = 224, spec=None):
        pass

    assert set(opt.accepted_kinds("int | tuple[int, int]")) == {int, tuple, list}
    assert opt.accepted_kinds("MixerSpec | Sequence[MixerSpec]") is None  # unknown names: anything goes
    opt.check_keyword_values(build, {"depth": 2, "ratio": 2, "flag": False, "size": (7, 7), "spec": "x"}, "--m")
    for values, words in [
        ({"depth": 0}, "--m depth=0: depth must be positive (default 12)"),
        ({"depth": "abc"}, "--m depth='abc': depth takes int, not str"),
        ({"depth": True}, "depth takes int, not bool"),
        ({"ratio": -1.0}, "ratio must be positive"),
        ({"ratio": float("nan")}, "ratio must be positive"),
        ({"flag": 1}, "flag takes bool, not int"),
        ({"size": 2.5}, "size takes int | tuple"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            opt.check_keyword_values(build, values, "--m")


def test_every_numeric_flag_of_every_command_has_a_validated_type():
    """No plain ``type=int`` / ``type=float`` in any command's options: each names its range (vitlab.common.options)."""

    def parsers(parser: argparse.ArgumentParser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    plain = []
    for command in COMMANDS:
        for parser in parsers(build_parser(command)):
            plain += [f"{parser.prog} {'/'.join(a.option_strings)}" for a in parser._actions if a.type in (int, float)]
    assert not plain, "flags without a range (use a vitlab.common.options type): " + ", ".join(plain)


# --------------------------------------------------------------------------- each bad flag of the issue


@pytest.fixture
def no_training(monkeypatch):
    """Parse-time errors run no work: the training loop must never be reached."""
    from vitlab.engine import loop as engine
    from vitlab.tasks.lm import train as lm_train

    def refuse(*args, **kwargs):
        raise AssertionError("work started for an invalid option")

    monkeypatch.setattr(engine, "train", refuse)
    monkeypatch.setattr(lm_train, "train", refuse)


BAD_FLAGS = [  # (argv after the command, the words the one line must hold)
    (["train", "--train-limit", "-5"], "argument --train-limit: must be an integer >= 1, got '-5'"),
    (["train", "--train-limit", "0"], "argument --train-limit: must be an integer >= 1, got '0'"),
    (["train", "--mixup", "-1"], "argument --mixup: must be a number >= 0, got '-1'"),
    (["train", "--hflip", "5"], "argument --hflip: must be a number in [0, 1], got '5'"),
    (["train", "--threads", "-3"], "argument --threads: must be an integer in 0..1024"),
    (["train", "--img-size", "0"], "argument --img-size: must be an integer in 1..8192, got '0'"),
    (["train", "--holdout", "-5"], "argument --holdout: must be an integer >= 1, got '-5'"),
    (["train", "--lr", "nan"], "argument --lr: must be a number > 0, got 'nan'"),
    (["train", "--drop-path", "1"], "argument --drop-path: must be a number in [0, 1), got '1'"),
    (["train", "--model-arg", "depth=0"], "--model-arg depth=0: depth must be positive (default 12)"),
    (["train", "--model-arg", "depth=abc"], "--model-arg depth='abc': depth takes int, not str"),
    (["train", "--model-arg", "embed_dim=-1"], "--model-arg embed_dim=-1: embed_dim must be positive"),
    (["train", "--model-arg", "num_heads=5"], "--model-arg num_heads=5: deit_mini cannot be built with these"),
    (["train", "--model-arg", "num_classes=5"], "--model-arg num_classes: vitlab train sets num_classes from"),
    (["train", "--model-arg", "depth"], "argument --model-arg: must be KEY=VALUE"),
    (["train", "--data", "folder:/nonexistent"], "argument --data: image folder /nonexistent does not exist"),
    (["train", "--data", f"cifar10:{__file__}"], "argument --data: CIFAR-10 path"),
    (["train", "--device", "banana"], "argument --device: must be auto, cpu, mps, cuda or cuda:N, got 'banana'"),
    (["train", "--resume", "--force"], "argument --force: not allowed with argument --resume"),
    (["train", "--model", "deit_mni"], "argument --model: unknown model 'deit_mni'; did you mean"),
    (["eval", "x.pt", "--device", "banana"], "argument --device: must be auto, cpu, mps, cuda or cuda:N"),
    (["eval", "x.pt", "--img-size", "28", "0"], "argument --img-size: must be an integer in 1..8192, got '0'"),
    (["models", "--img-size", "-8"], "argument --img-size: must be an integer in 1..8192, got '-8'"),
    (["compare", "--train-limit", "-5"], "argument --train-limit: must be an integer >= 1, got '-5'"),
    (["compare", "--resume", "--force"], "argument --force: not allowed with argument --resume"),
    (["analyze", "deit_mini", "--device", "banana"], "argument --device: must be auto, cpu, mps, cuda or cuda:N"),
    (["analyze", "deit_mini", "--threshold", "2"], "argument --threshold: must be a number in [0, 1], got '2'"),
    (["bench", "deit_mini", "--batch", "1,0"], "argument --batch: must be an integer >= 1, got '0'"),
    (["bench-mixers", "--tokens", "-16"], "argument --tokens: must be an integer >= 1, got '-16'"),
    (["convert", "x.pt", "--model", "deit_mini", "--num-classes", "0"], "argument --num-classes: must be an integer"),
    (["export", "deit_mini", "--out", "m.onnx", "--batch", "0"], "argument --batch: must be an integer >= 1"),
    (["lm", "train", "--data", "x.txt", "--seq-len", "0"], "argument --seq-len: must be an integer >= 1, got '0'"),
    (["lm", "train", "--data", "x.txt", "--resume", "--force"], "argument --force: not allowed with argument"),
    (["lm", "sample", "x.pt", "--temperature", "-1"], "argument --temperature: must be a number >= 0, got '-1'"),
    (["lm", "sample", "x.pt", "--top-k", "-3"], "argument --top-k: must be an integer >= 1, got '-3'"),
    (["lm", "bench", "--threads", "-1"], "argument --threads: must be an integer in 0..1024"),
]


@pytest.mark.parametrize(("argv", "words"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_with_exit_code_2_before_any_work(argv, words, tmp_path, capsys, no_training):
    out = tmp_path / "run"
    extra = ["--out", str(out)] if argv[0] in ("train", "compare") or argv[:2] == ["lm", "train"] else []
    assert cli_main([*argv, *extra]) == 2
    err = one_line(capsys)
    assert words in err, err
    assert err.startswith(f"vitlab {argv[0]}")
    assert not out.exists()  # nothing created, no lock taken


# --------------------------------------------------------------------------- messages that misled


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A vision checkpoint with NaN/inf weights, an LM checkpoint and a pickle that would run code."""
    d = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    state = vitlab.create_model("deit_mini", **KWARGS).state_dict()
    state["head.weight"][0, 0] = float("nan")
    state["norm.weight"][1] = float("inf")
    save_checkpoint(
        {"model_name": "deit_mini", "model_kwargs": KWARGS, "model": state, "config": {"data": "mnist"}}, d / "nan.pt"
    )
    text = d / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    lm = ["--model", "tiny_aft_simple", "--data", str(text), "--seq-len", "16", "--steps", "1", "--batch-size", "2"]
    assert cli_main(["lm", "train", *lm, "--eval-every", "1", "--eval-symbols", "16", "--out", str(d / "lm")]) == 0

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {d / 'PWNED'}",))

    (d / "evil.pt").write_bytes(pickle.dumps({"model": Evil()}, protocol=2))
    return d


LOADERS = {  # how each command takes a weights file (the file's path replaces FILE)
    "eval": ["eval", "FILE"],
    "analyze": ["analyze", "deit_mini", "--checkpoint", "FILE", "--what", "attention", "--num-images", "1"],
    "export": ["export", "deit_mini", "--format", "torchscript", "--weights", "FILE"],
    "convert": ["convert", "FILE", "--model", "deit_mini"],
    "init-from": ["train", *TINY_RUN, "--init-from", "FILE"],
    "teacher": ["train", *TINY_RUN, "--dist-token", "--teacher", "FILE"],
}


def loader_argv(name: str, path: Path, out: Path) -> list[str]:
    argv = [str(path) if a == "FILE" else a for a in LOADERS[name]]
    target = {"export": out / "m.pt", "convert": out / "w.safetensors"}.get(name, out)
    return argv if name == "eval" else [*argv, "--out", str(target)]


@pytest.mark.parametrize("name", list(LOADERS))
def test_non_finite_weights_warn_naming_the_tensors_in_every_loader(name, checkpoints, tmp_path, capsys):
    with pytest.warns(
        NonFiniteWeightsWarning,
        match=r"nan\.pt holds non-finite values \(NaN or inf\) in model/norm\.weight, model/head\.weight",
    ):
        cli_main(loader_argv(name, checkpoints / "nan.pt", tmp_path / "out"))  # it may then fail: NaN loss


@pytest.mark.parametrize("name", list(LOADERS))
def test_a_pickle_that_would_run_code_is_refused_in_one_line_by_every_loader(name, checkpoints, tmp_path, capsys):
    assert cli_main(loader_argv(name, checkpoints / "evil.pt", tmp_path / "out")) == 2
    err = one_line(capsys)
    assert "asks to run code and vitlab will not load it" in err and "weights_only" not in err, err
    assert not (checkpoints / "PWNED").exists()


@pytest.mark.parametrize(
    "argv", [["eval", "LM"], ["analyze", "deit_mini", "--checkpoint", "LM"], ["train", "--resume", "LM"]]
)
def test_an_lm_checkpoint_given_to_an_image_command_points_to_vitlab_lm(argv, checkpoints, tmp_path, capsys):
    argv = [str(checkpoints / "lm" / "last.pt") if a == "LM" else a for a in argv]
    assert cli_main([*argv, *([] if argv[0] == "eval" else ["--out", str(tmp_path / "o")])]) == 2
    err = one_line(capsys)
    assert "was written by `vitlab lm train`" in err and "use `vitlab lm eval` or `vitlab lm sample`" in err, err
    assert "did you mean" not in err


def test_an_image_checkpoint_given_to_lm_points_to_vitlab_eval(checkpoints, capsys):
    with pytest.warns(NonFiniteWeightsWarning):
        assert cli_main(["lm", "eval", str(checkpoints / "nan.pt")]) == 2
    assert "is not a `vitlab lm train` checkpoint (it holds the image model 'deit_mini'); use `vitlab eval`" in (
        one_line(capsys)
    )


def test_lm_sample_options_of_the_other_kind_of_model_are_refused(checkpoints, capsys):
    ckpt = str(checkpoints / "lm" / "last.pt")
    assert cli_main(["lm", "sample", ckpt, "--prompt-rows", "2"]) == 2
    assert "--prompt-rows completes images, but this is a text model" in one_line(capsys)


def test_one_class_of_training_data_is_said():
    from vitlab.data import ImageDataset
    from vitlab.engine.setup import warn_one_class

    def data(labels):
        return ImageDataset(
            torch.zeros(len(labels), 1, 4, 4, dtype=torch.uint8), torch.tensor(labels), 3, (0.5,), (0.5,)
        )

    with pytest.warns(UserWarning, match=r"all 2 training images are of one class \(label 2\)"):
        warn_one_class(data([2, 2]))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_one_class(data([0, 2]))


# --------------------------------------------------------------------------- out of memory, in every command


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes."),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        MemoryError(),
    ],
    ids=["cpu", "cuda", "python"],
)
def test_out_of_memory_is_one_line_in_any_command(error, monkeypatch, capsys):
    tool = types.ModuleType("_oom_tool")
    tool.add_arguments = lambda p: None

    def run(args):
        raise error

    tool.run = run
    monkeypatch.setitem(sys.modules, "_oom_tool", tool)
    monkeypatch.setitem(COMMANDS, "oom-probe", ("_oom_tool", "a command that runs out of memory"))
    assert cli_main(["oom-probe"]) == 2
    err = one_line(capsys)
    assert err.startswith("vitlab oom-probe: error: out of memory") and "use a smaller batch" in err, err
    monkeypatch.setattr(tool, "run", lambda args: (_ for _ in ()).throw(RuntimeError("a bug, not memory")))
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        cli_main(["oom-probe"])


def test_out_of_memory_in_analyze_is_one_line(tmp_path, monkeypatch, capsys):
    from vitlab.cli import analyze as analysis_cli

    def oom(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes.")

    monkeypatch.setattr(analysis_cli, "analyze", oom)
    argv = ["analyze", "deit_mini", "--img-size", "28", "--in-chans", "1", "--num-images", "1"]
    assert cli_main([*argv, "--out", str(tmp_path / "a")]) == 2
    assert "vitlab analyze: error: out of memory (DefaultCPUAllocator: can't allocate memory" in one_line(capsys)


# --------------------------------------------------------------------------- writes that fail


def test_a_torchscript_export_that_hits_the_file_size_limit_is_one_line(tmp_path):
    """torch's own file writer aborts the whole process when a write fails; vitlab writes the bytes itself."""
    out = tmp_path / "m.pt"
    code = (
        "import resource, signal, sys, torch\nfrom vitlab.interop.export import to_torchscript\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nresource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
        "try:\n    to_torchscript(torch.nn.Linear(64, 64), torch.randn(1, 64), sys.argv[1])\n"
        "except ValueError as e:\n    sys.exit(str(e))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the WriteError's line, not an abort (-6)
    err = proc.stderr.strip()
    assert err == f"could not write {out}: the file-size limit was reached (EFBIG); nothing was written", err
    assert not list(tmp_path.iterdir())
