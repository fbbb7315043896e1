"""Side-output tags (PyFlink: ``pyflink.datastream.OutputTag``).

The definitions live in ``stretch.contracts.output_tag``, below the engine that calls them."""

from stretch.contracts.output_tag import (
    OutputTag,
)

__all__ = [
    "OutputTag",
]
