"""The table of mistakes in docs/failures.md is what users get: each row's mistake is made here,
for real, and the message it draws must read as the row says (``…`` stands for a part that
varies, such as a port). The rows are read from the page, so the two cannot drift."""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import burncoll
from burncoll import CollectiveConfig
from burncoll.train.checkpoint_file import read_checkpoint, write_checkpoint

REPO = Path(__file__).resolve().parents[2]
TOKEN = "the orchestrator's token, 32 b."

#: A row: ``| mistake | `message` |``.
ROW = re.compile(r"^\| (?P<mistake>.+?) \| `(?P<message>[^`]+)` \|$")


def table() -> dict[str, str]:
    """Mistake -> message, the rows of the table after ``<!-- mistakes -->``."""
    after = (REPO / "docs" / "failures.md").read_text().split("<!-- mistakes -->\n", 1)[1]
    rows = after.split("\n\n", 1)[0].splitlines()[2:]  # below the header and its rule
    found = {}
    for line in rows:
        match = ROW.match(line)
        assert match is not None, f"not a row of the mistakes table: {line}"
        found[match["mistake"]] = match["message"]
    return found


def _raised(fn: Callable[[], object]) -> str:
    """``"ErrorType: message"`` of what ``fn`` raises (or of its first warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    if caught:
        return f"{caught[0].category.__name__}: {caught[0].message}"
    return "nothing"


def _one_peer(call: Callable[[burncoll.Communicator], object]) -> str:
    comm = burncoll.register(0, 0, CollectiveConfig(num_devices=1, timeout=10))
    try:
        return _raised(lambda: call(comm))
    finally:
        comm.finish()


def _jax_array() -> object:
    return pytest.importorskip("jax.numpy").ones(2)


def _register_at(token: str | None) -> str:
    """A node with ``token`` registering at an orchestrator that has :data:`TOKEN`."""
    with burncoll.start_orchestrator(auth_token=TOKEN) as orch:
        config = CollectiveConfig(num_nodes=2, global_address=orch.address,
                                  node_address="127.0.0.1", auth_token=token, timeout=10)
        return _raised(lambda: burncoll.register(0, 0, config))


def _yaml_typo(path: Path) -> str:
    path.write_text("backend: numpy\ntimout: 5\n")
    return _raised(lambda: CollectiveConfig.from_yaml(path))


def _two_peers_with_shapes() -> str:
    config = CollectiveConfig(num_devices=2, timeout=10)
    out: dict[int, str] = {}

    def peer(i: int) -> None:
        comm = burncoll.register(i, i, config)
        out[i] = _raised(lambda: comm.all_reduce(np.ones(4 + i, dtype=np.float32)))

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * config.timeout)
    return out[0]


def _open_checkpoint(directory: Path, mode: int) -> str:
    """Resume from an honest checkpoint in ``directory`` after ``chmod mode directory``."""
    write_checkpoint(directory, 1, [np.ones(2)], None, [0.5])
    directory.chmod(mode)
    return _raised(lambda: read_checkpoint(directory))


def _setting(variable: str, value: str) -> Callable[[pytest.MonkeyPatch, Path], str]:
    def make(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
        monkeypatch.setenv(variable, value)
        return _raised(CollectiveConfig)
    return make


Mistake = Callable[[pytest.MonkeyPatch, Path], str]

#: The table's mistakes, made for real (each returns the message it draws).
MISTAKES: dict[str, Mistake] = {
    "a misspelt variable: `BURNCOLL_TIMEOT=5`": _setting("BURNCOLL_TIMEOT", "5"),
    "a misspelt key in a YAML file: `timout: 5`": lambda m, tmp: _yaml_typo(tmp / "mine.yaml"),
    "a misspelt keyword: `CollectiveConfig(timeot=5)`":
        lambda m, t: _raised(lambda: CollectiveConfig(timeot=5)),  # type: ignore[call-arg]
    "a yes/no variable set to another word: `BURNCOLL_SHARED_MEMORY=maybe`":
        _setting("BURNCOLL_SHARED_MEMORY", "maybe"),
    "a backend that does not exist: `backend=\"tensorflow\"`":
        lambda m, t: _raised(lambda: CollectiveConfig(backend="tensorflow")),
    "a transport that does not exist: `transport=\"udp\"`":
        lambda m, t: _raised(lambda: CollectiveConfig(transport="udp")),
    "no timeout: `timeout=0` (or `inf`)": lambda m, t: _raised(lambda: CollectiveConfig(timeout=0)),
    "several nodes but no orchestrator address: `num_nodes=2`":
        lambda m, t: _raised(lambda: CollectiveConfig(num_nodes=2)),
    "a reachable node address without a token: `node_address=\"10.1.2.4\"`":
        lambda m, t: _raised(lambda: CollectiveConfig(num_nodes=2, global_address="10.1.2.3:29400",
                                                      node_address="10.1.2.4")),
    "launcher variables that disagree: `RANK=3 WORLD_SIZE=2`":
        lambda m, t: (m.setenv("RANK", "3"), m.setenv("WORLD_SIZE", "2"),
                      _raised(CollectiveConfig))[-1],
    "a JAX array given to a NumPy communicator":
        lambda m, t: _one_peer(lambda c: c.all_reduce(_jax_array())),
    "a list instead of an array": lambda m, t: _one_peer(lambda c: c.all_reduce([1.0, 2.0])),
    "an unknown reduce op: `op=\"median\"`":
        lambda m, t: _one_peer(lambda c: c.all_reduce(np.ones(2), op="median")),
    "a root that is no peer: `reduce(x, root=5)`":
        lambda m, t: _one_peer(lambda c: c.reduce(np.ones(2), root=5)),
    "peers that pass different shapes": lambda m, t: _two_peers_with_shapes(),
    "a local peer that never registers (`num_devices=2`, one thread)":
        lambda m, t: _raised(lambda: burncoll.register(
            0, 0, CollectiveConfig(num_devices=2, timeout=0.5))),
    "a node without the token the orchestrator has": lambda m, t: _register_at(None),
    "a node with another token than the orchestrator's":
        lambda m, t: _register_at("another token, also 32 bytes.."),
    "a short token: `auth_token=\"abc\"` (or `BURNCOLL_AUTH_TOKEN=abc`, which the message then "
    "names)": lambda m, t: _raised(lambda: CollectiveConfig(auth_token="abc")),
    "a checkpoint directory other users may write (`chmod 777 ckpt`)":
        lambda m, t: _open_checkpoint(t / "ckpt", 0o777),
}


def reads_as(message: str, row: str) -> bool:
    """Whether ``message`` is ``row`` with each ``…`` standing for some text (``row`` ending
    in ``…``: its leading part)."""
    pattern = ".*?".join(re.escape(part) for part in row.split("…"))
    return re.fullmatch(pattern, message, re.S) is not None


def test_the_table_and_the_cases_name_the_same_mistakes() -> None:
    assert list(table()) == list(MISTAKES)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_draws_the_message_the_table_shows(
        mistake: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("RANK", "WORLD_SIZE", "BURNCOLL_TIMEOT", "BURNCOLL_SHARED_MEMORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("burncoll.config.names._warned", set())  # "once per process": again
    message = MISTAKES[mistake](monkeypatch, tmp_path)
    row = table()[mistake]
    assert reads_as(message, row), f"the table says\n  {row}\nbut the message is\n  {message}"
