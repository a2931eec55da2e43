"""When a run saves: every K steps, every T seconds, and once more at a preemption.

A step rule is the same on every rank by construction. Time and signals are not: each
rank has its own clock and receives SIGTERM on its own, and ranks that disagree on whether
a step saves would leave some of them waiting in the save's collectives. So as soon as a
time rule or preemption is asked for, each decision is agreed: one all-reduce (MAX) of two
small ints on the manager's group per ``should_save`` call, and a step saves on every rank
when it is due on any. ``reached_preemption`` for the same step reuses that answer.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CheckpointError
from .preemption import Preemption

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    save: bool  # save this step
    preempted: bool  # a preemption signal has reached some rank (agreed): the loop should stop after it


class Schedule:
    """The save schedule of one manager (see the module doc).

    Args:
        save_every: Steps divisible by it save (None: no step rule).
        save_interval_s: A step saves when this many seconds have passed since the last save
            (or since the schedule was made), agreed across ranks (None: no time rule). With
            neither rule every step saves.
        preemption: The signal watcher, or None when preemption is not handled.
        clock: Monotonic seconds (a test's stand-in; default ``time.monotonic``).
    """

    def __init__(self, save_every: int | None, save_interval_s: float | None, preemption: Preemption | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if save_interval_s is not None and (not isinstance(save_interval_s, (int, float))
                                            or isinstance(save_interval_s, bool) or not math.isfinite(save_interval_s)
                                            or save_interval_s <= 0):
            raise CheckpointError(f"save_interval_s must be a positive number of seconds or None, "
                                  f"got {save_interval_s!r}")
        self.save_every = save_every
        self.save_interval_s = None if save_interval_s is None else float(save_interval_s)
        self.preemption = preemption
        self._clock = clock
        self._last_save = clock()
        self._decided: tuple[int, Decision] | None = None
        self._preempted = False  # agreed once, it stays
        self._saved_at_preemption = False
        if preemption is not None and not preemption.install():  # last: a bad argument above leaves no handler
            self.preemption = None  # not the main thread: nothing to watch, no collective per step for it

    @property
    def agreed(self) -> bool:
        """Whether decisions take a collective (a time rule or preemption)."""
        return self.save_interval_s is not None or self.preemption is not None

    @property
    def preempted(self) -> bool:
        return self._preempted

    def on_schedule(self, step: int) -> bool:
        """The step rule alone (every step when there is neither a step nor a time rule)."""
        if self.save_every is not None:
            return step % self.save_every == 0
        return self.save_interval_s is None

    def decide(self, step: int, comm: Any) -> Decision:
        """This step's decision, the same on every rank of ``comm`` (a collective when ``agreed``;
        asked again for the same step, the first answer)."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        scheduled = self.on_schedule(step)
        if not self.agreed:
            return Decision(scheduled, False)
        due = self.save_interval_s is not None and self._clock() - self._last_save >= self.save_interval_s
        noticed = self._preempted or (self.preemption is not None and self.preemption.noticed)
        flags = comm.max_ints([int(noticed), int(due)])
        if flags[0] and not self._preempted:
            self._preempted = True
            if comm.rank == 0:
                log.warning("preemption (SIGTERM) noticed by the ranks at step %d: saving once more, then the loop "
                            "should stop (reached_preemption)", step)
        fresh = self._preempted and not self._saved_at_preemption
        decision = Decision(scheduled or bool(flags[1]) or fresh, self._preempted)
        self._decided = (step, decision)
        return decision

    def saved(self) -> None:
        """A save has started: the time rule counts from now; a preemption's save is done."""
        self._last_save = self._clock()
        if self._preempted:
            self._saved_at_preemption = True

    def close(self) -> None:
        if self.preemption is not None:
            self.preemption.uninstall()


__all__ = ["Decision", "Schedule"]
