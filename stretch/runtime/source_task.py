"""A source task: reads a source and pushes its batches through its chained steps into gates."""

from __future__ import annotations

from stretch.common.records import gc_paused
from stretch.runtime import control_block as cbk
from stretch.runtime.batch import Records
from stretch.runtime.chain import Chain
from stretch.runtime.channel_source import LogBatches
from stretch.runtime.checkpointing import Barrier
from stretch.runtime.code_update import load_version, updated_step
from stretch.runtime.event_time import judge_of, mark_of, producer_id
from stretch.runtime.gate import Kind
from stretch.runtime.operators import InstanceRuntimeContext
from stretch.runtime.task import Stopped, Task
from stretch.runtime.transactions import round_of, txn_of


class SourceTask(Task):
    """Reads a source and pushes its batches through the chain into gates and sinks.

    Its position is what the source counts (``Source.advance``: items read, or records). At a
    checkpoint it records the position and waits until the coordinator has put the barrier behind
    its output; restarted from a checkpoint, a seekable source starts at the position, and any
    other is read again and skipped that many items.
    """

    def run(self) -> None:
        if self.a.code != self.stage.code_version:  # restarted after a live update of a step
            self.stage = load_version(self.res.code, self.stage.id, self.a.code)
        outputs = self.outputs(producer=1)
        outputs.producer_id = producer_id(self.stage.id, 0)
        chain = Chain(self.stage.chain, self.stage.name, outputs)
        chain.open(self._context())
        source_type = getattr(self.stage.source, "type_info", None)
        position = self.position = self.a.position
        source = self.stage.source
        skip = 0 if source.seekable else position
        barrier = Barrier(self.attached.control, self.stage.id) if self.res.checkpoints else None
        reader = source.create_reader(self)
        open_txn = 0  # no checkpoint barrier inside a stage transaction (runtime.transactions)
        cb = self.attached.control
        code_word = cb.stage_word(self.stage.id, cbk.S_CODE)
        try:
            for read in reader:
                item = read.batch if isinstance(read, LogBatches) else read  # batches of a log joined
                if self.should_stop():
                    raise Stopped()
                if cb.load(code_word) > self.stage.code_version:  # a live update of a chained step
                    self._update(cb.load(code_word), chain)
                if item is None:  # the source waits for input: time passes all the same
                    chain.tick()
                elif skip:
                    skip -= 1
                    continue
                else:
                    if isinstance(item, list):
                        with gc_paused(len(item)):  # the collector runs between batches
                            chain.push(Records(items=item, type_info=source_type))
                    elif (mark := mark_of(item)) is not False:  # the channel's watermark, from outside
                        if mark is None:
                            chain.emit(Kind.IDLE)
                        else:
                            chain.emit(Kind.WATERMARK, mark)
                    else:
                        txn, end = txn_of(item)
                        chain.outputs.txn, chain.outputs.round = txn, round_of(item)
                        chain.outputs.judge = judge_of(item)
                        if end:
                            chain.end_txn(txn, 1)
                            open_txn = 0
                        else:
                            with gc_paused(item.num_rows):
                                chain.push(Records(batch=item))
                            open_txn = txn
                    if isinstance(read, LogBatches):  # a channel's position counts log batches
                        position += read.count
                    else:
                        position = source.advance(position, item)
                if open_txn:
                    continue
                if barrier is not None and not barrier.source_reached(position, self.should_stop):
                    raise Stopped()
        finally:
            close = getattr(reader, "close", None)
            if close is not None:
                close()
        if barrier is not None:
            barrier.record_position(position)
        chain.finish()  # a bounded input ended: its watermark goes to the maximum
        chain.close()

    def _context(self) -> InstanceRuntimeContext:
        """What the chained steps of a source see: one instance, no keyed state."""
        return InstanceRuntimeContext(
            self.stage.name,
            0,
            lambda: 1,
            self.stage.max_parallelism,
            metrics=self.metrics,
            job_parameters=self.res.job_parameters,
        )

    def _update(self, version: int, chain: Chain) -> None:
        """Between two items: the chained step of the new code version takes over."""
        self.stage = load_version(self.res.code, self.stage.id, version)
        chain.update_step(updated_step(self.stage), self._context())
        cb = self.attached.control
        cb.signal(cb.stage_word(self.stage.id, cbk.S_CODE_DONE), version)
