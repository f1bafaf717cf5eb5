"""The server's one batch engine: a thread that owns the model's scheduler.

Requests come from many threads (HTTP handlers, the Batch API runner); only this thread
touches the scheduler. A request waits in one of two lines until a KV slot is free:
interactive requests are admitted first, batch requests only into slots no interactive
request is waiting for, and an interactive request finding every slot taken by batch requests
preempts the newest of them, so a long batch never starves a person at the keyboard. Each request's
events go to its own callback, from this thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from colibri.runtime.batch import Event


@dataclass(eq=False)
class Request:
    """Token ids to continue and how; `on_event(event)` receives each `runtime.batch.Event`."""

    prompt: list[int]
    sampling: dict
    on_event: Callable
    interactive: bool = True
    cancelled: bool = False
    cancel_reason: str | None = None  # why the engine ended it early, when it did
    done: threading.Event = field(default_factory=threading.Event)


class Engine:
    def __init__(self, model):
        self.model = model
        self.scheduler = model.scheduler()
        self.lines = {True: deque(), False: deque()}  # interactive, batch
        self.by_sequence: dict[int, Request] = {}
        self.wake = threading.Condition()
        self.stopping = False
        self.failure: BaseException | None = None
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="colibri-engine", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> Request:
        with self.wake:
            if self.failure is not None:
                raise RuntimeError(f"the engine stopped: {self.failure}")
            self.lines[request.interactive].append(request)
            self.wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """End `request` wherever it is (its slot is freed at the next step)."""
        with self.wake:
            request.cancelled = True
            self.wake.notify()

    def waiting(self) -> int:
        with self.wake:
            return len(self.lines[True]) + len(self.lines[False])

    def active(self) -> int:
        return len(self.scheduler.running)

    def close(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    # --- the engine thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self.wake:
                    while not (self.stopping or self.lines[True] or self.lines[False] or self.scheduler.busy):
                        self.wake.wait()
                    if self.stopping:
                        return
                    self._drop_cancelled()
                    self._admit()
                for event in self.scheduler.step():
                    request = self.by_sequence[event.sequence]
                    if event.finish_reason is not None:
                        del self.by_sequence[event.sequence]
                    self._deliver(request, event)
        except BaseException as e:  # a disk or kernel failure: every waiting request learns of it
            with self.wake:
                self.failure = e
                pending = list(self.by_sequence.values()) + list(self.lines[True]) + list(self.lines[False])
            for request in pending:
                self._deliver(request, e)

    def _drop_cancelled(self) -> None:
        for line in self.lines.values():
            for request in [r for r in line if r.cancelled]:
                line.remove(request)
                self._deliver(request, Event(-1, None, "", "cancelled"))
        for sequence, request in list(self.by_sequence.items()):
            if request.cancelled:
                del self.by_sequence[sequence]
                self._deliver(request, self.scheduler.cancel(sequence))

    def _admit(self) -> None:
        """Queued requests into free slots: interactive ones first, and when every slot is
        busy, an interactive request takes the slot of the batch request admitted last (which
        is then cancelled; its runner asks again, and gets the same answer later)."""
        room = len(self.scheduler.free) - len(self.scheduler.queue)
        while len(self.lines[True]) > room:
            batch = [s for s, r in self.by_sequence.items() if not r.interactive and not r.cancelled]
            if not batch:
                break
            victim = max(batch)
            self._deliver(self.by_sequence.pop(victim), self.scheduler.cancel(victim))
            room += 1
        for interactive in (True, False):
            line = self.lines[interactive]
            while room > 0 and line:
                request = line.popleft()
                self.by_sequence[self.scheduler.add(request.prompt, **request.sampling)] = request
                room -= 1

    @staticmethod
    def _deliver(request: Request, event) -> None:
        """Hand `event` (or the engine's failure) to the request. A receiver that raises (a
        closed connection's loop) must not stop the engine: it is logged, and its sequence is
        cancelled at the next step with the error as the reason."""
        try:
            request.on_event(event)
        except Exception as e:  # noqa: BLE001 - the receiver's problem, not the batch's
            if not request.cancelled:
                request.cancelled, request.cancel_reason = True, f"its receiver failed: {type(e).__name__}: {e}"
                logging.getLogger("colibri.serve").warning("request cancelled: %s", request.cancel_reason,
                                                           exc_info=True)
        if isinstance(event, BaseException) or event is None or event.finish_reason is not None:  # None: ended before
            request.done.set()
