"""The backend registry: names, caching, missing libraries, and lazy imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading

import numpy as np
import pytest

from burncoll.backends import (
    BACKEND_NAMES,
    Backend,
    backend_for_array,
    get_backend,
    installed_backends,
)
from burncoll.errors import BackendUnavailable, ConfigError, UsageError


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        get_backend("mxnet")
    message = str(info.value)
    assert "'mxnet'" in message
    for name in ("numpy", "jax", "cupy", "torch"):
        assert repr(name) in message


@pytest.mark.parametrize("name", ["numpy", "jax", "torch"])
def test_get_backend_returns_one_shared_instance(name: str) -> None:
    instances: list[Backend] = []
    threads = [
        threading.Thread(target=lambda: instances.append(get_backend(name))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(b) for b in instances}) == 1
    assert instances[0] is get_backend(name)
    assert isinstance(instances[0], Backend)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_missing_cupy_names_the_extra() -> None:
    with pytest.raises(BackendUnavailable, match=r"pip install 'burncoll\[cupy\]'") as info:
        get_backend("cupy")
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, ImportError)


def test_missing_jax_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from burncoll.backends.jax import JaxBackend

    monkeypatch.setitem(sys.modules, "jax", None)  # makes `import jax` raise ImportError
    with pytest.raises(BackendUnavailable, match=r"pip install 'burncoll\[jax\]'") as info:
        JaxBackend()
    assert isinstance(info.value.__cause__, ImportError)


def test_missing_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from burncoll.backends import torch as torch_backend
    from burncoll.backends.torch import TorchBackend

    monkeypatch.setattr(torch_backend, "_torch_module", None)  # (imported once, then kept)
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(BackendUnavailable, match=r"pip install 'burncoll\[torch\]'") as info:
        TorchBackend()
    assert isinstance(info.value.__cause__, ImportError)


def test_installed_backends() -> None:
    installed = installed_backends()
    assert installed[0] == "numpy"
    assert set(installed) <= set(BACKEND_NAMES)
    assert ("jax" in installed) == (importlib.util.find_spec("jax") is not None)
    assert ("torch" in installed) == (importlib.util.find_spec("torch") is not None)
    if importlib.util.find_spec("cupy") is None:
        assert "cupy" not in installed


def test_backend_for_array() -> None:
    assert backend_for_array(np.zeros(3)) is get_backend("numpy")
    if "jax" in installed_backends():
        import jax.numpy as jnp

        assert backend_for_array(jnp.zeros(3)) is get_backend("jax")
    if "torch" in installed_backends():
        import torch

        assert backend_for_array(torch.zeros(3)) is get_backend("torch")
    for other in ([1, 2], None, np.float32(1.0)):
        with pytest.raises(UsageError, match="expected a numpy, jax, cupy or torch array"):
            backend_for_array(other)


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_importing_burncoll_imports_no_array_library_but_numpy() -> None:
    _run("import burncoll, sys\n"
         "assert not {'jax', 'cupy', 'torch'} & set(sys.modules), sys.modules.keys()")


def test_backend_modules_import_their_library_lazily() -> None:
    _run(
        "import sys, numpy as np\n"
        "import burncoll.backends.jax, burncoll.backends.cupy, burncoll.backends.torch\n"
        "from burncoll.backends import backend_for_array, get_backend\n"
        "assert backend_for_array(np.zeros(2)) is get_backend('numpy')\n"
        "assert not {'jax', 'cupy', 'torch'} & set(sys.modules)\n"
    )
