"""The Spark tests' session: the suite's one local Spark (``tests/conftest.py``)."""
