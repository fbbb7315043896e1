"""Words for error messages about what a user passed: "an AggregateFunction", "a MapFunction", and
"the class AMap" where an instance was wanted."""

from __future__ import annotations


def a(noun: str) -> str:
    """``noun`` with its indefinite article: "a MapFunction", "an AggregateFunction"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def described(value) -> str:
    """What ``value`` is, for "..., got {described(value)}": "an AMap" for an instance of AMap,
    "the class AMap" for the class itself (a user who meant ``AMap()``)."""
    if isinstance(value, type):
        return f"the class {value.__name__}"
    return a(type(value).__name__)


def not_a_class(value, base: type = object) -> str | None:
    """If ``value`` is a class (a subclass of ``base``: a function class, where a plain class such
    as ``str`` is a callable like any other), what to say: pass an instance of it; else None."""
    if not (isinstance(value, type) and issubclass(value, base)):
        return None
    return f"got the class {value.__name__}; pass an instance, {value.__name__}()"
