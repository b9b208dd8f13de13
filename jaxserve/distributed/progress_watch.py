"""Tells an engine whose step is long from one that is stuck (the Ray replicas' health
check, `ray_actor.ReplicaActor.health`).

Wall time alone cannot: a step may take longer than `step_timeout_s` and be fine (a
long prefill, or a first compile with warmup=False). So an engine counts as stuck only
when, for `step_timeout_s`, neither of these showed progress:
  - its loop came round (took commands: once a step, or every idle wait);
  - its process used CPU at a working rate, at least `MIN_CPU_FRACTION` of one core
    on average over the last `window_s` seconds (the caller's step timeout). A compile
    runs on the engine's thread and a step on the CPU backend on XLA's threads, each
    using a core or more; a loop blocked for good (a lock never released, a collective
    whose peer is gone, a wedged device) uses next to none: an idle Ray actor process
    uses about 1% of a core. The average is over the whole window, not between two
    checks, so a short burst of another thread's work (the KV offload, Ray's own
    threads, a garbage collection) does not pass for progress; the cost is that a
    stall right after a long compile is seen up to one window late.
A process that stops altogether (SIGSTOP, a lost machine) answers no check at all; the
caller's own timeout covers that.

What it cannot tell: a device that computes one step for longer than `step_timeout_s`
while the host waits without using CPU looks stuck (the host sees no device progress);
an engine spinning forever in a loop looks busy; and a process starved of CPU below
`MIN_CPU_FRACTION` for the whole timeout looks stuck.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

MIN_CPU_FRACTION = 0.1  # of one core, averaged over the window: the process is computing


def cpu_seconds() -> float:
    """CPU time this process has used, all its threads."""
    return time.process_time()


class ProgressWatch:
    def __init__(
        self,
        *,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] | None = None,
        min_cpu_fraction: float = MIN_CPU_FRACTION,
    ):
        self.window_s = window_s
        self._clock = clock
        self._cpu_clock = cpu_clock or (lambda: cpu_seconds())
        self.min_cpu_fraction = min_cpu_fraction
        now = clock()
        self._samples = collections.deque([(now, self._cpu_clock())])  # (time, cpu)
        self._round: float | None = None
        self.progress_at = now  # when progress was last seen

    def stalled_for(self, last_round: float) -> float:
        """Seconds since the engine last showed progress (0 when it shows some now).
        Call it at each check with the engine loop's `last_round`."""
        now, cpu = self._clock(), self._cpu_clock()
        samples = self._samples
        samples.append((now, cpu))
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()  # (the oldest kept is at or before the window's start)
        then, then_cpu = samples[0]
        came_round = last_round != self._round
        self._round = last_round
        computing = now > then and cpu - then_cpu >= self.min_cpu_fraction * (now - then)
        if came_round or computing:
            self.progress_at = now
        return now - self.progress_at
