"""How a ChannelSource task reads its input, in the job's worker.

Outside writers append to the channel's gate. A checkpointed job reads the channel's durable log
instead (the job copies the gate into it), from the position a checkpoint recorded, so that a
recovery reads again exactly what came after it, less the stage transactions whose end the dead
run never logged (runtime.transactions).
"""

from __future__ import annotations

from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.gate import Kind
from stretch.runtime.transactions import txn_of


def read_channel(context, name: str):
    """The batches of input channel ``name``; None while nothing arrives (time passes)."""
    if context.res.checkpoints is not None:
        return read_log(context, name)
    return read_gate(context, name)


def read_log(context, name: str):
    """A checkpointed job reads the channel's log (which the job keeps from the channel's gate)
    from its position on, so a recovery can go back to a checkpoint's offset."""
    directory, tail_name = context.res.channel_logs[name]
    log, tail = ChannelLog(directory, create=False), LogTail.attach(tail_name)
    offset = context.position
    aborted = context.res.aborted_txns
    try:
        while True:
            end = tail.end
            if offset < end:
                for batch in log.read(offset, end):
                    offset += 1
                    if aborted and txn_of(batch)[0] in aborted:  # a dead run's unfinished transaction
                        yield batch.slice(0, 0).replace_schema_metadata(None)  # keeps the count
                    else:
                        yield batch
            elif tail.state != LogTail.RUNNING:
                return
            elif not tail.wait(offset, timeout=0.1):
                if context.should_stop():
                    return
                yield None  # nothing yet: lets watermark generators notice idleness
    finally:
        log.close()
        tail.close()


def read_gate(context, name: str):
    gate = context.channel_gate(name)
    seq = gate.cursor(0)
    while True:
        if not gate.wait(seq, timeout=0.1):
            if context.should_stop():
                return
            yield None  # nothing yet: lets watermark generators notice idleness
            continue
        entry = gate.read(seq)
        if entry.kind is Kind.END_OF_STREAM:
            gate.advance(0, seq + 1)
            return
        if entry.kind is Kind.DATA:
            yield entry.batch  # zero-copy: processed before the cursor moves past it
        seq += 1
        gate.advance(0, seq)
