"""The documentation builds cleanly and every Python example in it runs.

Each ```python block of README.md and docs/**/*.md is one test, named by file and line, run in a
fresh namespace, in a temporary directory. Fragments that continue an earlier example (they use
its `env`, `spark` or files) are fenced as ```py and not run. A block preceded by the line
`<!-- not-run: REASON -->` is collected but skipped with that reason.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not-run: (.*?) -->\s*$")


def _blocks():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in files:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = NOT_RUN.search(before)
            marks = [pytest.mark.skip(reason=skip.group(1))] if skip else []
            name = f"{path.relative_to(ROOT)}:{line}"
            yield pytest.param(m.group(1), id=name, marks=marks)


def test_site_builds_strict(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        check=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize("code", list(_blocks()))
def test_code_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})
