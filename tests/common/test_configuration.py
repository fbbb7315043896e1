"""Configuration's typed views over string values, as PyFlink's."""

from stretch.common import Configuration


def test_typed_round_trips_and_copies():
    c = Configuration().set_integer("a", 3).set_boolean("b", True).set_float("c", 0.5)
    c.set_string("d", "x").set_bytearray("e", b"\x00\xff")
    assert (c.get_integer("a", 0), c.get_boolean("b", False), c.get_float("c", 0.0)) == (3, True, 0.5)
    assert c.get_string("d", "") == "x" and c.get_bytearray("e", None) == bytearray(b"\x00\xff")
    assert c.get_integer("missing", 7) == 7 and c.contains_key("a") and not c.contains_key("z")
    copy = Configuration(c)
    assert copy == c and copy.remove_config("a") and copy != c and c.get_string("a", "") == "3"
    assert c.to_dict()["b"] == "true" and "e" in c.key_set()
