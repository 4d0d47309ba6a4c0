"""Misspelt names: keyword arguments, YAML keys and ``BURNCOLL_*`` variables get a "did you
mean"; a variable nothing reads warns instead of being ignored without a word."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from burncoll import CollectiveConfig, ConfigError
from burncoll.config.names import OTHER_VARIABLES, warn_unknown_variables
from burncoll.orchestration.launch import node_environment

REPO = Path(__file__).resolve().parents[2]
FIELDS = tuple(CollectiveConfig.__dataclass_fields__)


def _warnings_of(build: type[CollectiveConfig]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught]


def test_a_misspelt_variable_warns_once_naming_the_right_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURNCOLL_TIMEOT", "5")
    first = _warnings_of(CollectiveConfig)
    assert first == ["environment variable 'BURNCOLL_TIMEOT' is not a burncoll setting and is "
                     "ignored (did you mean 'BURNCOLL_TIMEOUT'?)"]
    assert _warnings_of(CollectiveConfig) == []  # once per process
    assert CollectiveConfig().timeout == 60.0


def test_the_warning_points_at_the_line_that_made_the_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURNCOLL_TIMEOT", "5")
    monkeypatch.setattr("burncoll.config.names._warned", set())  # "once per process": again
    with pytest.warns(UserWarning, match="BURNCOLL_TIMEOT") as caught:
        CollectiveConfig()
    assert [w.filename for w in caught] == [__file__]


def test_a_variable_unlike_any_setting_warns_without_a_guess() -> None:
    with pytest.warns(UserWarning, match="'BURNCOLL_ZZZ' is not a burncoll setting") as caught:
        assert warn_unknown_variables(FIELDS, {"BURNCOLL_ZZZ": "1", "HOME": "/"}) == [
            "BURNCOLL_ZZZ"]
    assert "did you mean" not in str(caught[0].message)


def test_a_huge_variable_name_is_elided_in_its_warning() -> None:
    name = "BURNCOLL_" + "X" * 1_000_000
    with pytest.warns(UserWarning, match="is not a burncoll setting") as caught:
        assert warn_unknown_variables(FIELDS, {name: "1"}) == [name]
    message = str(caught[0].message)
    assert len(message) < 300 and "(1000011 characters)" in message, message


def test_the_variables_launch_sets_for_its_nodes_are_not_flagged() -> None:
    env = node_environment(1, 2, 3, "127.0.0.1:1", "tcp", {"BURNCOLL_AUTH_TOKEN": "t" * 20})
    assert any(k.startswith("BURNCOLL_") for k in env)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_unknown_variables(FIELDS, env) == []


def test_every_variable_the_code_and_docs_name_is_known() -> None:
    """A ``BURNCOLL_*`` name in burncoll/ or docs/ is a field's variable or one of
    ``OTHER_VARIABLES``, so a documented or internal variable never draws the warning."""
    known = {"BURNCOLL_" + name.upper() for name in FIELDS} | OTHER_VARIABLES
    files = [*REPO.joinpath("burncoll").rglob("*.py"), *REPO.joinpath("docs").glob("*.md"),
             *REPO.joinpath("configs").glob("*.yaml"), REPO / "README.md"]
    named = {m for f in files for m in re.findall(r"\bBURNCOLL_\w*[A-Z0-9]", f.read_text())}
    # a marker on a bench worker's output line, and the misspelling the docs show
    not_variables = {"BURNCOLL_PEER_RESULT", "BURNCOLL_TIMEOT"}
    assert named - not_variables - known == set()
    assert len(named & known) > 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"timeot": 5}, "unknown config field(s) 'timeot' (did you mean 'timeout'?) in "
                     "CollectiveConfig(...)"),
     ({"num_device": 2, "backend": "numpy"}, "'num_device' (did you mean 'num_devices'?)")],
)
def test_a_misspelt_keyword_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        CollectiveConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert "the fields are" not in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'timeout'"):
        CollectiveConfig().replace(timeot=5)


def test_a_misspelt_yaml_key_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("backend: numpy\ntimout: 5\n")
    with pytest.raises(ConfigError) as info:
        CollectiveConfig.from_yaml(path)
    assert str(info.value) == (f"unknown config field(s) 'timout' (did you mean 'timeout'?) "
                               f"in {path}")


def test_a_key_unlike_any_field_lists_the_fields() -> None:
    with pytest.raises(ConfigError) as info:
        CollectiveConfig.from_mapping({"colour": "blue"})
    assert str(info.value).startswith("unknown config field(s) 'colour' in mapping; the "
                                      "fields are: auth_token, auth_token_file, backend, ")
    assert str(info.value).endswith(", transport")


@pytest.mark.parametrize(
    ("variable", "value", "accepted"),
    [("BURNCOLL_SHARED_MEMORY", "maybe", "expected true or false (also 1/0, yes/no, on/off)"),
     ("BURNCOLL_TLS", "sometimes", "expected true, false or auto (also 1/0, yes/no, on/off)"),
     ("BURNCOLL_NUM_NODES", "two", "expected an integer of at most 18 digits, or none"),
     ("BURNCOLL_TIMEOUT", "soon", "expected a number of seconds")],
)
def test_a_bad_variable_value_lists_what_it_accepts(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, accepted: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        CollectiveConfig()
    assert str(info.value).startswith(f"environment variable {variable}={value!r} is not a "
                                      "valid ")
    assert str(info.value).endswith(accepted)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [("BURNCOLL_TRANSPORT", "websockt", "='websockt': expected one of websocket, quic, tcp "
                                        "(did you mean 'websocket'?)"),
     ("BURNCOLL_LOCAL_REDUCE_STRATEGY", "ringg", ": unknown strategy 'ringg'; accepted: "),
     ("BURNCOLL_LOCAL_ALL_REDUCE_STRATEGY", "doubling", "='doubling': the recursive doubling "
                                                        "runs between nodes only"),
     ("BURNCOLL_TIMEOUT", "inf", "=inf: expected a number of seconds > 0"),
     ("BURNCOLL_AUTH_TOKEN", "short", " is only 5 bytes: ")],
)
def test_a_value_a_variable_gave_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str) -> None:
    """The field's own check refuses it; its message names where the value came from."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        CollectiveConfig()
    assert str(info.value).startswith(f"environment variable {variable}{message}"), info.value
    field = variable.removeprefix("BURNCOLL_").lower()
    with pytest.raises(ConfigError) as info:  # the code's value: named as the field
        CollectiveConfig(**{field: float(value) if field == "timeout" else value})
    assert str(info.value).startswith(f"{field}{message}"), info.value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"transport": "websockt"}, "transport='websockt': expected one of websocket, quic, tcp "
                                 "(did you mean 'websocket'?)"),
     ({"backend": "jaxx"}, "backend='jaxx': expected one of numpy, jax, cupy, torch (did you "
                           "mean 'jax'?)"),
     ({"backend": "tensorflow"}, "backend='tensorflow': expected one of numpy, jax, cupy, "
                                 "torch")],
)
def test_a_misspelt_choice_names_the_nearest(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        CollectiveConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize(("name", "hint"), [
    ("strategy", "local_all_reduce_strategy, global_all_reduce_strategy"),
    ("world_size", "num_nodes x num_devices"),
    ("rank", "node_rank"),
])
def test_names_of_other_libraries_point_at_burncolls_fields(name: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown config field\(s\) '{name}' \(.*{hint}"):
        CollectiveConfig(**{name: 4})


@pytest.mark.parametrize(("line", "fix"), [
    ("timeout: 1e2", "write timeout: 100"),  # YAML 1.1: no dot, so text
    ('timeout: "2.5"', "write timeout: 2.5"),
    ('num_devices: "4"', "write num_devices: 4"),
])
def test_a_number_the_yaml_file_gives_as_text_says_how_to_write_it(
        tmp_path: Path, line: str, fix: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=re.escape(fix)):
        CollectiveConfig.from_yaml(path)


def test_text_that_is_no_number_gets_no_such_hint(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("timeout: soon\n")
    with pytest.raises(ConfigError) as caught:
        CollectiveConfig.from_yaml(path)
    assert "timeout='soon'" in str(caught.value) and "write" not in str(caught.value)
