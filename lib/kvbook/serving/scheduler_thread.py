"""The scheduler in a thread of its own, so that the server's event loop keeps answering while the model computes.

The event loop hands requests in as Tickets and gets each one's Steps back on its own asyncio queue; only this
thread touches the scheduler (kvbook.runtime.scheduler). Explained in chapters 10 ("Serving") and 11 ("Tuning the
service").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from ..runtime.engine import Engine
from ..runtime.scheduler import Scheduler
from ..runtime.sequence import Sequence
from .protocol import ChatCompletionRequest

log = logging.getLogger("kvbook.serving.server")  # the server's one logger (README): a failed step is the server's news


class ShutdownError(RuntimeError):
    """The server is stopping and this request did not finish within the grace period."""


@dataclass(eq=False)
class Ticket:
    """A request handed to the scheduler thread: its Steps come back on `steps` (None after the last one, an
    exception if its forward pass failed or the server shut down first)."""

    input_ids: list[int]
    sampling: Sampling
    deliver: object  # puts an item on the request's asyncio queue, from the scheduler thread
    steps: asyncio.Queue
    sequence: Sequence | None = None


@dataclass(frozen=True)
class Sampling:
    """A request's generation options, defaults filled in."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    top_k: int = 0

    @classmethod
    def of(cls, body: ChatCompletionRequest, default_max_tokens: int) -> Sampling:
        return cls(max_tokens=body.new_tokens or default_max_tokens,
                   temperature=1.0 if body.temperature is None else body.temperature,
                   top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                   ignore_eos=bool(body.ignore_eos), stop=tuple(body.stop_strings), top_k=body.top_k or 0)


class SchedulerThread:
    """Runs the scheduler's forward passes in a thread, so the event loop keeps serving while the model computes.
    The event loop only puts tickets, aborts and a shutdown in the inbox; the thread alone touches the scheduler."""

    def __init__(self, engine: Engine, record_timeline: bool = False):
        server = engine.config.server
        self.scheduler = Scheduler(engine, server.max_num_seqs, record_timeline, server.prefill_chunk)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.tickets: dict[Sequence, Ticket] = {}
        self._unread = 0  # tickets in the inbox, not yet in the scheduler's queue
        self._unread_lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="kvbook-scheduler", daemon=True)
        self.thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running (read from the event loop: a snapshot, never too low)."""
        return self._unread + len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def busy(self) -> bool:
        return bool(self._unread or self.tickets)

    def submit(self, input_ids: list[int], sampling: Sampling) -> Ticket:
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue = asyncio.Queue()
        ticket = Ticket(input_ids, sampling, lambda item: loop.call_soon_threadsafe(steps.put_nowait, item), steps)
        with self._unread_lock:
            self._unread += 1
        self.inbox.put(("add", ticket))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The client went away or stopped listening: the sequence leaves at the next step (no-op once done)."""
        self.inbox.put(("abort", ticket))

    def end_all(self, error: Exception) -> None:
        """Fail every request in flight with `error` (a shutdown past its grace period)."""
        self.inbox.put(("end_all", error))

    def close(self) -> None:
        self.closed = True
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while not self.closed:
            self._read_inbox(wait=not self.scheduler.has_work)
            try:
                stepped = self.scheduler.step()
            except Exception as err:  # noqa: BLE001 - a bug outside the forward pass: fail the requests, never hang
                log.exception("scheduler step failed; failing every request in flight")
                self._fail_all(err)
                continue
            for seq in stepped:
                ticket = self.tickets[seq]
                ticket.deliver(seq.error if seq.error is not None else seq.steps[-1])
            for seq in [seq for seq in self.tickets if seq.finished]:
                self.tickets.pop(seq).deliver(None)

    def _fail_all(self, err: Exception) -> None:
        for seq, ticket in self.tickets.items():
            ticket.deliver(err)
            self.scheduler.abort(seq)

    def _read_inbox(self, wait: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.1) if wait else self.inbox.get_nowait()
            while True:
                kind, payload = item
                if kind == "abort" and payload.sequence is not None:
                    self.scheduler.abort(payload.sequence)
                elif kind == "add":
                    self._add(payload)
                elif kind == "end_all":
                    self._fail_all(payload)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, ticket: Ticket) -> None:
        s = ticket.sampling
        try:
            ticket.sequence = self.scheduler.add(ticket.input_ids, s.max_tokens, temperature=s.temperature,
                                                 top_p=s.top_p, seed=s.seed, ignore_eos=s.ignore_eos,
                                                 top_k=s.top_k)
        except Exception as err:  # noqa: BLE001 - checked before submission; reported, never lost
            ticket.deliver(err)
            ticket.deliver(None)
            return
        finally:
            with self._unread_lock:
                self._unread -= 1
        self.tickets[ticket.sequence] = ticket
