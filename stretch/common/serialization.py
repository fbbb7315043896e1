"""Encoders: how a row-encoded FileSink writes each record (``pyflink.common.serialization``)."""

from __future__ import annotations


class Encoder:
    """Turns one record into the bytes of one line of a part file."""

    def __init__(self, charset: str = "UTF-8"):
        self.charset = charset

    @staticmethod
    def simple_string_encoder(charset_name: str = "UTF-8") -> Encoder:
        """Each record's ``str()`` in ``charset_name``, then a newline (Flink's SimpleStringEncoder)."""
        "".encode(charset_name)  # an unknown charset fails here, where the job is defined
        return Encoder(charset_name)

    def encode(self, record) -> bytes:
        return (record if isinstance(record, str) else str(record)).encode(self.charset) + b"\n"

    def __repr__(self) -> str:
        return f"Encoder.simple_string_encoder({self.charset!r})"
