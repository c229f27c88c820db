import subprocess
import sys


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "vitlab.cli", "--help"], capture_output=True, text=True, check=True)
    assert "bench-mixers" in out.stdout
