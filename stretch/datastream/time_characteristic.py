"""PyFlink: ``pyflink.datastream.time_characteristic``; defined in ``stretch.contracts.execution``."""

from stretch.contracts.execution import TimeCharacteristic

__all__ = ["TimeCharacteristic"]
