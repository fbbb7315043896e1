"""User-defined metrics, with PyFlink's names (``pyflink.metrics``); see ``stretch.contracts.metrics``."""

from stretch.contracts.metrics import Counter, Distribution, Meter, MetricGroup

__all__ = ["Counter", "Distribution", "Meter", "MetricGroup"]
