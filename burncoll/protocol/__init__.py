"""What travels between processes, and the checks on it: pure code, no I/O, no clock.

:mod:`.wire` is the frame codec (a fixed binary header, then raw bytes); :mod:`.control` the
control messages of a node and the orchestrator, :mod:`.members` those between two members of
a session, both read through :mod:`.fields`, which checks every field; :mod:`.checks` what a
received DATA header must say before a byte of its part is used; :mod:`.exchange` the
one-round exchange (its messages, their checks, the reduction in node order). The node level
(:mod:`burncoll.node`), the orchestrator (:mod:`burncoll.orchestration.orchestrator`) and the
transports (:mod:`burncoll.transport`) all build on it.
"""
