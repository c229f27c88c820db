import json
import subprocess
import sys


def vitlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vitlab.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_subcommands():
    out = vitlab("--help")
    assert out.returncode == 0
    for cmd in ("models", "bench-mixers"):
        assert cmd in out.stdout


def test_models_lists_params_and_macs():
    out = vitlab("models", "deit_tiny_patch16_224", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["name"] == "deit_tiny_patch16_224"
    assert abs(row["params_m"] - 5.72) < 0.01 and abs(row["gmacs"] - 1.25) < 0.025
    table = vitlab("models", "cpvt_*", "--no-macs")
    assert table.returncode == 0 and "cpvt_ti_gap" in table.stdout


def test_user_errors_are_one_line():
    out = vitlab("models", "no_such_model*")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "no model matches" in out.stderr
