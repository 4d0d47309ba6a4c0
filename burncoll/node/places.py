"""Where a part goes when its transport lends it (the shared-memory ring): a borrowed frame is
*settled* as the mailbox stores it -- after every check of its header and of its place in the
schedule, before the connection's next ``recv`` -- by combining it straight into the place its
walk offered (a part it reduces: no copy out of the ring), or by copying it out. (A memory
place offered for a part the walk copies never gets here: the transport's placer has taken
it, and copied the part there, before it lends anything.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from burncoll.levels import HostArray
from burncoll.ops import ReduceOp
from burncoll.protocol.wire import Frame
from burncoll.reduction import reduce_into

__all__ = ["Place", "ReducePlace", "settled"]


@dataclass(frozen=True, slots=True, eq=False)
class ReducePlace:
    """A part a walk reduces: ``target = source op part`` (views of the part's elements,
    ``nbytes`` of them), straight out of the memory a transport lent."""

    op: ReduceOp
    source: HostArray
    target: HostArray
    nbytes: int

    def combine(self, payload: memoryview) -> memoryview:
        """Reduce ``payload`` into the target; the target's bytes."""
        reduce_into(self.op, (self.source, np.frombuffer(payload, self.target.dtype)),
                    self.target)
        return memoryview(self.target.view(np.uint8)).cast("B")  # type: ignore[arg-type]


#: What a receiver offers for a part not yet arrived: memory the transport may write the
#: payload into, or a reduction (used only for a borrowed payload).
Place = memoryview | ReducePlace


def settled(frame: Frame, place: Place | None) -> Frame:
    """``frame`` (borrowed, checked) with a payload of its own: combined into ``place`` when
    that is the part's reduction (``placed``), else copied out."""
    payload = frame.payload
    if isinstance(place, ReducePlace) and place.nbytes == len(payload):
        return Frame(frame.frame_type, frame.header, place.combine(payload), None, True)
    return frame.owned()
