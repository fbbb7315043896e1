"""PyFlink: ``pyflink.datastream.slot_sharing_group``; defined in ``stretch.contracts.execution``."""

from stretch.contracts.execution import SlotSharingGroup

__all__ = ["SlotSharingGroup"]
