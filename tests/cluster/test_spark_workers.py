"""Spark's Python workers must import stretch: a stage or ``on_spark`` whose workers run a Python
without it fails at once with one line saying what to set, not inside a task."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    from pyspark.sql import SparkSession
    from stretch.cluster.spark_workers import check_workers

    spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
    try:
        check_workers(spark)
        check_workers(spark)  # checked once a context: the second call runs no job
        print("ACCEPTED", len(spark.sparkContext.statusTracker().getJobIdsForGroup()))
    except RuntimeError as e:
        print("REFUSED", e)
    finally:
        spark.stop()
    """
)


def _python_without_stretch(tmp_path) -> str:
    """A virtualenv's python that sees this one's packages (pyspark, numpy...) but not stretch,
    which is installed editable (a .pth hook that a directory named by another .pth does not run)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    packages = subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(packages, "host.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    probe = "import pyspark, numpy\ntry:\n    import stretch\nexcept ModuleNotFoundError:\n    print('no stretch')"
    seen = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=_env(), check=True
    ).stdout
    assert seen.strip() == "no stretch", "the test's Python without stretch still imports it"
    return python


def _env() -> dict:
    """This environment without a PYTHONPATH (which Spark's workers would inherit)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_DRIVER_PYTHON")}


def _run(tmp_path, worker_python: str) -> str:
    env = _env()
    env["PYSPARK_PYTHON"] = worker_python
    # the driver finds stretch as installed; the working directory is not the checkout
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_workers_without_stretch_are_refused_in_one_line_naming_what_to_set(tmp_path):
    printed = _run(tmp_path, _python_without_stretch(tmp_path))
    refused = [line for line in printed.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1, printed
    assert "PYSPARK_PYTHON" in refused[0] and sys.executable in refused[0], refused[0]
    assert "venv/bin/python" in refused[0], refused[0]


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_workers_with_stretch_pass_the_check(tmp_path):
    printed = _run(tmp_path, sys.executable)
    assert printed.split()[:2] == ["ACCEPTED", "1"], printed  # one job for the two calls
