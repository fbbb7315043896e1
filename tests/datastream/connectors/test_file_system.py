"""FileSource (text lines) and FileSink (row-encoded), against plain-Python reads of the same files;
the sink exactly once across a kill -9 recovery."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from stretch.common import Encoder, Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.file_system import (
    BucketAssigner,
    FileSink,
    FileSource,
    OutputFileConfig,
    RollingPolicy,
    StreamFormat,
)

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def write_corpus(root: Path, files: int = 6, lines: int = 300, seed: int = 1) -> list[str]:
    """Files in a directory tree with mixed line breaks, plus hidden files FileSource must skip."""
    rng = random.Random(seed)
    every = []
    for i in range(files):
        sub = root / f"d{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        rows = [" ".join(rng.choices(WORDS, k=rng.randrange(1, 6))) for _ in range(lines)]
        breaks = ["\n", "\r\n", "\r"]
        text = "".join(r + breaks[j % 3] for j, r in enumerate(rows[:-1])) + rows[-1]  # no final break
        (sub / f"part{i}.txt").write_bytes(text.encode())
        every += rows
    (root / ".hidden").write_text("never\n")
    (root / "d0" / "_SUCCESS").write_text("never\n")
    return every


def source(*paths) -> FileSource:
    return FileSource.for_record_stream_format(StreamFormat.text_line_format(), *map(str, paths)).build()


def finished_lines(base: Path) -> list[str]:
    return [
        line
        for f in sorted(base.rglob("*"))
        if f.is_file() and not f.name.startswith(".")
        for line in f.read_text().splitlines()
    ]


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_word_count_over_a_directory(tmp_path, parallelism):
    lines = write_corpus(tmp_path / "in")
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    ds = env.from_source(source(tmp_path / "in"), WatermarkStrategy.no_watermarks(), "files")
    assert ds.get_type() == Types.STRING()
    counts = (
        ds.flat_map(lambda line: [(w, 1) for w in line.split()], Types.TUPLE([Types.STRING(), Types.INT()]))
        .key_by(lambda p: p[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1]))
    )
    final = {}
    for w, n in counts.execute_and_collect():
        final[w] = max(final.get(w, 0), n)
    assert final == dict(Counter(w for line in lines for w in line.split()))


def test_source_checks_paths_and_charset(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        source(tmp_path / "missing")
    with pytest.raises(LookupError):
        StreamFormat.text_line_format("no-such-charset")
    (tmp_path / "latin.txt").write_bytes("café\nnaïve".encode("latin-1"))
    src = FileSource.for_record_stream_format(
        StreamFormat.text_line_format("latin-1"), str(tmp_path / "latin.txt")
    ).build()
    env = StreamExecutionEnvironment.get_execution_environment()
    assert list(env.from_source(src, None, "f").execute_and_collect()) == ["café", "naïve"]


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_sink_writes_every_record_once_into_named_part_files(tmp_path, parallelism):
    lines = write_corpus(tmp_path / "in", files=3)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    sink = (
        FileSink.for_row_format(str(tmp_path / "out"), Encoder.simple_string_encoder())
        .with_output_file_config(
            OutputFileConfig.builder().with_part_prefix("pre").with_part_suffix(".txt").build()
        )
        .with_rolling_policy(RollingPolicy.default_rolling_policy(part_size=2000))
        .build()
    )
    env.from_source(source(tmp_path / "in"), None, "files").key_by(lambda s: s).map(
        lambda s: s.upper(), Types.STRING()
    ).sink_to(sink)
    env.execute()
    files = [f for f in (tmp_path / "out").rglob("*") if f.is_file()]
    assert files and all(f.name.startswith("pre-") and f.name.endswith(".txt") for f in files)
    assert len({f.parent for f in files}) == 1  # one bucket: this hour, yyyy-MM-dd--HH
    assert len(files[0].parent.name) == len("2026-01-01--00")
    assert len(files) > 1  # rolled at 2000 bytes
    longest = max(len(s) for s in lines) + 1
    assert all(f.stat().st_size <= 2000 + longest for f in files)  # rolled once above 2000 bytes
    assert sorted(finished_lines(tmp_path / "out")) == sorted(s.upper() for s in lines)


def test_base_path_bucket_assigner_writes_into_the_base_path(tmp_path):
    env = StreamExecutionEnvironment.get_execution_environment()
    sink = (
        FileSink.for_row_format(str(tmp_path / "out"), Encoder.simple_string_encoder())
        .with_bucket_assigner(BucketAssigner.base_path_bucket_assigner())
        .build()
    )
    env.from_collection(["a", "b"], Types.STRING()).sink_to(sink)
    env.execute()
    (f,) = [p for p in (tmp_path / "out").iterdir()]
    assert f.name.startswith("part-") and f.read_text() == "a\nb\n"


def test_sink_is_exactly_once_across_a_kill_9_recovery(tmp_path):
    lines = write_corpus(tmp_path / "in", files=10, lines=4000, seed=9)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    sink = FileSink.for_row_format(str(tmp_path / "out"), Encoder.simple_string_encoder()).build()

    def slow_upper(s):  # keeps the job running long enough to be killed in the middle
        time.sleep(0.00005)
        return s.upper()

    env.from_source(source(tmp_path / "in"), None, "files").key_by(lambda s: s[:3]).map(
        slow_upper, Types.STRING()
    ).sink_to(sink)
    client = env.execute_async(f"files-{random.randrange(1 << 40):x}")
    co = client._coordinator
    try:
        time.sleep(0.4)
        busy = [w for w in co.workers.all() if w.task is not None and w.pid]
        os.kill(random.choice(busy).pid, signal.SIGKILL)
        assert client.wait(120).name == "FINISHED"
    finally:
        if not co.done:
            client.cancel()
            client.wait(30)
    assert len(co.recoveries) == 1
    assert sorted(finished_lines(tmp_path / "out")) == sorted(s.upper() for s in lines)
