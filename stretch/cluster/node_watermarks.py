"""Event time on a node: every writer of an event-time input channel is an input split with its
own watermark (Flink's model), and the channel's watermark here is the minimum over the live ones.

Writers (cluster.writer_clock) send their watermark with every part of rows they send (the
watermark before those rows, so a node judges a row late exactly as one engine would), and after
every write to every node, rows or none, so a node that got none of a writer's rows still moves
on. A writer that says it closed is dropped from the minimum; with ``with_idleness(d)`` a writer
that wrote no rows for ``d`` stops holding the others back until it writes again. When nothing
holds it back (every writer idle or closed) the channel's watermark goes on to the furthest any
writer got, as one engine's would, and the channel is idle meanwhile (its gates' other producers
go on without it); a writer that writes again takes part in the minimum again. The channel's
watermark reaches the job as a mark batch in the channel (runtime.event_time.mark_batch), in order
with the rows: the job's source task passes it on to its keyed gates, whose operators (windows,
timers, joins) run as on one machine.
"""

from __future__ import annotations

import contextlib
import threading
import time

from stretch.runtime.event_time import MIN_WATERMARK, WatermarkGenerator

TICK_S = 0.05  # how often idleness is judged, for channels with an idle timeout


class WriterWatermarks:
    """One input channel's writers as this node has heard them: their latest watermark, when
    they last wrote rows, and whether they closed."""

    def __init__(self, idle_timeout_s: float | None = None):
        self.idle_timeout = idle_timeout_s
        self.marks: dict[str, int] = {}
        self.active: dict[str, float] = {}  # writer -> when it last wrote rows (monotonic)
        self.closed: set[str] = set()
        self.emitted = MIN_WATERMARK  # the channel's watermark given to the job
        self.idle = False

    def observe(
        self, writer: str, watermark: int, active: bool = True, closed: bool = False, replaces=None
    ) -> list:
        """A writer's progress; the marks to give the job (a watermark, or None: idle).
        ``replaces``: the placeholder this writer takes the place of (a forward's split, announced
        before its instance spoke: cluster.forward_ends), gone for good from now on."""
        if replaces is not None and replaces not in self.closed:
            self.closed.add(replaces)
            self.marks.pop(replaces, None)
            self.active.pop(replaces, None)
        if writer in self.closed:
            return []
        self.marks[writer] = max(self.marks.get(writer, MIN_WATERMARK), int(watermark))
        if active or writer not in self.active:
            self.active[writer] = time.monotonic()
        if closed:
            self.closed.add(writer)
        return self.marks_now()

    def note(self, writer: str, watermark: int) -> None:
        """A writer's progress, given to the job later (``marks_now``): a stage's query."""
        self.marks[writer] = max(self.marks.get(writer, MIN_WATERMARK), int(watermark))
        self.active[writer] = time.monotonic()

    def marks_now(self) -> list:
        """The marks the writers' state calls for now (idleness depends on the time)."""
        live = [w for w in self.marks if w not in self.closed]
        now, timeout = time.monotonic(), self.idle_timeout
        awake = [self.marks[w] for w in live if timeout is None or now - self.active[w] < timeout]
        if awake:
            low = min(awake)
            if low > self.emitted or self.idle:
                self.emitted, self.idle = max(self.emitted, low), False
                return [self.emitted]
            return []
        # Nothing holds time back (every writer idle or closed): on to the furthest any writer
        # got, as one engine's watermark would be, and the channel goes idle meanwhile.
        marks = []
        top = max(self.marks.values(), default=MIN_WATERMARK)
        if top > self.emitted:
            self.emitted = top
            marks.append(top)
        if self.marks and not self.idle:
            self.idle = True
            marks.append(None)
        return marks

    def state(self) -> dict:
        return {"marks": dict(self.marks), "closed": sorted(self.closed), "emitted": self.emitted}

    def load(self, state: dict) -> list:
        """Start from another node's (or a checkpoint's) view of the writers; the marks to give."""
        now = time.monotonic()
        for writer, mark in state["marks"].items():
            self.marks[writer] = max(self.marks.get(writer, MIN_WATERMARK), int(mark))
            self.active.setdefault(writer, now)
        self.closed.update(state["closed"])
        return self.marks_now()


class RoundClock:
    """A Spark query writing through the one-query stage, as one writer with one engine's
    micro-batch rule: a micro-batch's largest timestamp counts once the next one begins. Its
    tasks tell every node the largest timestamp of their rows once they are taken, and Spark
    starts micro-batch n + 1 only when every task of n is done, so a node that hears of n + 1 has
    heard every task of n."""

    def __init__(self, delay: int):
        self.delay = delay
        self.round = -1  # the latest micro-batch begun
        self.done = MIN_WATERMARK  # the largest timestamp of the micro-batches before it
        self.maxes: dict[int, int] = {}  # micro-batch (not before ``round``) -> its largest so far

    def note(self, round: int, max_ts: int | None = None) -> int:
        """Micro-batch ``round`` has begun (with its largest timestamp, if a task says); the
        query's watermark."""
        if round > self.round:
            self.round = round
            for r in [r for r in self.maxes if r < round]:
                self.done = max(self.done, self.maxes.pop(r))
        if max_ts is not None:
            if round < self.round:
                self.done = max(self.done, max_ts)
            else:
                self.maxes[round] = max(self.maxes.get(round, MIN_WATERMARK), max_ts)
        return self.done - self.delay if self.done > MIN_WATERMARK + self.delay else MIN_WATERMARK


class NodeEventTime:
    """The writers' watermarks of each event-time input channel of one job on this node, handed
    to the job's channels (``append``: channel, mark) as they advance."""

    def __init__(self, strategies: dict, append):
        self.channels = {
            channel: WriterWatermarks(_seconds(strategy.idle_timeout))
            for channel, strategy in strategies.items()
        }
        self.delays = {
            channel: WatermarkGenerator(strategy).delay for channel, strategy in strategies.items()
        }
        self.rounds: dict[tuple[str, str], RoundClock] = {}  # (channel, query) of a stage
        self.stage_channels: set[str] = set()  # written by a stage: marks only inside its parts
        self.append = append
        self.lock = threading.Lock()
        self.guard = (
            contextlib.nullcontext()
        )  # held (the node's lock) by whatever else appends to the channels
        self._stop = threading.Event()
        self._ticker = None
        if any(w.idle_timeout is not None for w in self.channels.values()):
            self._ticker = threading.Thread(target=self._tick, name="stretch-idleness", daemon=True)
            self._ticker.start()

    def observe(self, channel: str, progress: dict) -> None:
        """A writer's progress (``writer``, ``watermark``, ``active``, ``closed``) on ``channel``."""
        writers = self.channels.get(channel)
        if writers is None:
            return
        with self.lock:
            marks = writers.observe(
                progress["writer"],
                progress["watermark"],
                progress.get("active", True),
                progress.get("closed", False),
                progress.get("replaces"),
            )
            self._give(channel, marks)

    def round_progress(self, channel: str, query: str, round: int, max_ts: int | None = None) -> list:
        """A stage task's word on micro-batch ``round`` of ``query`` (its rows' largest timestamp,
        once they were taken); the marks to give the job now. They go only into a transaction
        part of the stage (``in_part``), whose results then carry the windows they fire: a node
        that takes no rows of a micro-batch gives them with the next part it takes."""
        writers = self.channels.get(channel)
        if writers is None:
            return []
        with self.lock:
            clock = self.rounds.setdefault((channel, query), RoundClock(self.delays[channel]))
            self.stage_channels.add(channel)
            writers.note(f"stage:{query}", clock.note(round, max_ts))
            return []

    def in_part(self, channel: str, query: str, round: int) -> list:
        """A part of micro-batch ``round`` of ``query``, taken: the marks to give inside it."""
        self.round_progress(channel, query, round)
        writers = self.channels.get(channel)
        if writers is None:
            return []
        with self.lock:
            return writers.marks_now()

    def now(self, channel: str) -> int | None:
        """The watermark the job has for ``channel`` now (None: no event time there)."""
        writers = self.channels.get(channel)
        return writers.emitted if writers is not None else None

    def state(self) -> dict:
        with self.lock:
            return {channel: w.state() for channel, w in self.channels.items()}

    def load(self, state: dict) -> None:
        with self.lock:
            for channel, s in state.items():
                if channel in self.channels:
                    self._give(channel, self.channels[channel].load(s))

    def _give(self, channel: str, marks: list) -> None:
        for mark in marks:
            try:
                self.append(channel, mark)
            except RuntimeError:  # the job has ended: nothing to move on
                return

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self.guard, self.lock:
                if self._stop.is_set():
                    return
                for channel, writers in self.channels.items():
                    if writers.idle_timeout is not None and channel not in self.stage_channels:
                        self._give(channel, writers.marks_now())

    def close(self) -> None:
        """Stop ticking (not waited for: the caller may hold the node's lock, which a tick takes;
        a tick after the job ended appends nothing)."""
        self._stop.set()


def _seconds(duration) -> float | None:
    return duration.to_milliseconds() / 1000 if duration is not None else None
