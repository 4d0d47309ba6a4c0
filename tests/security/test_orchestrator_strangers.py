"""The orchestrator without a token (the default, loopback) against strangers on the machine.

A stranger that reaches the orchestrator first must not lock the real nodes out: it used to
register with ``num_nodes=99`` and have every legitimate node refused as "config differs".
Registrations now wait in groups of one fingerprint; a session forms when a group is full; each
session gets its own secret, sent to its members only; and the waiting state is bounded. Real
orchestrator, real transports and node processes on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import burncoll
from burncoll.node.orchestrator_client import OrchestratorClient
from burncoll.orchestration import waiting as waiting_room
from burncoll.orchestration.launch import node_environment
from burncoll.protocol.control import Join
from burncoll.protocol.wire import decode, encode_control
from burncoll.transport import get_transport
from burncoll.transport.auth import authenticate_client
from burncoll.transport.base import Connection
from tests import forked

NODE = Path(__file__).resolve().parents[1] / "cli" / "allreduce_node.py"
REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
TOKEN = "strangers test token, long enough"


def fingerprint(num_nodes: int, **changes: Any) -> dict[str, Any]:
    return {"num_nodes": num_nodes, "transport": "websocket", **changes}


def join(peer: int, num_nodes: int = 2, **changes: Any) -> dict[str, Any]:
    return {"type": "join", "host": HOST, "port": 40000 + peer, "peer_ids": [peer],
            "fingerprint": fingerprint(num_nodes, **changes)}


async def register(port: int, message: dict[str, Any], seconds: float = 5.0,
                   token: str | None = None) -> OrchestratorClient:
    """A node's real client joining with ``message``; raises what ``join`` raises."""
    client = OrchestratorClient(get_transport("websocket"), HOST, port, token, seconds)
    try:
        await client.join(Join.from_json(message), time.monotonic() + seconds)
    except BaseException:
        await client.close()
        raise
    return client


#: What ``burncoll launch`` tells each node (nothing else of this process's BURNCOLL_* leaks).
LAUNCH_SETTINGS = {f"BURNCOLL_{k}" for k in ("NODE_RANK", "NUM_NODES", "NUM_DEVICES",
                   "GLOBAL_ADDRESS", "NODE_ADDRESS", "DATA_SERVICE_PORT", "TRANSPORT")}


def node_env(rank: int, nodes: int, address: str) -> dict[str, str]:
    """A node's environment as ``burncoll launch`` makes it, without a token and without
    any BURNCOLL_* variable of this process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    settings = node_environment(rank, nodes, 1, address, "websocket")
    env.update({k: v for k, v in settings.items() if k in LAUNCH_SETTINGS})
    env.update(PYTHONPATH=str(REPO), TEST_TIMEOUT="30")
    return env


class Stranger:
    """A raw connection holding a registration open in a thread of its own, until closed."""

    def __init__(self, port: int, message: dict[str, Any]) -> None:
        self.received: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._run(port, message),), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the stranger could not register"

    async def _run(self, port: int, message: dict[str, Any]) -> None:
        self._stop = asyncio.Event()
        conn: Connection = await get_transport("websocket").connect(HOST, port)
        conn = await authenticate_client(conn, None, 5.0)
        await conn.send([encode_control(message)])
        reader = asyncio.ensure_future(self._read(conn))
        await asyncio.sleep(0.2)  # the orchestrator has taken the join
        self._ready.set()
        await self._stop.wait()
        reader.cancel()
        await conn.close()

    async def _read(self, conn: Connection) -> None:
        while True:
            message = decode(await conn.recv()).control
            if message is not None:
                self.received.append(message)

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture
def open_orchestrator() -> Iterator[burncoll.Orchestrator]:
    """The default orchestrator: no token, loopback."""
    with burncoll.start_orchestrator() as orch:
        yield orch


def test_a_stranger_first_with_99_nodes_does_not_stop_a_real_collective(
    open_orchestrator: burncoll.Orchestrator,
) -> None:
    stranger = Stranger(open_orchestrator.port, join(0, num_nodes=99))
    try:
        procs = [forked.start(NODE, stdout=forked.PIPE, stderr=forked.PIPE,
                              env=node_env(rank, 2, open_orchestrator.address))
                 for rank in range(2)]
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        stranger.close()
    found = [json.loads(line) for out, _ in outputs for line in out.splitlines()
             if line.startswith("{")]
    assert sorted(r["peer"] for r in found) == [0, 1], outputs
    assert all(r["ok"] for r in found), found  # an exact all-reduce on every peer
    assert all(m["type"] == "notice" for m in stranger.received), stranger.received


def test_each_session_gets_its_own_secret_sent_to_its_members(
    open_orchestrator: burncoll.Orchestrator,
) -> None:
    async def scenario() -> list[list[OrchestratorClient]]:
        sessions = []
        for _ in range(2):
            pair = await asyncio.gather(register(open_orchestrator.port, join(0)),
                                        register(open_orchestrator.port, join(1)))
            sessions.append(list(pair))
        for clients in sessions:
            for client in clients:
                await client.close()
        return sessions

    sessions = asyncio.run(scenario())
    secrets_ = [{c.secret for c in clients} for clients in sessions]
    assert all(len(s) == 1 for s in secrets_), secrets_  # one per session, for every member
    first, second = (s.pop() for s in secrets_)
    assert first is not None and second is not None and first != second
    assert len(bytes.fromhex(first)) == 32 and len(bytes.fromhex(second)) == 32
    assert sessions[0][0].session != sessions[1][0].session


def test_a_differing_node_waits_apart_and_its_timeout_names_the_difference(
    open_orchestrator: burncoll.Orchestrator,
) -> None:
    """Without a token a difference is no refusal: the node waits in its own group; the two
    sides are told what differs, and a timeout says so (what a misconfigured user needs)."""
    async def scenario() -> str:
        port = open_orchestrator.port
        odd = asyncio.ensure_future(register(port, join(5, transport="quic"), seconds=2.0))
        await asyncio.sleep(0.3)
        clients = await asyncio.gather(register(port, join(0)), register(port, join(1)))
        for client in clients:
            await client.close()
        with pytest.raises(burncoll.CollectiveTimeout) as info:
            await odd
        return str(info.value)

    message = asyncio.run(scenario())
    assert "transport: 'quic' here, 'websocket'" in message, message


def test_with_a_token_a_differing_node_is_refused_at_once_and_so_are_those_waiting() -> None:
    """With a token every registration is the job's: the differing newcomer is refused, and
    the node waiting for it learns at once why its collective cannot form (it would wait for
    that node in vain), long before its own 30 s timeout; a new pair then forms a session."""
    with burncoll.start_orchestrator(auth_token=TOKEN) as orch:
        async def scenario() -> tuple[str, str]:
            first = asyncio.ensure_future(
                register(orch.port, join(0), seconds=30.0, token=TOKEN))
            await asyncio.sleep(0.3)
            with pytest.raises(burncoll.ConfigError) as info:
                await register(orch.port, join(1, global_reduce_strategy="ring"), token=TOKEN)
            with pytest.raises(burncoll.ConfigError) as waiting:
                await asyncio.wait_for(first, 15.0)  # half its own timeout
            clients = await asyncio.gather(register(orch.port, join(0), token=TOKEN),
                                           register(orch.port, join(1), token=TOKEN))
            for client in clients:
                await client.close()
            return str(info.value), str(waiting.value)

        message, waited = asyncio.run(scenario())
    assert "differs" in message and "global_reduce_strategy: 'ring' here" in message, message
    assert f"{HOST}:40001" in waited and "peer ids [1]" in waited, waited
    assert "global_reduce_strategy: None here, 'ring' on that node" in waited, waited


def test_expected_nodes_refuses_other_counts_at_once() -> None:
    with burncoll.start_orchestrator(expected_nodes=2) as orch:
        async def scenario() -> str:
            with pytest.raises(burncoll.ConfigError) as info:
                await register(orch.port, join(0, num_nodes=99))
            clients = await asyncio.gather(register(orch.port, join(0)),
                                           register(orch.port, join(1)))
            for client in clients:
                await client.close()
            return str(info.value)

        message = asyncio.run(scenario())
    assert "--nodes 2" in message and "num_nodes=99" in message, message


def test_waiting_registrations_are_capped_and_freed_when_they_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(waiting_room, "MAX_WAITING", 3)  # a small cap, to reach it
    with burncoll.start_orchestrator() as orch:
        # three groups of one (each its own fingerprint), none of which can fill up
        strangers = [Stranger(orch.port, join(10 + k, num_nodes=3, tag=k)) for k in range(3)]
        try:
            async def refused() -> str:
                with pytest.raises(burncoll.ConfigError) as info:
                    await register(orch.port, join(0))
                return str(info.value)

            assert "nodes waiting (its limit)" in asyncio.run(refused())
        finally:
            for stranger in strangers:
                stranger.close()

        async def after() -> list[int]:
            await asyncio.sleep(0.3)  # the orchestrator notices the closed connections
            clients = await asyncio.gather(register(orch.port, join(0)),
                                           register(orch.port, join(1)))
            for client in clients:
                await client.close()
            return [c.index for c in clients]

        assert asyncio.run(after()) == [0, 1]


def test_duplicate_peer_ids_within_a_group_are_refused(
    open_orchestrator: burncoll.Orchestrator,
) -> None:
    """Without a token the newcomer may be a stranger: it is refused, and the node already
    waiting is told at once and says so when its registration times out."""
    async def scenario() -> tuple[str, str]:
        first = asyncio.ensure_future(
            register(open_orchestrator.port, join(0, num_nodes=3), seconds=2.0))
        await asyncio.sleep(0.3)
        with pytest.raises(burncoll.ConfigError) as info:
            await register(open_orchestrator.port, join(0, num_nodes=3))
        with pytest.raises(burncoll.CollectiveTimeout) as waited:
            await first
        return str(info.value), str(waited.value)

    refused, timed_out = asyncio.run(scenario())
    assert "peer ids must be unique" in refused
    assert "also claimed by the node at" in timed_out and "[0]" in timed_out, timed_out


def test_with_a_token_both_nodes_claiming_a_peer_id_are_refused_at_once() -> None:
    """With a token every registration is the job's own: both nodes are misconfigured, and
    both learn why at once (neither waits out its timeout)."""
    with burncoll.start_orchestrator(auth_token=TOKEN) as orch:
        async def scenario() -> tuple[str, str]:
            first = asyncio.ensure_future(
                register(orch.port, join(0, num_nodes=3), seconds=30.0, token=TOKEN))
            await asyncio.sleep(0.3)
            with pytest.raises(burncoll.ConfigError) as info:
                await register(orch.port, join(0, num_nodes=3), token=TOKEN)
            with pytest.raises(burncoll.ConfigError) as holder:
                await asyncio.wait_for(first, 10.0)  # long before its own 30 s
            return str(info.value), str(holder.value)

        refused, holder = asyncio.run(scenario())
    assert "already used by the node at" in refused
    assert "also claimed by the node at" in holder and "burncoll.peer_ids()" in holder
