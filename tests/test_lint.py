"""The tree passes ruff, configured in pyproject.toml ([tool.ruff]): pyflakes,
pycodestyle's errors and the import order, at 120 columns."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check . (in {ROOT}):\n{r.stdout}{r.stderr}"
