"""The allocator policy of the vitlab command (vitlab.common.runtime): freed activations are reused, not page-faulted."""

from __future__ import annotations

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
