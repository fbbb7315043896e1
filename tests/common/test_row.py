"""stretch.common.row against PyFlink 2.3.0's pyflink/common/types.py behaviour."""

import copy
import pickle

import pytest

from stretch.common import Row, RowKind
from stretch.common.row import RowFieldError


def test_positional_row():
    row = Row("a", 1)
    assert row[0] == "a"
    assert row[1] == 1
    assert row[-1] == 1
    assert row[0:2] == ["a", 1]
    assert len(row) == 2
    assert list(row) == ["a", 1]
    assert row._values == ["a", 1]
    assert not hasattr(row, "_fields")
    assert row.get_row_kind() is RowKind.INSERT


def test_named_row_keeps_keyword_order():
    row = Row(name="Alice", age=11)
    assert row._fields == ["name", "age"]
    assert row._values == ["Alice", 11]
    assert row.name == "Alice"
    assert row["age"] == 11
    assert row[0] == "Alice"
    assert list(row) == ["Alice", 11]


def test_repr_like_pyflink():
    assert repr(Row(name="a", age=1)) == "Row(name='a', age=1)"
    assert repr(Row("a", 1)) == "<Row('a', 1)>"
    assert str(Row("a", 1)) == "<Row('a', 1)>"
    assert repr(Row()) == "<Row()>"
    assert repr(Row(x=Row(y=None))) == "Row(x=Row(y=None))"


def test_args_and_kwargs_rejected():
    with pytest.raises(ValueError, match="both args and kwargs"):
        Row(1, a=2)


def test_as_dict():
    row = Row(key=1, value=Row(name="a", age=2))
    assert row.as_dict() == {"key": 1, "value": Row(name="a", age=2)}
    assert row.as_dict(True) == {"key": 1, "value": {"name": "a", "age": 2}}
    nested = Row(a=[Row(b=1)], d={"k": Row(c=2)})
    assert nested.as_dict(recursive=True) == {"a": [{"b": 1}], "d": {"k": {"c": 2}}}
    with pytest.raises(TypeError, match="Cannot convert a Row class into dict"):
        Row(1, 2).as_dict()


def test_row_kind():
    row = Row(a=1)
    row.set_row_kind(RowKind.DELETE)
    assert row.get_row_kind() is RowKind.DELETE
    assert Row.of_kind(RowKind.UPDATE_AFTER, 1, 2).get_row_kind() is RowKind.UPDATE_AFTER
    assert [str(k) for k in RowKind] == ["+I", "-U", "+U", "-D"]
    assert [k.value for k in RowKind] == [0, 1, 2, 3]
    assert row._is_retract_msg()
    assert Row(a=1)._is_accumulate_msg()


def test_equality():
    assert Row(a=1, b=2) == Row(a=1, b=2)
    assert Row(a=1, b=2) != Row(a=1, b=3)
    # Named rows compare by name, in any field order (PyFlink 2.3 sorts the names).
    assert Row(a=1, b=2) == Row(b=2, a=1)
    assert Row(a=1, b=2) != Row(a=1, c=2)
    assert Row("a", 1) == Row("a", 1)
    assert Row("a", 1) != Row(f0="a", f1=1)
    assert Row(f0="a", f1=1) != Row("a", 1)
    assert Row("a", 1) != ("a", 1)
    assert Row("a", 1) != ["a", 1]
    deleted = Row(a=1)
    deleted.set_row_kind(RowKind.DELETE)
    assert deleted != Row(a=1)


def test_hash():
    assert hash(Row("a", 1)) == hash(("a", 1))
    assert hash(Row(a=1, b=2)) == hash((1, 2))
    assert hash(Row(b=2, a=1)) == hash(Row(a=1, b=2))  # equal rows, equal hashes
    assert len({Row("a", 1), Row("a", 1), Row("b", 1)}) == 2


def test_contains():
    assert "name" in Row(name="a")
    assert "a" not in Row(name="a")
    assert "a" in Row("a", 1)
    assert 1 in Row("a", 1)


def test_row_as_class():
    person = Row("name", "age")
    assert "name" in person
    alice = person("Alice", 11)
    assert alice == Row(name="Alice", age=11)
    assert repr(alice) == "Row(name='Alice', age=11)"
    with pytest.raises(ValueError, match="expected 2 values"):
        person(1, 2, 3)


def test_missing_fields():
    row = Row(a=1)
    with pytest.raises(ValueError):
        row["b"]
    with pytest.raises(KeyError):
        row["b"]
    with pytest.raises(AttributeError):
        row.b
    with pytest.raises(AttributeError):
        Row(1)["a"]  # PyFlink: AttributeError on a positional Row
    with pytest.raises(RowFieldError):
        Row(1)["a"]
    with pytest.raises(IndexError):
        Row(1)[3]


def test_setting_values():
    row = Row(a=1, b=2)
    row[0] = 10
    row["b"] = 20
    assert row == Row(a=10, b=20)
    with pytest.raises(AttributeError):
        row.a = 5
    with pytest.raises(AttributeError):
        row.other = 5
    row.set_field_names(["x", "y"])
    assert row.x == 10
    assert row.as_dict() == {"x": 10, "y": 20}


def test_get_fields_by_names():
    row = Row(a=1, b=2)
    assert row.get_fields_by_names(["a", "b"]) == [1, 2]
    assert row.get_fields_by_names(["b", "a"]) == [2, 1]
    assert Row(1, 2).get_fields_by_names(["x", "y"]) == [1, 2]
    with pytest.raises(Exception, match="not exist"):
        row.get_fields_by_names(["a", "zz"])


@pytest.mark.parametrize(
    "row",
    [Row("a", 1), Row(name="x", nested=Row(1, [2, 3])), Row(), Row.of_kind(RowKind.DELETE, k=1)],
    ids=repr,
)
def test_pickle_and_copy(row):
    for protocol in (2, 5):
        back = pickle.loads(pickle.dumps(row, protocol=protocol))
        assert back == row
        assert repr(back) == repr(row)
        assert back.get_row_kind() is row.get_row_kind()
        assert hasattr(back, "_fields") == hasattr(row, "_fields")
    assert copy.deepcopy(row) == row
    assert copy.copy(row) == row
