"""How a ChannelSource task reads its input, in the job's worker.

Outside writers append to the channel's gate. A checkpointed job reads the channel's durable log
instead (the job copies the gate into it), from the position a checkpoint recorded, so that a
recovery reads again exactly what came after it, less the stage transactions whose end the dead
run never logged (runtime.transactions).
"""

from __future__ import annotations

from typing import NamedTuple

import pyarrow as pa

from stretch.plan.stages import walk_steps
from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.event_time import JUDGE_KEY, MARK_KEY
from stretch.runtime.frontier import CLAIM_PIECE_NS
from stretch.runtime.gate import JOINED_ROWS, SMALL_ROWS, Kind
from stretch.runtime.transactions import ROUND_KEY, TXN_KEY, txn_of


def read_channel(context, name: str):
    """The batches of input channel ``name``; None while nothing arrives (time passes)."""
    if context.res.checkpoints is not None:
        return read_log(context, name)
    return read_gate(context, name)


class LogBatches(NamedTuple):
    """Consecutive small batches of a channel's log read as one: the source's position counts
    log batches, so its task moves it on by ``count``."""

    batch: pa.RecordBatch
    count: int


def read_log(context, name: str):
    """A checkpointed job reads the channel's log (which the job keeps from the channel's gate)
    from its position on, so a recovery can go back to a checkpoint's offset. Small batches
    logged behind each other are read as one, as from the gate (``read_gate``)."""
    directory, tail_name = context.res.channel_logs[name]
    log, tail = ChannelLog(directory, create=False), LogTail.attach(tail_name)
    offset = context.position
    aborted = context.res.aborted_txns
    into = _one_gate(context)
    try:
        while True:
            end = tail.end
            if offset < end:
                for item in _joined(log.read(offset, end), lambda: join_most(into)):
                    if isinstance(item, LogBatches):
                        offset += item.count
                        yield item
                        continue
                    offset += 1
                    if aborted and txn_of(item)[0] in aborted:  # a dead run's unfinished transaction
                        yield item.slice(0, 0).replace_schema_metadata(None)  # keeps the count
                    else:
                        yield item
            elif tail.state != LogTail.RUNNING:
                return
            elif not tail.wait(offset, timeout=0.1):
                if context.should_stop():
                    return
                yield None  # nothing yet: lets watermark generators notice idleness
    finally:
        log.close()
        tail.close()


def _joined(batches, join_most):
    """``batches``, with runs of small ``_plain`` ones of one schema joined, as ``LogBatches``: each
    up to ``join_most()`` rows, asked as the run starts (the rate it follows changes as it goes)."""
    run: list[pa.RecordBatch] = []
    rows = most = 0
    for batch in batches:
        plain = 0 < batch.num_rows < SMALL_ROWS and _plain(batch)
        if run and (not plain or rows >= most or not batch.schema.equals(run[0].schema)):
            yield run[0] if len(run) == 1 else LogBatches(pa.concat_batches(run), len(run))
            run, rows = [], 0
        if plain and not run:
            most = join_most()
        if plain and most:
            run.append(batch)
            rows += batch.num_rows
        else:
            yield batch
    if run:
        yield run[0] if len(run) == 1 else LogBatches(pa.concat_batches(run), len(run))


def _plain(batch: pa.RecordBatch) -> bool:
    """Records alone: no transaction, watermark, round or lateness judge of their own."""
    meta = batch.schema.metadata
    return not meta or not any(key in meta for key in (TXN_KEY, MARK_KEY, ROUND_KEY, JUDGE_KEY))


def read_gate(context, name: str):
    gate = context.channel_gate(name)
    into = _one_gate(context)
    seq = gate.cursor(0)
    while True:
        if not gate.wait(seq, timeout=0.1):
            if context.should_stop():
                return
            yield None  # nothing yet: lets watermark generators notice idleness
            continue
        entry, seq = gate.read_joined(seq, join_most(into))
        if entry.kind is Kind.END_OF_STREAM:
            gate.advance(0, seq + 1)
            return
        if entry.kind is Kind.DATA:
            yield entry.batch  # zero-copy if alone: processed before the cursor moves past it
        seq += 1
        gate.advance(0, seq)


def join_most(into) -> int:
    """How many rows of small batches queued behind each other a channel's source reads as one
    (0: one at a time), for ``into`` as ``_one_gate`` gives it: for a per-record function that
    claims its pieces from inside a call (it publishes its rate), up to a claim piece of its work,
    once it measured its rate (a rescale's epoch may wait for as much as a joined batch's work: an
    instance none of whose rows it holds claims it whole); into a sink, or an operator that claims
    no pieces (its epochs wait for a batch as a user's batch of that size), up to
    ``JOINED_ROWS``; none before an instance of the operator said which it is."""
    if into is False:
        return 0
    if into is None:
        return JOINED_ROWS
    claim = into.readers_claim
    if claim is None or (claim and not into.read_rate_measured):  # not known yet
        return 0
    return int(CLAIM_PIECE_NS / into.read_ns_per_row) if claim else JOINED_ROWS


def _one_gate(context):
    """The keyed operator's gate the source's records all go to; None if they all go to one sink;
    False if small entries are read alone (``cut_unseen``)."""
    chain = context.stage.chain
    if not cut_unseen(chain):
        return False
    end = next(s for s in walk_steps(chain) if s.kind in _ENDS)
    return context.attached.gate(context.res.gates[end.gate]) if end.kind == "to_gate" else None


_ENDS = ("to_gate", "to_sink", "to_chained_sink")


def cut_unseen(chain) -> bool:
    """Whether a source's chain hands every record to one place without assigning timestamps:
    then how its input is cut into batches is not seen downstream, and the small entries queued
    in a channel's gate may be read as one (``Gate.read_joined``). Not so where a watermark
    follows each batch, or where a batch's records go to two places (a broadcast and a keyed
    stream, side outputs) in an order per batch."""
    steps = list(walk_steps(chain))
    ends = [s for s in steps if s.kind in _ENDS]
    return len(ends) == 1 and not any(s.kind in ("assign", "side") for s in steps)
