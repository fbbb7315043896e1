"""The package's layering holds: the import-linter contracts in pyproject.toml pass."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports")
    assert lint is not None, "import-linter is missing: pip install -e '.[test]'"
    result = subprocess.run(
        [lint, "--no-cache"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout
