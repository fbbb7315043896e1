"""The documentation builds cleanly and every Python example in it runs.

Each ```python block of README.md and docs/**/*.md is one test, named by file and line, run in a
fresh namespace, in a temporary directory of its own, so every block is a whole program: it makes
its own small data and stops the jobs and queries it starts. Python code is never fenced ```py;
a block that cannot run here is fenced ```text with the reason beside it.

Spark: a block that uses a name ``spark`` (``spark.read...``, or a line
``spark = SparkSession.builder...getOrCreate()``, which returns it) gets the one local Spark
session that all the docs' blocks share (tests/spark/session.py's settings, quiet logs), made
when the first such block runs and stopped with its JVM after the last; a block that starts a
streaming query stops it (``availableNow`` triggers end by themselves). Spark resolves relative
paths in the directory its JVM started in, not the block's, so Spark blocks give it absolute ones.
"""

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
USES_SPARK = re.compile(r"(?<![\w.])spark\b")


def _blocks():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in files:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(m.group(1), id=f"{path.relative_to(ROOT)}:{line}")


def test_site_builds_strict(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        check=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )


def test_no_python_left_unrun():
    """Python code is fenced ```python (run here), never ```py."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unrun = [f"{p.relative_to(ROOT)}" for p in files if re.search(r"^```py\s*$", p.read_text(), re.M)]
    assert unrun == []


def test_the_docs_stand_on_their_own():
    """The published pages point to pages of their own, never to the project's design brief (a
    file a reader of the docs does not have)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [
        f"{p.relative_to(ROOT)}: {line.strip()}"
        for p in files
        for line in p.read_text().splitlines()
        if re.search(r"DESIGN\.md|project brief|\bthe brief\b", line)
    ]
    assert found == []


def test_every_command_has_a_section_on_the_cli_page():
    """docs/guides/cli.md has a section for each subcommand that `stretch --help` lists."""
    from stretch.cli import main

    def commands(*path):
        with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
            main([*path, "--help"])
        choices = re.search(r"^usage: .*?\{([\w,-]+)\}", out.getvalue(), re.M | re.S)
        return choices.group(1).split(",") if choices else []

    page = (ROOT / "docs/guides/cli.md").read_text()
    documented = set(re.findall(r"^#{2,3} stretch (cluster [\w-]+|[\w-]+)", page, re.M))
    wanted = set(commands()) | {f"cluster {c}" for c in commands("cluster")}
    assert len(wanted) > 10 and wanted <= documented, wanted - documented


@pytest.mark.parametrize("code", list(_blocks()))
def test_code_block_runs(code, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    if not USES_SPARK.search(code):
        exec(compile(code, "<docs>", "exec"), namespace)
        return
    spark = namespace["spark"] = request.getfixturevalue("spark")
    settings = spark.conf.getAll
    try:
        exec(compile(code, "<docs>", "exec"), namespace)
    finally:  # the suite's other Spark tests share the session: what an example set is undone
        for key, value in spark.conf.getAll.items():
            if key not in settings:
                spark.conf.unset(key)
            elif value != settings[key]:
                spark.conf.set(key, settings[key])
