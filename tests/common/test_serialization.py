"""Encoder.simple_string_encoder: str() of the record, in the charset, one line each."""

import pytest

from stretch.common import Encoder, Row


def test_simple_string_encoder_lines():
    enc = Encoder.simple_string_encoder()
    assert enc.encode("héllo") == "héllo\n".encode()
    assert enc.encode(3) == b"3\n"
    assert enc.encode(Row(1, "a")) == (str(Row(1, "a")) + "\n").encode()
    assert Encoder.simple_string_encoder("latin-1").encode("é") == b"\xe9\n"
    with pytest.raises(LookupError):
        Encoder.simple_string_encoder("no-such-charset")
