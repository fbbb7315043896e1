"""The job side of channels: the gates and logs behind a job's input and output channels, and the
answers to the outside processes that write or read them.

Input channels: outside writers append to a gate of the channel's own, which the channel's source
task reads; a channel keyed by a field right away is *direct*: its writers append to the keyed
operator's gate themselves. A durable channel is also copied, in gate order, into a log under the
job's directory (``runtime.input_logger``), which a checkpointed job reads instead of the gate.
Output channels: the job appends its results to a durable log that readers read by offset.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from dataclasses import dataclass, field

import pyarrow as pa

from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.channel_writers import ChannelLogWriter
from stretch.runtime.event_time import MAX_WATERMARK, producer_id
from stretch.runtime.gate import Gate, Kind
from stretch.runtime.input_logger import InputLogger, LogProgress
from stretch.runtime.publisher import ChannelPublisher
from stretch.runtime.state_dir import JobDir
from stretch.runtime.transactions import TxnResults, name_of, txn_of


@dataclass
class OutputChannel:
    log: ChannelLog
    tail: LogTail
    run_start: int  # the log's end when this run began: where this run's output starts
    type_info: object = None  # of its records, where the job declares it
    writer: ChannelLogWriter | None = None  # the job's side, once it runs
    txns: TxnResults = field(default_factory=TxnResults)  # results of stage transactions


class JobChannels:
    """A job's channels; built by ``open`` while the job starts, answered from any thread."""

    def __init__(self, job, staging):
        self.job = job  # the Coordinator: its plan, config, job directory and segments
        self.inputs: dict[str, Gate] = {}  # channel name -> its gate (not direct channels)
        self.direct: dict = {}  # channel name -> source stage whose writers feed a keyed gate
        self.outputs: dict[str, OutputChannel] = {}
        self.log_starts: dict[int, int] = {}  # channel source stage -> its log's end as the run began
        self.input_logs: dict[int, ChannelLog] = {}  # channel source stage -> the log it reads
        self.log_locations: dict[str, tuple[str, str]] = {}  # input channel -> (log directory, tail)
        self.loggers: list[InputLogger] = []
        self._ended: set[str] = set()
        self.stage_txns: list[tuple] = []  # what the latest checkpoint says of stage transactions
        self.aborted_txns: set[int] = set()  # a restored run's: transactions its replay skips
        self._shapes: dict[str, pa.Schema] = {}  # untyped input channel -> the first batch's schema
        self._shapes_lock = threading.Lock()
        self.publisher = ChannelPublisher(
            staging,
            lambda name: self.request("channel", {"name": name, "role": "writer"}),
            self.establish_shape,
        )

    # ---- while the job starts ---------------------------------------------------------------
    def open_outputs(self, restore: dict | None) -> None:
        """The output channels' logs, without what no checkpoint covered (a restored run makes
        it again, and no reader ever saw it)."""
        job = self.job
        for sink in job.plan.sinks:
            name = getattr(sink.sink, "channel_name", None)
            if sink.runs_in != "job" or name is None:
                continue
            if name in self.outputs:
                raise ValueError(f"two sinks write to channel {name!r}: give each its own name")
            log = self.log(name, "out")
            committed = log.readable_end
            log.truncate(restore["outputs"].get(name, committed) if restore else committed)
            log.begin_run(log.end_offset)  # readers by name start there, also after the run
            tail = LogTail.create(job.prefix, log.end_offset)
            job.add_segment(tail.segment)
            self.outputs[name] = out = OutputChannel(log, tail, log.end_offset, sink.type_info)
            out.txns.tracking = job.config.checkpointing

    def open_inputs(self) -> None:
        """Gates (and durable logs) of the input channels that are not direct."""
        job, cfg = self.job, self.job.config
        for stage in job.plan.stages:
            name = getattr(stage.source, "channel_name", None)
            if name is None:
                continue
            if stage.direct:
                self.direct[name] = stage
                continue
            g = Gate.create(job.prefix, "channel", cfg.gate_slots, cfg.gate_bytes)
            if not cfg.checkpointing:  # else the source reads the channel's log, not its gate
                g.open_reader(0, 0)
            self.inputs[name] = g
            job.add_segment(g.segment)
            if getattr(stage.source, "durable", False):
                log = self.log(name, "in")
                tail = None
                if cfg.checkpointing:  # its source reads the log: from here, or a checkpoint's offset
                    tail = LogTail.create(job.prefix, log.end_offset)
                    job.add_segment(tail.segment)
                    self.log_locations[name] = (str(log.dir), tail.name)
                    self.log_starts[stage.id] = log.end_offset
                    self.input_logs[stage.id] = log
                self._add_logger(name, g, 1, log, tail=tail)

    def poke_sources(self) -> None:
        """Wake the sources reading input channel logs (LogTail.poke)."""
        for logger in self.loggers:
            if logger.tail is not None:
                logger.tail.poke()

    def restore_txns(self, restore: dict) -> None:
        """A restored run's stage transactions (see runtime.transactions): those its checkpoint
        covers are answered with their results; those its input logs replay, by their number;
        those whose end the dead run never logged are skipped by the replay (``aborted``)."""
        self.stage_txns = [tuple(t) for t in restore.get("txns", ())]
        answered = {}
        for channel, query, batch, partition, _, offsets, output in self.stage_txns:
            out = self.outputs.get(output)
            if out is not None:
                answered[(channel, query, batch, partition)] = {
                    "ok": True,
                    "log": str(out.log.dir),
                    "offsets": offsets,
                }
        replayed: dict[tuple, int] = {}
        for stage_id, log in self.input_logs.items():
            position = restore["sources"].get(str(stage_id), self.log_starts[stage_id])
            started, ended = set(), {}
            for batch in log.read(position, log.end_offset):
                txn, end = txn_of(batch)
                if end:
                    ended[txn] = name_of(batch)
                elif txn:
                    started.add(txn)
            self.aborted_txns |= started - set(ended)
            for txn, name in ended.items():
                out = self.outputs.get(name[4]) if name is not None else None
                if out is not None:
                    replayed[tuple(name[:4])] = txn
                    out.txns.name(txn, tuple(name[:4]))
        self.publisher.restore(answered, replayed)

    def record_txns(self, checkpoint: int) -> list[list]:
        """The stage transactions checkpoint ``checkpoint`` records: those of earlier ones and
        those completed before its barrier, each query's latest micro-batch only."""
        table = {(t[0], t[1], t[2], t[3]): t for t in self.stage_txns}
        for output, out in self.outputs.items():
            for (channel, query, batch, partition), txn, offsets in out.txns.covered(checkpoint):
                table[(channel, query, batch, partition)] = (
                    channel,
                    query,
                    batch,
                    partition,
                    txn,
                    offsets,
                    output,
                )
        latest: dict[tuple, int] = {}
        for channel, query, batch, *_ in table.values():
            latest[(channel, query)] = max(batch, latest.get((channel, query), -1))
        self.stage_txns = [t for t in table.values() if t[2] == latest[(t[0], t[1])]]
        return [list(t) for t in self.stage_txns]

    def log_direct_inputs(self, gates: dict[int, Gate]) -> None:
        """Durable direct channels are logged from the keyed gate, with a reader slot of their own."""
        for name, stage in self.direct.items():
            if getattr(stage.source, "durable", False):
                gate = gates[stage.chain[0].gate]
                log = self.log(name, "in")
                self._add_logger(name, gate, gate.logger_slot, log, producer_id(stage.id, 0))

    def _add_logger(
        self, name: str, gate: Gate, reader: int, log: ChannelLog, producer=None, tail=None
    ) -> None:
        progress = LogProgress.create(self.job.prefix, log.end_offset, 0)
        self.job.add_segment(progress.segment)
        self.loggers.append(InputLogger(name, gate, reader, log, progress, producer, tail))

    def writer_for(self, sink) -> ChannelLogWriter | None:
        """The job's writer of an output channel sink (None: the sink is not a channel)."""
        out = self.outputs.get(getattr(sink.sink, "channel_name", None))
        if out is None:
            return None
        timed = getattr(sink.sink, "timed", False)  # a forward log's (cluster.forward_log)
        out.writer = ChannelLogWriter(out.log, out.tail, self.job.config.checkpointing, timed)
        return out.writer

    def txns_of(self, sink) -> TxnResults | None:
        """Where an output channel sink records the results of stage transactions."""
        out = self.outputs.get(getattr(sink.sink, "channel_name", None))
        return None if out is None else out.txns

    def start(self) -> None:
        for logger in self.loggers:
            logger.start()

    def log(self, name: str, direction: str) -> ChannelLog:
        """A channel's durable log in the job's directory, continued by this run."""
        job = self.job
        if job.job_dir is None:
            job.job_dir = JobDir(job.job_name, job.job_id)
        log = ChannelLog(job.job_dir.channel(name, direction), job.config.channel_retention_bytes)
        log.resume()
        return log

    # ---- checkpoints and recovery -----------------------------------------------------------
    def pin_inputs(self, positions: dict[int, int]) -> None:
        """Input logs keep everything from these positions on (what a recovery would read again)."""
        for stage_id, log in self.input_logs.items():
            log.pinned = positions.get(stage_id, positions.get(str(stage_id), log.pinned))

    def output_offset(self, sink, checkpoint: dict) -> int | None:
        """Where a recovered run's output channel continues: the checkpoint's offset."""
        name = getattr(sink.sink, "channel_name", None)
        out = self.outputs.get(name)
        return None if out is None else checkpoint["outputs"].get(name, out.run_start)

    # ---- requests from writers and readers --------------------------------------------------
    def request(self, op: str, msg: dict) -> dict:
        """A writer or reader joining a channel (``channel``), or a writer ending it (``channel_end``)."""
        name = msg.get("name")
        if not isinstance(name, str):
            return {"ok": False, "error": f"a channel name must be a string, got {name!r}"}
        role = msg.get("role")
        if op == "channel":
            if name in self.direct and role == "writer":
                stage = self.direct[name]
                step = stage.chain[0]
                t = stage.source.type_info
                return {
                    "ok": True,
                    "segment": self.job.gates[step.gate].name,
                    "staging": str(self.publisher.staging),
                    "type": t.to_json() if t else None,
                    "key_field": step.key.field,
                    "max_parallelism": step.key.max_parallelism,
                    "runs": step.key.runs,
                    "producer": producer_id(stage.id, 0),
                    "pid": os.getpid(),
                }
            if name in self.inputs and role == "writer":
                source = next(
                    s.source for s in self.job.plan.stages if getattr(s.source, "channel_name", None) == name
                )
                t = source.type_info
                return {
                    "ok": True,
                    "segment": self.inputs[name].name,
                    "staging": str(self.publisher.staging),
                    "type": t.to_json() if t else None,
                    "pid": os.getpid(),
                }
            if name in self.outputs and role == "reader":
                out = self.outputs[name]
                return {
                    "ok": True,
                    "log": str(out.log.dir),
                    "tail": None if self.job.done else out.tail.name,  # its segment goes with the job
                    "run_start": out.run_start,
                    "type": out.type_info.to_json() if out.type_info is not None else None,
                }
            inputs, outputs = sorted([*self.inputs, *self.direct]), sorted(self.outputs)
            if role == "reader" and name in inputs:
                error = (
                    f"channel {name!r} is an input channel of the job: write into it with open_writer; "
                    f"read one of its output channels ({', '.join(outputs) or 'none'})"
                )
            elif role == "writer" and name in outputs:
                error = (
                    f"channel {name!r} is an output channel of the job: read it with open_reader; "
                    f"write into one of its input channels ({', '.join(inputs) or 'none'})"
                )
            else:
                error = (
                    f"job has no channel {name!r} to {'write' if role == 'writer' else 'read'} "
                    f"(input channels: {inputs}, output channels: {outputs})"
                )
            return {"ok": False, "type": "LookupError", "error": error}
        if op == "channel_shape" and (name in self.direct or name in self.inputs):
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(msg["schema"])))
            shape = self.establish_shape(name, schema)
            return {"ok": True, "schema": base64.b64encode(shape.serialize().to_pybytes()).decode()}
        if op == "channel_end" and (name in self.direct or name in self.inputs):
            self.job.end_channel(name)
            return {"ok": True}
        return {"ok": False, "error": f"unknown channel {name!r}", "type": "LookupError"}

    def establish_shape(self, name: str, schema: pa.Schema) -> pa.Schema:
        """An untyped input channel's schema: the first one a writer offers, kept for the run."""
        with self._shapes_lock:
            return self._shapes.setdefault(name, schema)

    def end(self, name: str) -> None:
        """In the job thread: a writer ended channel ``name``: the end of its stream goes into its gate."""
        if name in self._ended:
            return
        self._ended.add(name)
        stage = self.direct.get(name)
        if stage is not None:
            # the writers' input ended: as a bounded source does, move their watermark to the end
            self.job.gates[stage.chain[0].gate].append_control(
                Kind.WATERMARK, producer_id(stage.id, 0), MAX_WATERMARK
            )
            self.job.instance_done(stage.id, 0)
        else:
            self.inputs[name].append_control(Kind.END_OF_STREAM)

    def publish_txn(self, msg: dict) -> dict:
        """A stage transaction (``stretch.spark.stage``): publish its staged input into channel
        ``name``; answer with the offsets of its results in output channel ``output`` (readable)."""
        name, output = msg["name"], msg["output"]
        out = self.outputs.get(output)
        if out is None:
            raise LookupError(
                f"job has no output channel {output!r} (output channels: {sorted(self.outputs)})"
            )

        def results(txn: int) -> dict:
            while True:
                offsets, generation = out.txns.wait(txn)
                end = max(offsets, default=-1) + 1
                # a checkpointed job's output is readable once a checkpoint covers it
                while out.log.readable_end < end and out.txns.generation == generation:
                    time.sleep(0.002)
                if out.txns.generation == generation:
                    return {"ok": True, "log": str(out.log.dir), "offsets": offsets}

        txn_id = (str(msg["query"]), int(msg["batch"]), int(msg["partition"]))
        return self.publisher.publish_txn(name, txn_id, list(msg["files"]), results, output, out.txns.name)

    def publish(self, op: str, msg: dict) -> dict:
        """A staged transaction (Spark's sink commit or abort); may block while the channel is full."""
        if op == "channel_publish":
            return self.publisher.publish(
                msg["name"], str(msg["query"]), int(msg["batch"]), list(msg["files"])
            )
        self.publisher.discard(list(msg["files"]))
        return {"ok": True}

    # ---- shutdown ---------------------------------------------------------------------------
    def close_gates(self, reason: str) -> None:
        for g in self.inputs.values():
            g.close(reason)

    def stop_loggers(self, timeout: float) -> None:
        """Loggers read gates: they end before the gates go."""
        for logger in self.loggers:
            logger.join(timeout)
            if logger.is_alive():
                logger.gate.close()
                logger.join()

    def close(self, finished: bool) -> None:
        """No reader waits on a run that is over: each output's live end says how it ended."""
        for out in self.outputs.values():
            if out.tail.state == LogTail.RUNNING:
                ended = finished and out.log.ended
                out.tail.publish(out.log.end_offset, LogTail.ENDED if ended else LogTail.FAILED)
        for out in self.outputs.values():
            out.log.close()
        self.publisher.remove()
