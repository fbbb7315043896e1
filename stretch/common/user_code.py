"""Shipping user functions and values to workers: cloudpickle, keeping where code was written.

cloudpickle sends the functions of a script (and of anything it pickles by value) as code objects,
and since 3.1.3 renames their file ``<dynamic-code>`` to make the bytes deterministic. A user's
traceback from a worker would then say ``File "<dynamic-code>", line 26`` without the line itself.
Here code objects keep their file name, so tracebacks show the user's file and source line.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import types

import cloudpickle
from cloudpickle import cloudpickle as _impl

_DYNAMIC = "<dynamic-code>"


def _code_keeping_its_file(code: types.CodeType):
    make, args = _impl._code_reduce(code)
    return make, tuple(code.co_filename if a is _DYNAMIC or a == _DYNAMIC else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table.update(cloudpickle.Pickler.dispatch_table)
    if hasattr(_impl, "_code_reduce"):
        dispatch_table[types.CodeType] = _code_keeping_its_file


def dumps(obj) -> bytes:
    """``cloudpickle.dumps``, with user code keeping its file names (see the module's docstring)."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


SCRIPT_MARK = b"__main__"
"""A pickle that names ``__main__`` refers to a class or function of the user's script, which a
worker cannot import (its ``__main__`` is not the script): such values are pickled by value."""


def dumps_value(value) -> bytes:
    """A record or state value as bytes that ``pickle.loads`` reads in any process of the job:
    pickle, or cloudpickle (by value) for what pickle could only name and a worker cannot import,
    i.e. classes and functions of the user's script (``__main__``; a worker's is not the script)
    and local classes. Pickle first: it is fast and small, and most values are plain."""
    try:
        pickled = pickle.dumps(value, protocol=5)
        if SCRIPT_MARK not in pickled:
            return pickled
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    return dumps(value)
