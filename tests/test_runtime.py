"""The allocator policy of the vitlab command (vitlab.common.runtime): freed activations are reused, not page-faulted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    from vitlab.common import runtime
    policy = sys.argv[1]
    ok = runtime.keep_freed_memory() if policy == "keep" else runtime.return_freed_memory()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(4 << 20)  # 16 MiB, touched and freed once before counting
    x.fill_(1.0)
    del x
    per = []
    for _ in range(9):
        before = faults()
        y = torch.empty(4 << 20)
        y.fill_(1.0)
        del y
        per.append(faults() - before)
    print(ok, runtime.allocator_policy(), sorted(per)[4])  # the median allocation
    """
)


def _faults_per_allocation(policy: str) -> tuple[str, str, float]:
    out = subprocess.run([sys.executable, "-c", FAULTS, policy], capture_output=True, text=True, check=True)
    ok, name, per = out.stdout.split()
    return ok, name, float(per)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator")
def test_keep_policy_reuses_freed_blocks_without_page_faults():
    ok, name, kept = _faults_per_allocation("keep")
    assert ok == "True" and name == "keep"
    ok, name, returned = _faults_per_allocation("return")
    assert ok == "True" and name == "return"
    pages = (16 << 20) / 4096
    assert returned > 0.5 * pages  # a typical 16 MiB block comes back as fresh pages
    assert kept < 0.05 * pages  # a typical block reuses freed memory


def test_env_setting_is_checked(monkeypatch):
    from vitlab.common import runtime

    monkeypatch.setenv("VITLAB_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match="VITLAB_ALLOCATOR must be 'keep' or 'default'"):
        runtime.configure_from_env()
    monkeypatch.setenv("VITLAB_ALLOCATOR", "default")
    assert runtime.configure_from_env() == runtime.allocator_policy()


def _vitlab(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_wrong_fast_path_switch_is_one_warning_line_not_a_crash():
    """VITLAB_FAST_PATHS is read while vitlab is imported: a value that is no switch warns once, in one line
    naming the accepted values, and the default (on) holds; the library and the command both still work."""
    done = _vitlab("import vitlab.ops as o; print(o.fast_paths_enabled())", {"VITLAB_FAST_PATHS": "junk"})
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "VITLAB_FAST_PATHS='junk' is not a switch" in done.stderr and "0, false, off, no" in done.stderr
    code = "import sys; from vitlab.cli import main; import vitlab.ops; sys.exit(main(['data', 'info', 'mnist']))"
    done = _vitlab(code, {"VITLAB_FAST_PATHS": "2"})
    assert done.returncode == 0 and '"images": ' in done.stdout, done.stderr
    assert done.stderr.count("\n") == 1 and "VITLAB_FAST_PATHS='2'" in done.stderr, done.stderr


def test_a_wrong_collective_timeout_is_one_line_without_torchrun_too(tmp_path, monkeypatch, capsys):
    """VITLAB_DIST_TIMEOUT was read only under torchrun: a single-process run now says it is wrong as well."""
    import torch

    from vitlab.cli import main
    from vitlab.common.distributed import init_distributed

    for env in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(env, raising=False)
    for value in ("junk", "-3", "inf", "nan"):
        monkeypatch.setenv("VITLAB_DIST_TIMEOUT", value)
        with pytest.raises(ValueError, match=f"VITLAB_DIST_TIMEOUT must be a number of seconds > 0, got '{value}'"):
            init_distributed(torch.device("cpu"))
    monkeypatch.setenv("VITLAB_DIST_TIMEOUT", "junk")
    capsys.readouterr()
    argv = ["train", "--model", "deit_mini", "--train-limit", "16", "--epochs", "1", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "VITLAB_DIST_TIMEOUT must be a number of seconds > 0, got 'junk'" in err, err
    assert not (tmp_path / "r").exists()
    monkeypatch.setenv("VITLAB_DIST_TIMEOUT", "30")
    assert init_distributed(torch.device("cpu")).size == 1
