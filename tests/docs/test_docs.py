"""The documentation site says what the code does, and every command in it works.

(a) Every fenced block marked ``<!-- runnable -->`` in docs/*.md and README.md runs: a
``python`` block as a script in a fresh process (the venv's Python, from the repository root),
or through ``burncoll launch`` when the marker says ``launch="--nodes 2 ..."``; each
``burncoll ...`` / ``python ...`` line of a ``bash`` block in ``bash`` with the venv's ``bin``
first on ``PATH``. ``needs=jax`` (or ``cupy``) skips a block where that backend is not usable.
Every ``python`` and ``bash`` block of docs/*.md carries a marker: runnable, or
``<!-- not runnable: why -->``.
(b) The commands in the docstrings of examples/ddp_numpy.py, ddp_jax.py and ddp_jax_jit.py run, with
few steps (examples/train_anywhere.py: tests/launchers/test_example_commands.py;
examples/ray_train.py: tests/test_ray.py; ``python examples/ddp_jax.py``:
tests/train/test_examples.py); every example's documented flags exist in its argparse.
(c) The API page documents every name of ``burncoll.__all__``.
(d) The configuration page's table lists every ``CollectiveConfig`` field with its type,
default and variable.
(e) ``mkdocs build --strict`` succeeds (no broken link, no missing reference), and the built
API page has an entry for every public name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import burncoll
from burncoll.strategies import Strategy

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), REPO / "README.md"]
BIN = Path(sys.executable).parent
TIMEOUT = 120
MARK = re.compile(r"^<!--\s*(runnable|not runnable)\b(.*?)-->\s*$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
COMMANDS = ("burncoll", "python", "python3")
#: Variables of launchers and of the test session that a user's fresh shell does not have.
DROPPED = ("BURNCOLL_", "SLURM_", "OMPI_", "PMI_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
           "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "XLA_FLAGS",
           "JAX_PLATFORMS", "PYTEST_")


@dataclass(frozen=True)
class Block:
    """A fenced block of a page, with the marker on the line before it."""

    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    marker: str  # "runnable", "not runnable" or "" (none)
    options: dict[str, str]

    @property
    def name(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    """Every fenced block of ``page``, with its marker and the marker's ``key=value`` options."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i].strip())
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence.group(1))), len(lines))
        mark = MARK.match(lines[i - 1].strip()) if i > 0 else None
        options: dict[str, str] = {}
        if mark is not None and mark.group(1) == "runnable":
            options = dict(item.partition("=")[::2] for item in shlex.split(mark.group(2)))
        yield Block(page, i + 1, fence.group(2), "\n".join(lines[i + 1:end]),
                    mark.group(1) if mark else "", options)
        i = end + 1


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL_BLOCKS if b.marker == "runnable"]


def user_env(home: Path) -> dict[str, str]:
    """A user's shell: no launcher's or session's variables, this venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED)}
    env.update(PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]), HOME=str(home),
               PYTHONUNBUFFERED="1", NO_MKDOCS_2_WARNING="1")
    return env


def check_ran(what: str, done: subprocess.CompletedProcess[str]) -> None:
    output = f"{what}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == 0, output
    # an assertion failing in a peer thread prints a traceback; the script may still exit 0
    assert "Traceback" not in done.stdout + done.stderr, output


def usable(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    if name == "cupy":
        from burncoll.backends import installed_backends

        return "cupy" in installed_backends()
    return True


def bash_lines(code: str) -> list[str]:
    """The block's lines, with ``\\`` continuations joined."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


# -- (a) the marked blocks --------------------------------------------------------------------
def test_every_python_and_bash_block_of_the_site_is_marked() -> None:
    unmarked = [b.name for b in ALL_BLOCKS
                if b.page.parent == DOCS and b.lang in ("python", "bash") and not b.marker]
    assert not unmarked, ("blocks without <!-- runnable --> or <!-- not runnable: why --> "
                          f"before them: {unmarked}")


def test_the_marked_blocks_are_well_formed() -> None:
    bad = [b.name for b in RUNNABLE if b.lang not in ("python", "bash")
           or set(b.options) - {"needs", "launch"}
           or ("launch" in b.options and b.lang != "python")]
    bad += [f"{b.name}: {line}" for b in RUNNABLE if b.lang == "bash"
            for line in bash_lines(b.code)
            if line.split()[0] not in (*COMMANDS, "export")]
    assert not bad, f"runnable blocks the test cannot run: {bad}"
    assert len(RUNNABLE) >= 10


def test_no_launch_command_puts_python_before_the_script() -> None:
    """``burncoll launch`` runs the script with its own Python: ``... -- python x.py`` (or
    ``... python x.py``) makes every node run a file called ``python``."""
    bad = []
    for b in (b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "console")):
        for line in bash_lines(b.code):
            if line.startswith("burncoll launch") and "--help" not in line:
                argv = shlex.split(line.split(" #")[0])
                script = next((a for a in argv if a.endswith(".py")), "")
                before = argv[:argv.index(script)] if script else argv
                if not script or "--" in before or any("python" in a for a in before):
                    bad.append(f"{b.name}: {line}")
    assert not bad, bad


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_each_runnable_block_runs(block: Block, tmp_path: Path) -> None:
    for need in filter(None, block.options.get("needs", "").split(",")):
        if not usable(need):
            pytest.skip(f"{block.name} needs the {need} backend, not usable here")
    env = user_env(tmp_path)
    if block.lang == "bash":
        exports = [line for line in bash_lines(block.code) if line.startswith("export ")]
        for line in bash_lines(block.code):
            if line.startswith("export "):
                continue
            script = "set -euo pipefail\n" + "\n".join([*exports, line])
            done = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, text=True,
                                  capture_output=True, timeout=TIMEOUT, check=False)
            check_ran(f"{block.name}: {line}", done)
        return
    script = tmp_path / f"{block.page.stem}_{block.line}.py"
    script.write_text(block.code + "\n")
    argv = [sys.executable, str(script)]
    if "launch" in block.options:
        argv = [str(BIN / "burncoll"), "launch", *shlex.split(block.options["launch"]),
                str(script)]
    done = subprocess.run(argv, cwd=REPO, env=env, text=True, capture_output=True,
                          timeout=TIMEOUT, check=False)
    check_ran(block.name, done)


# -- (b) the examples' documented commands ----------------------------------------------------
#: Few steps, where the example's argparse has the flags.
FEW_STEPS = {"ddp_numpy.py": ["--steps", "20", "--no-progress"],
             "ddp_jax.py": ["--steps", "5", "--no-progress"],
             "ddp_jax_jit.py": ["--steps", "5", "--no-progress"],
             "torch_ddp.py": ["--steps", "5"]}


def documented(example: str) -> list[str]:
    """The commands in the example's module docstring."""
    doc = (REPO / "examples" / example).read_text().split('"""')[1]
    return [line.strip() for line in doc.splitlines()
            if line.strip().startswith(("python examples/", "burncoll launch"))]


EXAMPLE_COMMANDS = [(name, c) for name in FEW_STEPS for c in documented(name)]


@pytest.mark.slow
@pytest.mark.parametrize(("example", "command"), EXAMPLE_COMMANDS,
                         ids=[c for _, c in EXAMPLE_COMMANDS])
def test_each_examples_documented_command_runs(example: str, command: str,
                                               tmp_path: Path) -> None:
    if example.startswith("ddp_jax") and importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    if example == "ddp_jax_jit.py" and importlib.util.find_spec("optax") is None:
        pytest.skip("optax is not installed")
    if example == "torch_ddp.py" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    if command == "python examples/ddp_jax.py":  # 15 s of XLA compilation: run once, there
        pytest.skip("tests/train/test_examples.py::test_jax_example runs this command")
    argv = shlex.split(command)
    assert argv[0] in ("python", "burncoll") and argv[-1] == f"examples/{example}", command
    argv[0] = sys.executable if argv[0] == "python" else str(BIN / "burncoll")
    done = subprocess.run([*argv, *FEW_STEPS[example]], cwd=REPO, env=user_env(tmp_path),
                          text=True, capture_output=True, timeout=TIMEOUT, check=False)
    check_ran(command, done)
    assert "replicas identical: yes" in done.stdout, done.stdout


def test_every_example_documents_its_commands_and_their_flags_exist() -> None:
    for example in ("ddp_numpy.py", "ddp_jax.py", "ddp_jax_jit.py", "ray_train.py"):
        commands = documented(example)
        assert any(c.startswith("python ") for c in commands), example
        source = (REPO / "examples" / example).read_text()
        for command in commands:
            argv = shlex.split(command)
            # `burncoll launch` runs the script with its own Python: no `python`, no `--`
            assert "--" not in argv and "python" not in argv[1:], command
            script = next(a for a in argv if a.startswith("examples/"))
            flags = argv[argv.index(script) + 1:]
            for flag in (f for f in flags if f.startswith("--")):
                assert f'"{flag}"' in source, f"{example}: {command}: no {flag} in argparse"


# -- (c) the API page -------------------------------------------------------------------------
def api_members() -> list[str]:
    """The names listed under ``::: burncoll`` on the API page."""
    text = (DOCS / "api.md").read_text()
    block = text.split("::: burncoll\n", 1)[1].split("\n\n", 1)[0]
    names = []
    for line in block.split("      members:\n", 1)[1].splitlines():
        if not line.startswith("        - "):
            break
        names.append(line.split("- ", 1)[1].strip())
    return names


def test_the_api_page_lists_every_public_name() -> None:
    members = api_members()
    assert sorted(members) == sorted(burncoll.__all__), (
        f"missing: {sorted(set(burncoll.__all__) - set(members))}; "
        f"not public: {sorted(set(members) - set(burncoll.__all__))}")


# -- (d) the configuration page ---------------------------------------------------------------
def _shown(value: object) -> str:
    if isinstance(value, Strategy):
        return value.spec
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def config_rows() -> dict[str, list[str]]:
    """Field -> the cells the page's table must have: type, default, environment variable."""
    rows = {}
    for f in dataclasses.fields(burncoll.CollectiveConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows[f.name] = [f"`{f.type}`", f"`{_shown(default)}`", f"`BURNCOLL_{f.name.upper()}`"]
    return rows


def test_the_configuration_page_lists_every_field() -> None:
    after = (DOCS / "configuration.md").read_text().split("<!-- fields -->")[1]
    table = after.strip().split("\n\n")[0]  # the table right after the marker
    page = {}
    for line in table.splitlines():
        cells = [c.strip() for c in re.findall(r"(?:`[^`]*`|[^|`])+", line.strip().strip("|"))]
        if cells and cells[0].startswith("`"):
            page[cells[0].strip("`")] = cells[1:4]
    want = config_rows()
    fix = "\n".join(f"| `{k}` | {' | '.join(v)} | ... |" for k, v in want.items()
                    if page.get(k) != v)
    assert page == want, f"update the table in docs/configuration.md:\n{fix}"


# -- (e) the build ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or (
                importlib.util.find_spec(module) is None):
            pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
                          cwd=REPO, env=user_env(out), text=True, capture_output=True,
                          timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return out


def test_mkdocs_build_strict_passes_and_documents_every_public_name(site: Path) -> None:
    html = (site / "api" / "index.html").read_text()
    missing = [n for n in burncoll.__all__ if f'id="burncoll.{n}"' not in html]
    assert not missing, f"no entry on the built API page for {missing}"
    assert "Rendezvous" not in html, "an internal constructor shows on the API page"
    assert "stylesheets/extra.css" in html  # long code lines wrap (see test_api_reference)
    changelog = (site / "changelog" / "index.html").read_text()
    assert "Unreleased" in changelog and "0.1.0" in changelog
