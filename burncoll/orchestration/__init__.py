"""Bringing nodes together: the orchestrator and the processes that start them.

``orchestrator.py`` is the nodes' rendezvous (:class:`~burncoll.Orchestrator`, I/O) and
``waiting.py`` its waiting room (sessions and members, no I/O); ``hosting.py`` runs one inside
node 0's process under torchrun, SLURM or MPI; ``launch.py`` is ``burncoll launch`` (node
processes on one host or many, restarts), with ``launch_rounds.py`` (its rounds, failures and
stops) and ``launch_report.py`` (their output and the summary). Nothing here imports the local
or the node level: the orchestrator and the nodes share only what they say
(:mod:`burncoll.protocol`).
"""
