"""The communicator surface: what a peer thread calls after :func:`burncoll.register`.

``communicator.py`` is :class:`~burncoll.Communicator`; ``rooted.py``, ``p2p.py`` and
``groups.py`` hold its rooted, point-to-point and sub-communicator operations, each a subclass
of ``core.py``'s :class:`~burncoll.comm.core.CommunicatorCore` (the peer's state, its op queue
and the checks every operation makes); ``objects.py`` the msgpack codec of the ``*_object``
collectives and ``object_scan.py`` its check of a received record's shape; ``buckets.py`` the
tree all-reduce; ``registry.py`` where a node's peers meet at ``register``; ``ranks.py`` the
rank arithmetic of a configuration.
"""
