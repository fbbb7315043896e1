"""User functions shipped by value keep the file their code was written in (for tracebacks)."""

from __future__ import annotations

import pickle
import traceback

from stretch.common import user_code

SCRIPT = """
def rule(x):
    if x == 7:
        raise ValueError("seven")
    return x + 1


class Rules:
    def apply(self, x):
        return rule(x) * 2
"""


def test_a_scripts_functions_keep_their_file_and_lines(tmp_path):
    path = tmp_path / "my_job.py"
    path.write_text(SCRIPT)
    namespace = {"__name__": "__main__"}  # a script's own functions travel by value
    exec(compile(SCRIPT, str(path), "exec"), namespace)
    shipped = pickle.loads(user_code.dumps(namespace["Rules"]()))
    assert shipped.apply(1) == 4
    assert type(shipped).apply.__code__.co_filename == str(path)
    try:
        shipped.apply(7)
    except ValueError as e:
        text = "".join(traceback.format_exception(e))
    assert f'File "{path}", line 4, in rule' in text
    assert 'raise ValueError("seven")' in text
