"""The cells in flight in one local sandbox, over every thread's batches, and the line of batches waiting for a CPU
slot: what `dispatch.py`'s CPU-aware admission counts and takes turns by.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

# How often a batch behind the first in line looks again without being woken (see `InFlight.wait_in_line`).
BEHIND_CHECK_S = 0.5


class InFlight:
    """The cells running in all batches of one sandbox: several threads may run batches at once (the async rollout
    runs one per completion), and the CPU-aware admission counts them all.

    It also keeps the line of batches waiting for a CPU slot, oldest first: a slot that frees goes to the batch that
    waited longest, whose thread is woken at once, rather than to whichever of dozens of polling threads looks first.
    Without the line, 32 threads each running one cell waited up to 125 ms (p99) for a slot that others, arriving
    later, kept taking; and their polling itself took the CPU the cells needed.

    Every step of the line is O(1) (an `OrderedDict`, not a scanned deque), and only the first in line polls often:
    the sandbox server under 1,024 sessions on 2 cores holds about a thousand batches in line, and when each polled
    every 20 ms and every look scanned the whole line, the server served 6.6 calls/s per core there (10.1 at 256
    sessions) and lost 1,455 calls to its clients' request timeout; 8.9 and none once the line was O(1) and quiet
    (`scripts/results/sandbox_capacity.jsonl`, lines 2 and 3)."""

    def __init__(self):
        self._entries: set = set()
        self._lock = threading.Lock()
        self._line: OrderedDict = OrderedDict()  # batch -> its wake-up event, for the batches waiting, oldest first
        # Slots are counted and taken under one lock, and a taken slot counts from then on (`claimed`), before its
        # cell is in `_entries`: otherwise a burst of threads all see the same free slots and all take them.
        self.admitting = threading.Lock()
        self.claimed = 0

    @property
    def count(self) -> int:
        return len(self._entries)

    def add(self, entry) -> None:
        with self._lock:
            self._entries.add(entry)

    def remove(self, entry) -> None:
        with self._lock:
            self._entries.discard(entry)
            self._wake_first()  # a slot may be free: the longest waiter looks first

    def _wake_first(self) -> None:
        """Wakes the batch first in line, if any (called with `_lock` held)."""
        if self._line:
            next(iter(self._line.values())).set()

    def snapshot(self) -> list:
        with self._lock:
            return list(self._entries)

    def release_claims(self, count: int) -> None:
        """Slots taken by an admission whose cells are now in flight (or failed to start): no longer claimed."""
        if count:
            with self.admitting:
                self.claimed -= count
            with self._lock:
                self._wake_first()

    def first_in_line(self, batch) -> bool:
        """Whether `batch` may take a slot now: nobody waits, or it waited longest (it joins the line otherwise)."""
        with self._lock:
            if not self._line:
                return True
            return self._join(batch)[1]

    def wait_in_line(self, batch, timeout_s: float) -> None:
        """Joins the line if not in it, and sleeps until woken (a slot may have freed, or it became first) or, as a
        safety net for a slot freed without a wake-up (a running cell that went to sleep), `timeout_s` passed. Only the
        first in line checks every `timeout_s`: the others can take no slot before they are first, and the batch that
        makes one first (by leaving the line) wakes it; they look again only every `BEHIND_CHECK_S`, in case a batch
        ahead of them left without a word."""
        with self._lock:
            event, first = self._join(batch)
        event.wait(timeout_s if first else max(timeout_s, BEHIND_CHECK_S))
        event.clear()

    def _join(self, batch) -> tuple[threading.Event, bool]:
        """Puts `batch` at the end of the line if it is not in it; its wake-up event, and whether it is first (called
        with `_lock` held)."""
        event = self._line.setdefault(batch, threading.Event())
        return event, next(iter(self._line)) is batch

    def leave_line(self, batch) -> None:
        """Leaves the line (it took a slot, or stopped waiting); wakes whoever is first now."""
        with self._lock:
            if self._line.pop(batch, None) is not None:
                self._wake_first()
