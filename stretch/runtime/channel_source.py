"""How a ChannelSource task reads its input, in the job's worker.

Outside writers append to the channel's gate. A checkpointed job reads the channel's durable log
instead (the job copies the gate into it), from the position a checkpoint recorded, so that a
recovery reads again exactly what came after it, less the stage transactions whose end the dead
run never logged (runtime.transactions).
"""

from __future__ import annotations

from stretch.plan.stages import walk_steps
from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.frontier import CLAIM_PIECE_NS
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
    into = _one_gate(context)

    def read(seq: int):
        """Entry ``seq``, or small ones queued joined: up to a claim piece of the work of the keyed
        operator they go to, once it measured its rate: a rescale's epoch may wait for as much as
        a joined entry's work (an instance none of whose rows it holds claims it whole)."""
        if into is False:
            return gate.read(seq), seq
        if into is None:
            return gate.read_joined(seq)
        if not into.read_rate_measured:
            return gate.read(seq), seq
        return gate.read_joined(seq, int(CLAIM_PIECE_NS / into.read_ns_per_row))

    seq = gate.cursor(0)
    while True:
        if not gate.wait(seq, timeout=0.1):
            if context.should_stop():
                return
            yield None  # nothing yet: lets watermark generators notice idleness
            continue
        entry, seq = read(seq)
        if entry.kind is Kind.END_OF_STREAM:
            gate.advance(0, seq + 1)
            return
        if entry.kind is Kind.DATA:
            yield entry.batch  # zero-copy if alone: processed before the cursor moves past it
        seq += 1
        gate.advance(0, seq)


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
