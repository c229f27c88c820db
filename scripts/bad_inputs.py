"""Throw bad inputs at the vitlab command line and count how each is answered.

    PYTHONPATH=src python scripts/bad_inputs.py [--jobs 2] [--only train,eval] [--show accepted,traceback]

A hostile-but-fair user's session, repeatable: every numeric, device, size and spec flag of every command
with out-of-range and malformed values; wrong paths; damaged, foreign and malicious weights files through
every command that loads one; write failures (file-size limit); SIGKILLs during training, then resume;
two runs into one folder. Each case runs ``vitlab.cli.main(argv)`` in a forked child (the parent imports
everything once and never computes, so forks are safe and cheap) with its output captured. Outcomes:

- error: exit code != 0 and one line on stderr, no traceback
- warned: exit 0 with a ``vitlab: warning:`` line explaining what is wrong (NaN weights, one class)
- accepted: exit 0 and nothing said: a bad input silently accepted
- several lines: a failure explained in more than one line (argparse's usage block, say)
- traceback: a Python traceback, or the process killed by a signal (an abort)
- timeout: still running after ``--timeout`` seconds (a bad value that started real work)

A protected run folder is hashed before and after; any change, and any SIGKILL after which resume does not
end with every epoch in the log, counts as data lost. Exit status 1 when anything but error/warned occurred.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import importlib
import json
import multiprocessing
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("vitlab.cli", "vitlab.engine.arguments", "vitlab.engine.evaluate", "vitlab.experiments.runner", "vitlab.cli.models",
         "vitlab.bench.models", "vitlab.bench.mixers", "vitlab.cli.analyze", "vitlab.cli.convert", "vitlab.interop.export",
         "vitlab.cli.lm", "vitlab.cli.data", "vitlab.bench.data")  # fmt: skip
TINY = [
    "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32",
    "--train-limit", "64", "--holdout", "100", "--batch-size", "32", "--threads", "1", "--no-progress",
]  # fmt: skip
LM = ["--model", "tiny_aft_simple", "--seq-len", "16", "--steps", "2", "--batch-size", "2", "--eval-every", "2"]
LM += ["--eval-symbols", "32", "--threads", "1"]
# malformed or out-of-range values per kind of option
BAD = {
    "pos_int": ["0", "-5", "abc", "1.5", "nan", ""],
    "nonneg_int": ["-1", "abc", "2.5"],
    "pos_float": ["0", "-1", "nan", "inf", "abc"],
    "nonneg_float": ["-1", "nan", "inf", "x"],
    "prob": ["-0.1", "1.5", "nan"],
    "rate": ["1", "1.5", "-0.1", "nan"],
    "device": ["banana", "cuda:x", "gpu", "cuda:-1"],
    "img": ["0", "-8", "100000", "abc"],
    "threads": ["-3", "100000", "x"],
    "seed": ["-1", "x", "99999999999999999999"],
    "csv_pos": ["0", "-1", "a", "1,,0", ","],
    "csv_img": ["0", "-8,32", "x"],
    "csv_nonneg": ["-1", "0,-2", "a", ","],
}


@dataclass
class Case:
    group: str
    argv: list[str]
    expect: str = "error"  # or "warned": an explanation on exit 0 is the right answer
    setup: Callable[[], None] | None = None  # runs in the child before the command (limits, patches)
    outcome: str = ""
    detail: str = ""


@dataclass
class Fixtures:
    root: Path
    files: dict[str, Path] = field(default_factory=dict)

    def out(self) -> str:
        return tempfile.mkdtemp(prefix="out-", dir=self.root / "outs")

    def __getitem__(self, key: str) -> str:
        return str(self.files[key])


# --------------------------------------------------------------------------- fixtures (built in subprocesses)


def vitlab_subprocess(*argv: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "vitlab", *argv], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"fixture `vitlab {' '.join(argv)}` failed:\n{proc.stderr}")


def build_fixtures(root: Path) -> Fixtures:
    import numpy as np
    from PIL import Image

    from vitlab.checkpoint import load_checkpoint, save_checkpoint
    from vitlab.interop import save_weights

    fx = Fixtures(root)
    (root / "outs").mkdir()
    text = root / "text.txt"
    text.write_bytes(bytes(range(256)) * 8)
    vitlab_subprocess("train", *TINY, "--epochs", "1", "--out", str(root / "good"))
    vitlab_subprocess("lm", "train", *LM, "--data", str(text), "--out", str(root / "lm"))
    shutil.copytree(root / "good", root / "protected")
    ckpt = load_checkpoint(root / "good" / "last.pt")
    ckpt.pop("path")
    ckpt["model"]["head.weight"][0, 0] = float("nan")
    save_checkpoint(ckpt, root / "nan.pt")
    save_weights(ckpt["model"], root / "weights.safetensors")
    rng = np.random.default_rng(0)
    for name, classes in (("one", ["cat"]), ("two", ["cat", "dog"])):
        for c in classes:
            (root / name / c).mkdir(parents=True)
            for i in range(12):
                Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / name / c / f"{i}.png")
    (root / "cifar").mkdir()
    for batch in ("data_batch_1", "test_batch"):
        (root / "cifar" / batch).write_bytes(rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    (root / "empty.txt").write_bytes(b"")
    (root / "short.txt").write_bytes(b"0123456789")
    (root / "junk.pt").write_bytes(b"\x80\x02junk" + bytes(range(256)))
    (root / "text.pt").write_text("this is not a checkpoint\n")
    (root / "a_file").write_text("x")
    (root / "nolast").mkdir()
    marker = root / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (root / "evil.pt").write_bytes(pickle.dumps({"model": Evil()}, protocol=2))
    fx.files.update(
        good=root / "good" / "last.pt", run=root / "good", lm=root / "lm" / "last.pt", nan=root / "nan.pt",
        text=text, protected=root / "protected", one=root / "one", two=root / "two", cifar=root / "cifar",
        empty=root / "empty.txt", short=root / "short.txt", junk=root / "junk.pt", textpt=root / "text.pt",
        a_file=root / "a_file", nolast=root / "nolast", evil=root / "evil.pt", marker=marker,
        safetensors=root / "weights.safetensors",
    )  # fmt: skip
    fx.files.update(mutants(root, root / "good" / "last.pt"))
    return fx


def mutants(root: Path, good: Path, n_flip: int = 10, n_cut: int = 6) -> dict[str, Path]:
    """Damaged copies of a real checkpoint: other first bytes, flipped bytes anywhere, truncations."""
    data = good.read_bytes()
    rng = random.Random(0)
    out = {}
    for i, first in enumerate((0x00, 0x80, 0x7B, 0xFF, ord("Q"))):
        out[f"first{i}"] = bytes([first]) + data[1:]
    for i in range(n_flip):
        b = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out[f"flip{i}"] = bytes(b)
    for i in range(n_cut):
        out[f"cut{i}"] = data[: rng.randrange(len(data))]
    paths = {}
    for name, content in out.items():
        path = root / "mutants" / f"{name}.pt"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content)
        paths[f"mutant:{name}"] = path
    return paths


# --------------------------------------------------------------------------- the cases


def flag_cases(group: str, base: list[str], flags: dict[str, str], fx: Fixtures, out_flag: str | None) -> list[Case]:
    cases = []
    for flag, kind in flags.items():
        for value in BAD[kind]:
            argv = [*base, f"--{flag}", value]
            if out_flag:
                argv += [out_flag, fx.out()]
            cases.append(Case(group, argv))
    return cases


def file_inputs(fx: Fixtures, mutants: bool = True) -> list[tuple[str, str]]:
    """(name, path) of files that are not what a loader wants."""
    names = ["missing", "nolast", "a_file", "empty", "junk", "textpt", "evil", "lm"]
    paths = {"missing": str(fx.root / "missing.pt"), **{k: v for k, v in fx.files.items() if k in names}}
    found = [(n, str(paths[n])) for n in names]
    if mutants:
        found += [(k, str(v)) for k, v in fx.files.items() if k.startswith("mutant:")]
    return found


def train_cases(fx: Fixtures) -> list[Case]:
    flags = {
        "epochs": "pos_int", "batch-size": "pos_int", "lr": "pos_float", "min-lr": "nonneg_float",
        "warmup-epochs": "nonneg_float", "weight-decay": "nonneg_float", "clip-grad": "nonneg_float",
        "drop-path": "rate", "smoothing": "rate", "mixup": "nonneg_float", "cutmix": "nonneg_float", "ema": "rate",
        "seed": "seed", "threads": "threads", "device": "device", "img-size": "img", "holdout": "pos_int",
        "train-limit": "pos_int", "crop-padding": "nonneg_int", "hflip": "prob", "eval-batch-size": "pos_int",
    }  # fmt: skip
    base = ["train", *TINY, "--epochs", "1"]
    cases = flag_cases("train flags", base, flags, fx, "--out")
    odd = [
        ["--amp", "fp32"], ["--model", "nope"], ["--data", "folder:/nonexistent"], ["--data", f"cifar10:{fx['a_file']}"],
        ["--data", "banana:x"], ["--data", "cifar10:"], ["--data", "mnist-idx:/nonexistent"],
        ["--data", f"folder:{fx['one']}", "--img-size", "14"], ["--data", f"folder:{fx['two']}"],
        ["--data", f"cifar10:{fx['cifar']}"], ["--auto-augment", "banana"], ["--auto-augment", "rand-m99"],
        ["--auto-augment", "rand-x1"], ["--resume", "--force"], ["--resume"], ["--batch-size", "1000"],
        ["--teacher", fx["good"]], ["--amp", "fp16"], ["--device", "cuda"], ["--device", "mps"],
    ]  # fmt: skip
    cases += [Case("train options", [*base, *o, "--out", fx.out()]) for o in odd]
    one_class = ["--train-limit", "1", "--batch-size", "1"]  # trains, with a warning that it sees one class
    cases.append(Case("train options", [*base, *one_class, "--out", fx.out()], "warned"))
    for arg in ["depth=0", "depth=abc", "embed_dim=-1", "num_heads=3", "patch_size=0", "mlp_ratio=-1", "foo=1",
                "=3", "depth", "img_size=32", "num_classes=5", "depth=99999", "mixer=nope", "qkv_bias=3",
                "peg_at=(7,)", "patch_size=5", "embed_dim=2.5", "depth=True", "stem_channels=4"]:  # fmt: skip
        cases.append(Case("train --model-arg", ["train", *TINY, "--model-arg", arg, "--out", fx.out()]))
    for what in ("--init-from", "--teacher", "--resume"):
        extra = ["--dist-token"] if what == "--teacher" else []
        for _, path in file_inputs(fx, mutants=what != "--resume"):
            cases.append(Case(f"train {what} <bad file>", [*base, *extra, what, path, "--out", fx.out()]))
    for flag in ("--init-from", "--teacher"):
        extra = ["--dist-token"] if flag == "--teacher" else []
        cases.append(Case("train nan weights", [*base, *extra, flag, fx["nan"], "--out", fx.out()], "warned"))
    for out in (fx["a_file"], f"{fx['a_file']}/sub", fx["protected"]):
        cases.append(Case("train --out", [*base, "--out", out]))
    return cases


def eval_cases(fx: Fixtures) -> list[Case]:
    base = ["eval", fx["good"]]
    flags = {"img-size": "img", "batch-size": "pos_int", "threads": "threads", "device": "device"}
    cases = flag_cases("eval flags", base, flags, fx, None)
    for o in (["--amp", "x"], ["--data", "folder:/nonexistent"], ["--data", f"cifar10:{fx['cifar']}"],
              ["--model", "nope"], ["--model", "tnt_mini"], ["--json", str(fx.root)], ["--json", f"{fx['a_file']}/x"],
              ["--ema"], ["--data", "cifar10:/nonexistent"], ["--device", "cuda"]):  # fmt: skip
        cases.append(Case("eval options", [*base, *o]))
    cases += [Case("eval <bad file>", ["eval", path]) for _, path in file_inputs(fx)]
    cases.append(Case("eval nan weights", ["eval", fx["nan"]], "warned"))
    return cases


def compare_cases(fx: Fixtures) -> list[Case]:
    base = ["compare", "--models", "deit_mini", "--epochs", "1", "--train-limit", "64", "--no-plots"]
    flags = {"epochs": "pos_int", "batch-size": "pos_int", "lr": "pos_float", "ema": "rate", "seed": "seed",
             "train-limit": "pos_int", "jobs": "pos_int"}  # fmt: skip
    cases = flag_cases("compare flags", base, flags, fx, "--out")
    for o in (["--threads", "0"], ["--threads", "-1"], ["--models", ""], ["--models", "nope"], ["--models", ","],
              ["--data", "folder:/nonexistent"], ["--resume", "--force"], ["--isolation", "x"]):  # fmt: skip
        cases.append(Case("compare options", [*base, *o, "--out", fx.out()]))
    cases.append(Case("compare --out", [*base, "--out", fx["a_file"]]))
    return cases


def tool_cases(fx: Fixtures) -> list[Case]:
    """models, bench, bench-mixers, analyze, convert, export."""
    cases = flag_cases("models flags", ["models", "deit_mini"], {"img-size": "img"}, fx, None)
    cases.append(Case("models options", ["models", "nope*"]))
    bench = {"batch": "csv_pos", "img-size": "csv_img", "repeats": "pos_int", "warmup": "nonneg_int",
             "max-time": "pos_float", "gemm-rounds": "pos_int", "timeout": "pos_float"}  # fmt: skip
    cases += flag_cases("bench flags", ["bench", "deit_mini", "--no-memory"], bench, fx, "--out")
    cases += [Case("bench options", ["bench", *o, "--out", fx.out()]) for o in
              (["nope"], [], ["deit_mini", "--threads", "0"], ["deit_mini", "--dtypes", "fp64"],
               ["deit_mini", "--modes", "x"])]  # fmt: skip
    mixers = {"heads": "pos_int", "window": "pos_int", "kernel": "pos_int", "tokens": "csv_pos", "dim": "pos_int",
              "batch": "pos_int", "repeats": "pos_int", "warmup": "nonneg_int", "max-time": "pos_float",
              "mem-budget": "pos_float", "timeout": "pos_float"}  # fmt: skip
    cases += flag_cases("bench-mixers flags", ["bench-mixers", "--quick"], mixers, fx, "--out")
    cases += [Case("bench-mixers options", ["bench-mixers", *o, "--out", fx.out()]) for o in
              (["--mixers", "nope"], ["--threads", "0"], ["--heads", "3", "--dim", "64"])]  # fmt: skip
    cases += analyze_cases(fx) + convert_export_cases(fx) + data_cases(fx)
    return cases


def data_cases(fx: Fixtures) -> list[Case]:
    """vitlab data synth / shards / info and vitlab bench-data."""
    synth = {"classes": "pos_int", "train-per-class": "pos_int", "val-per-class": "nonneg_int", "quality": "pos_int",
             "seed": "seed"}  # fmt: skip
    cases = [Case("data flags", ["data", "synth", fx.out(), *c.argv]) for c in flag_cases("", [], synth, fx, None)]
    cases += [Case("data options", ["data", *o]) for o in
              (["synth", fx.out(), "--classes", "1"], ["synth", fx.out(), "--quality", "101"],
               ["synth", fx.out(), "--size", "0", "10"], ["synth", fx["a_file"]], ["shards", "/nonexistent", fx.out()],
               ["shards", fx["two"], fx.out(), "--shard-size", "0"], ["info", "banana:x"], ["info", "folder:/nonexistent"],
               ["info", "wds:/nonexistent"], ["info", f"folder:{fx['one']}", "--split", "x"], ["bogus"])]  # fmt: skip
    bench = {"images": "pos_int", "img-size": "img", "workers": "csv_nonneg", "batch-size": "pos_int",
             "batches": "pos_int", "rounds": "pos_int", "step-batch": "pos_int"}  # fmt: skip
    cases += flag_cases("bench-data flags", ["bench-data", "--no-step", "--no-memory"], bench, fx, "--out")
    cases += [Case("bench-data options", ["bench-data", *o, "--out", fx.out()]) for o in
              (["--data", "folder:/nonexistent"], ["--data", "banana"], ["--decoder", "x"])]  # fmt: skip
    return cases


def analyze_cases(fx: Fixtures) -> list[Case]:
    base = ["analyze", "deit_mini", "--img-size", "28", "--in-chans", "1", "--num-classes", "10", "--num-images", "1"]
    flags = {"num-images": "pos_int", "threshold": "prob", "max-heads": "pos_int", "img-size": "img",
             "in-chans": "pos_int", "num-classes": "pos_int", "batch-size": "pos_int", "device": "device",
             "seed": "seed"}  # fmt: skip
    cases = flag_cases("analyze flags", base, flags, fx, "--out")
    for o in (["--what", "nope"], ["--what", ""], ["--slots", "-1"], ["--slots", "a"], ["--query", "x"],
              ["--query", "-1"], ["--query", "999"], ["--data", "folder:/nonexistent"], ["--images", "/nonexistent.png"],
              ["--images", fx["text"]], ["--out", fx["a_file"]], ["--ema"], ["--device", "cuda"]):  # fmt: skip
        cases.append(Case("analyze options", [*base, *o, "--out", fx.out()] if "--out" not in o else [*base, *o]))
    for _, path in file_inputs(fx):
        cases.append(Case("analyze --checkpoint <bad file>", [*base, "--checkpoint", path, "--out", fx.out()]))
    cases.append(Case("analyze nan weights", [*base, "--checkpoint", fx["nan"], "--out", fx.out()], "warned"))
    return cases


def convert_export_cases(fx: Fixtures) -> list[Case]:
    conv = ["convert", fx["good"], "--model", "deit_mini"]
    cases = flag_cases("convert flags", conv, {"num-classes": "pos_int", "img-size": "img"}, fx, None)
    cases += [Case("convert options", [*conv[:2], *o]) for o in
              (["--model", "nope"], ["--model", "deit_mini", "--source", "x"], ["--model", "deit_mini", "--out", str(fx.root)])]  # fmt: skip
    for _, path in file_inputs(fx):
        cases.append(Case("convert <bad file>", ["convert", path, "--model", "deit_mini", "--out", fx.out() + "/w.st"]))
    exp = ["export", "deit_mini", "--format", "torchscript"]
    flags = {"num-classes": "pos_int", "img-size": "img", "batch": "pos_int"}
    cases += [Case(c.group.replace("flags", "export flags"), [*c.argv, "--out", fx.out() + "/m.pt"])
              for c in flag_cases("flags", exp, flags, fx, None)]  # fmt: skip
    cases += [Case("export options", [*exp, *o]) for o in
              (["--out", str(fx.root)], ["--format", "x", "--out", "m.pt"], ["--out", f"{fx['a_file']}/m.pt"])]  # fmt: skip
    for _, path in file_inputs(fx):
        cases.append(Case("export --weights <bad file>", [*exp, "--weights", path, "--out", fx.out() + "/m.pt"]))
    cases.append(Case("export nan weights", [*exp, "--weights", fx["nan"], "--out", fx.out() + "/m.pt"], "warned"))
    return cases


def lm_cases(fx: Fixtures) -> list[Case]:
    base = ["lm", "train", *LM, "--data", fx["text"]]
    flags = {"seq-len": "pos_int", "batch-size": "pos_int", "steps": "pos_int", "lr": "pos_float",
             "min-lr": "nonneg_float", "warmup-steps": "nonneg_int", "weight-decay": "nonneg_float",
             "clip-grad": "nonneg_float", "eval-every": "pos_int", "eval-symbols": "nonneg_int",
             "eval-batch-size": "pos_int", "log-every": "pos_int", "holdout": "pos_float", "img-size": "img",
             "seed": "seed", "threads": "threads", "dim": "pos_int", "depth": "pos_int", "heads": "pos_int",
             "dropout": "rate", "window": "pos_int", "bias-dim": "pos_int", "max-len": "pos_int"}  # fmt: skip
    cases = flag_cases("lm train flags", base, flags, fx, "--out")
    for o in (["--channels", "0"], ["--channels", "2"], ["--data", fx["empty"]], ["--data", fx["short"]],
              ["--data", str(fx.root / "missing.txt")], ["--data", str(fx.root / "nolast")],
              ["--data", f"cifar10:{fx['cifar']}"], ["--model", "nope"], ["--resume", "--force"], ["--resume"],
              ["--lr", "1e6", "--steps", "40"], ["--max-len", "4"]):  # fmt: skip
        cases.append(Case("lm train options", [*base, *o, "--out", fx.out()]))
    cases.append(Case("lm train --out", [*base, "--out", fx["run"]]))
    ev = ["lm", "eval", fx["lm"]]
    cases += flag_cases("lm eval flags", ev, {"eval-symbols": "nonneg_int", "batch-size": "pos_int"}, fx, None)
    cases += [Case("lm eval <bad file>", ["lm", "eval", p]) for n, p in file_inputs(fx, False) if n != "lm"]
    cases.append(Case("lm eval <vision checkpoint>", ["lm", "eval", fx["good"]]))
    sample = ["lm", "sample", fx["lm"], "--length", "4", "--num", "1"]
    flags = {"num": "pos_int", "length": "pos_int", "prompt-rows": "nonneg_int", "temperature": "nonneg_float",
             "top-k": "pos_int", "seed": "seed", "threads": "threads"}  # fmt: skip
    cases += flag_cases("lm sample flags", sample, flags, fx, None)
    cases += [Case("lm sample options", [*sample, *o]) for o in (["--length", "1000"], ["--prompt-rows", "2"],
                                                                  ["--out", str(fx.root)])]  # fmt: skip
    bench = {"tokens": "pos_int", "layers": "pos_int", "dim": "pos_int", "batch": "pos_int", "warmup": "nonneg_int",
             "repeats": "pos_int", "rounds": "pos_int", "threads": "threads", "timeout": "pos_float"}  # fmt: skip
    cases += flag_cases("lm bench flags", ["lm", "bench", "--quick"], bench, fx, "--out")
    cases.append(Case("lm bench options", ["lm", "bench", "--models", "nope", "--out", fx.out()]))
    return cases


def write_failure_cases(fx: Fixtures) -> list[Case]:
    """A file-size limit reached while writing: one line, the previous file intact."""

    def limit(nbytes: int) -> Callable[[], None]:
        def setup() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

        return setup

    return [
        Case("write failure", ["train", *TINY, "--epochs", "1", "--out", fx.out()], setup=limit(20_000)),
        Case("write failure", ["eval", fx["good"], "--json", fx.out() + "/r.json"], setup=limit(10)),
        Case(
            "write failure",
            [
                "convert",
                fx["good"],
                "--model",
                "deit_mini",
                "--img-size",
                "28",
                "--out",
                fx.out() + "/w.safetensors",
                "--no-strict",
            ],
            setup=limit(1000),
        ),
        Case(
            "write failure",
            ["export", "deit_mini", "--format", "torchscript", "--out", fx.out() + "/m.pt"],
            setup=limit(1000),
        ),
        Case("write failure", ["lm", "train", *LM, "--data", fx["text"], "--out", fx.out()], setup=limit(5_000)),
    ]


# --------------------------------------------------------------------------- running


def child(argv: list[str], setup: Callable[[], None] | None, err_fd: int) -> None:
    """Run the command with stdout discarded and stderr into a pipe (no file-size limit applies to either)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(err_fd, 2)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    code = 99
    try:
        from vitlab.cli import main

        if setup is not None:
            setup()
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def judge(case: Case, code: int | None, stderr: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    warned = [line for line in lines if line.startswith("vitlab: warning:")]
    if code is None:
        case.outcome = "timeout"
    elif "Traceback" in stderr or code == 99 or code < 0:  # a traceback, or killed by a signal (abort)
        case.outcome = "traceback"
    elif code != 0:
        errors = [line for line in lines if line not in warned]
        case.outcome = "error" if len(errors) == 1 else "several lines"  # a usage block, say: not one clear line
    else:
        case.outcome = "warned" if warned and case.expect == "warned" else "accepted"
    case.detail = (lines[-1] if lines else "")[:300] if case.outcome == "error" else stderr[-1500:]


def start(case: Case) -> tuple[multiprocessing.Process, Callable[[], str]]:
    """The case's child process and a function returning everything it wrote to stderr (once it ended)."""
    read_fd, write_fd = os.pipe()
    proc = multiprocessing.get_context("fork").Process(target=child, args=(case.argv, case.setup, write_fd))
    for attempt in range(10):  # a case that started thousands of threads may leave none to fork for a moment
        try:
            proc.start()
            break
        except BlockingIOError:
            time.sleep(3 * (attempt + 1))
    os.close(write_fd)
    chunks: list[bytes] = []

    def drain() -> None:
        with open(read_fd, "rb") as f:
            chunks.append(f.read())

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def stderr() -> str:
        reader.join(10)
        return b"".join(chunks).decode(errors="replace")

    return proc, stderr


def run_case(case: Case, timeout: float) -> Case:
    proc, stderr = start(case)
    proc.join(timeout)
    code = proc.exitcode
    if proc.is_alive():
        proc.kill()
        proc.join()
        code = None
    judge(case, code, stderr())
    return case


def tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".vitlab.lock")
    }


def logged_epochs(out: str) -> list:
    try:
        return [r["epoch"] for r in json.loads((Path(out) / "log.json").read_text())]
    except (OSError, ValueError) as e:
        return [f"no readable log: {type(e).__name__}"]


def kill_and_resume(fx: Fixtures, timeout: float, kills: int, seed: int = 0) -> list[str]:
    """Kill `vitlab train` at random moments, resume until done; the log must hold every epoch once."""
    rng = random.Random(seed)
    lost = []
    for k in range(kills):
        out = fx.out()
        argv = ["train", *TINY, "--epochs", "4", "--out", out]
        proc, _ = start(Case("kill", argv))
        time.sleep(rng.uniform(0.3, 4.0))
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        epochs = logged_epochs(out)
        while epochs != [1, 2, 3, 4]:  # resume (or start again when killed before the first checkpoint)
            resumed = run_case(Case("kill", [*argv, "--resume"] if (Path(out) / "last.pt").exists() else argv), timeout)
            epochs = logged_epochs(out)
            if resumed.outcome != "accepted":
                lost.append(f"kill {k}: resume {resumed.outcome} ({resumed.detail}); log epochs {epochs}")
                break
    return lost


def two_writers(fx: Fixtures, timeout: float) -> list[str]:
    """Two `vitlab train` into one folder at once: exactly one may run, the other is refused in one line."""
    out = fx.out()
    argv = ["train", *TINY, "--epochs", "2", "--out", out]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda c: run_case(c, timeout), [Case("two", argv), Case("two", list(argv))])
    outcomes = sorted([a.outcome, b.outcome])
    if outcomes != ["accepted", "error"]:
        return [f"two writers: {outcomes} ({a.detail} | {b.detail})"]
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per case (default 90)")
    p.add_argument("--only", default="", help="comma-separated substrings of case groups to run")
    p.add_argument("--show", default="accepted,several lines,traceback,timeout", help="outcomes to list one by one")
    p.add_argument("--kills", type=int, default=4, help="SIGKILLs during training (default 4)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = p.parse_args()
    os.environ.setdefault("VITLAB_ALLOCATOR", "default")
    root = Path(tempfile.mkdtemp(prefix="vitlab-bad-inputs-"))
    t0 = time.time()
    print(f"fixtures in {root} ...", flush=True)
    fx = build_fixtures(root)
    for module in TOOLS:  # imported before the forks: every child starts with them loaded
        importlib.import_module(module)

    cases = [*train_cases(fx), *eval_cases(fx), *compare_cases(fx), *tool_cases(fx), *lm_cases(fx)]
    cases += write_failure_cases(fx)
    if args.only:
        cases = [c for c in cases if any(s in c.group for s in args.only.split(","))]
    before = tree_hashes(fx.files["protected"])
    print(f"{len(cases)} cases, {args.jobs} at a time", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for i, _ in enumerate(pool.map(lambda c: run_case(c, args.timeout), cases), 1):
            if i % 50 == 0:
                print(f"  {i}/{len(cases)} ({time.time() - t0:.0f} s)", flush=True)
    lost = [] if args.only else kill_and_resume(fx, args.timeout, args.kills) + two_writers(fx, args.timeout)
    if tree_hashes(fx.files["protected"]) != before:
        lost.append("the protected run folder changed")
    if fx.files["marker"].exists():
        lost.append("a malicious pickle ran code")
    report(cases, lost, args, time.time() - t0, extra=0 if args.only else args.kills + 2)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    bad = [c for c in cases if c.outcome not in ("error", "warned")]
    return 1 if bad or lost else 0


def report(cases: list[Case], lost: list[str], args: argparse.Namespace, seconds: float, extra: int) -> None:
    show = set(args.show.split(","))
    for c in cases:
        if c.outcome in show:
            print(f"\n[{c.outcome}] {c.group}: vitlab {' '.join(c.argv)}\n    {c.detail}")
    by_group: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for c in cases:
        by_group[c.group.split(" ")[0] if not c.group.startswith("lm") else " ".join(c.group.split()[:2])][
            c.outcome
        ] += 1
    print("\nper command:")
    for group, counts in sorted(by_group.items()):
        print(f"  {group:14s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    total = collections.Counter(c.outcome for c in cases)
    print(
        f"\nbad inputs tried: {len(cases) + extra}; clear one-line errors: {total['error']}; explained (warning): "
        f"{total['warned']}; silently accepted: {total['accepted']}; several lines: {total['several lines']}; "
        f"tracebacks: {total['traceback']}; timeouts: {total['timeout']}; data lost: {len(lost)} ({seconds:.0f} s)"
    )
    for line in lost:
        print(f"  data lost: {line}")


if __name__ == "__main__":
    sys.exit(main())
