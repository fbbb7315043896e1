"""Spark's Python workers must import the stretch that runs here (checked by the stage and by
``StretchCluster.on_spark``).

A script run with a virtualenv's python, but without activating it, starts Spark's workers with
``python3`` from PATH (PySpark takes ``PYSPARK_PYTHON``, else ``python3``). A stage's tasks then
fail inside Spark with ``No module named 'stretch'`` under a long Py4J trace. So the first time
stretch meets a SparkContext it runs one task that imports stretch, and says plainly what to set
if that fails.
"""

from __future__ import annotations

import os
import sys

_checked: set[str] = set()  # applicationId of every SparkContext whose workers import stretch


def check_workers(spark) -> None:
    """Raise one clear line if ``spark``'s Python workers cannot import stretch (once a context)."""
    try:
        sc = spark.sparkContext
        app = sc.applicationId
    except Exception:  # Spark Connect: no context here to run a task with; its own errors say it
        return
    if app in _checked:
        return
    try:
        sc.parallelize([0], 1).map(_import_stretch).collect()
    except Exception as e:
        if "No module named 'stretch'" not in str(e):
            return  # another failure: the query's own tasks will report it
        python = getattr(sc, "pythonExec", None) or os.environ.get("PYSPARK_PYTHON", "python3")
        raise RuntimeError(
            f"Spark's Python workers ({python}) cannot import stretch: set PYSPARK_PYTHON to "
            f"{sys.executable} (this Python, which has stretch) before the SparkSession starts, "
            "or install stretch for the workers' Python"
        ) from None
    _checked.add(app)


def _import_stretch(_):
    import stretch

    return stretch.__name__
