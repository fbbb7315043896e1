"""NumberSequenceSource: the longs from start to end, both inclusive, as in PyFlink."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stretch.common.records import schema_for
from stretch.common.typeinfo import Types
from stretch.contracts.connectors import RecordPositionedSource

BATCH_ROWS = 65536


class NumberSequenceSource(RecordPositionedSource):
    type_info = Types.LONG()

    def __init__(self, start: int, end: int, batch_rows: int = BATCH_ROWS):
        if end < start:
            raise ValueError(f"end {end} is before start {start}")
        self.start = start
        self.end = end
        self.batch_rows = batch_rows

    def create_reader(self, context=None):
        schema = schema_for(Types.LONG())
        for lo in range(self.start + self.resume_at(context), self.end + 1, self.batch_rows):
            hi = min(lo + self.batch_rows, self.end + 1)
            yield pa.RecordBatch.from_arrays([pa.array(np.arange(lo, hi, dtype=np.int64))], schema=schema)
