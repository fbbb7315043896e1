"""PyFlink: ``pyflink.datastream.execution_mode``; defined in ``stretch.contracts.execution``."""

from stretch.contracts.execution import RuntimeExecutionMode

__all__ = ["RuntimeExecutionMode"]
