"""Adaptive spinning: how long a calling thread reads its caller sockets without blocking
before it sleeps in ``poll`` (:class:`Spinning`), and whether it yields its CPU between
looks at the shared mail before it sleeps (:class:`Yielding`).

A thread that sleeps is woken by the kernel when the other node's message comes in, and on a
virtual machine that wake-up is tens of microseconds: as much as the rest of a small
all-reduce (2 node processes, 8 bytes, a barrier before each: 298-321 us with 30-100 us of
spinning against 337-352 us without, docs/performance.md). Spinning pays only while the
messages come soon after this node's own went out, and while spinning takes no CPU that
another node of this host needs to send them. So a node spins only when

- its host has a CPU for every node process of the session on it (as far as it knows them:
  nodes announce their host when they share memory), and
- the waits it saw lately were short: a running average of them (every wait counts, spun or
  slept) under :data:`PAYS_BELOW`. A busy host makes waits long -- the other node is not
  running, or this one was not -- and spinning stops; it starts again once waits are short.
"""

from __future__ import annotations

import os

__all__ = ["LONGEST", "PAYS_BELOW", "SLOW_YIELD", "YIELDS", "Spinning", "Yielding",
           "usable_cpus"]

#: The longest a thread spins before it sleeps, in seconds.
LONGEST = 100e-6
#: Spinning stops while the average wait is this long or longer, in seconds.
PAYS_BELOW = 200e-6
#: Weight of the newest wait in the running average.
_WEIGHT = 0.125


#: How long a thread waiting for shared mail gives its CPU away between looks before it
#: sleeps between them, in seconds (the node processes it waits for may need the CPU).
YIELDS = 300e-6
#: A single yield that kept the thread off its CPU this long gave it to a process that is no
#: node of this operation (a node runs for ~0.1 ms before it posts): the host is busy.
SLOW_YIELD = 500e-6
#: Waits that sleep at once after a slow yield, before yielding is tried again.
SLEEPS_AFTER_SLOW_YIELD = 64


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class Spinning:
    """The spinning of one node's lanes; ``allowed`` says whether its host has the CPUs."""

    def __init__(self, allowed: bool = False) -> None:
        self.allowed = allowed
        self.average = 0.0

    def budget(self) -> float:
        """Seconds to spin before the next wait sleeps (0: sleep at once)."""
        return LONGEST if self.allowed and self.average < PAYS_BELOW else 0.0

    def waited(self, seconds: float) -> None:
        """An exchange waited ``seconds`` for the other nodes' messages."""
        self.average += (seconds - self.average) * _WEIGHT


class Yielding:
    """Whether a thread waiting for shared mail yields its CPU between looks: it does for
    :data:`YIELDS`, unless a yield lately took :data:`SLOW_YIELD` or longer (on a busy host
    a yield hands the CPU to another process for its whole time slice, where a sleep is
    woken on time); then it sleeps at once for the next :data:`SLEEPS_AFTER_SLOW_YIELD`
    waits."""

    def __init__(self) -> None:
        self.sleeping = 0

    def budget(self) -> float:
        """Seconds to yield in the next wait before sleeping (0: sleep at once)."""
        if self.sleeping:
            self.sleeping -= 1
            return 0.0
        return YIELDS

    def yielded(self, seconds: float) -> bool:
        """A yield kept the thread off its CPU ``seconds``; whether to go on yielding."""
        if seconds < SLOW_YIELD:
            return True
        self.sleeping = SLEEPS_AFTER_SLOW_YIELD
        return False
