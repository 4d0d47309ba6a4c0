"""Array backends: the :class:`Backend` protocol and the registry of its implementations.

``get_backend("numpy" | "jax" | "cupy" | "torch")`` returns the one shared instance of a
backend. Importing this package imports neither jax, cupy nor torch; a backend imports its
library when it is first asked for.
"""

from __future__ import annotations

import importlib
import sys
import threading

from burncoll.backends.base import Array, Backend, Device, combine
from burncoll.errors import BackendUnavailable, ConfigError, UsageError

__all__ = ["BACKEND_NAMES", "Array", "Backend", "Device", "backend_for_array", "combine",
           "foreign_array", "get_backend", "installed_backends"]

#: Every backend name, in the order :func:`backend_for_array` tries them.
BACKEND_NAMES: tuple[str, ...] = ("numpy", "jax", "cupy", "torch")

# name -> (module, class, the top-level library it wraps)
_IMPLEMENTATIONS: dict[str, tuple[str, str, str]] = {
    "numpy": ("burncoll.backends.numpy", "NumpyBackend", "numpy"),
    "jax": ("burncoll.backends.jax", "JaxBackend", "jax"),
    "cupy": ("burncoll.backends.cupy", "CupyBackend", "cupy"),
    "torch": ("burncoll.backends.torch", "TorchBackend", "torch"),
}

_instances: dict[str, Backend] = {}
_instances_lock = threading.Lock()


def get_backend(name: str) -> Backend:
    """The shared backend called ``name`` (``"numpy"``, ``"jax"``, ``"cupy"`` or ``"torch"``).

    Raises :class:`~burncoll.ConfigError` for an unknown name, and
    :class:`~burncoll.BackendUnavailable` (naming the ``pip install 'burncoll[...]'`` extra)
    when the backend's library is not installed.
    """
    if name not in _IMPLEMENTATIONS:
        choices = ", ".join(repr(n) for n in BACKEND_NAMES)
        raise ConfigError(f"unknown backend {name!r}; choose one of {choices}")
    with _instances_lock:
        backend = _instances.get(name)
        if backend is None:
            module_name, class_name, _ = _IMPLEMENTATIONS[name]
            backend_class = getattr(importlib.import_module(module_name), class_name)
            backend = _instances[name] = backend_class()
    return backend


def installed_backends() -> list[str]:
    """The names of the backends usable here, in :data:`BACKEND_NAMES` order. A backend is usable
    when its library imports; CuPy also needs at least one GPU. This imports the libraries that are
    installed."""
    usable = []
    for name in BACKEND_NAMES:
        try:
            backend = get_backend(name)
        except BackendUnavailable:
            continue
        if name == "cupy" and not _has_gpu(backend):
            continue
        usable.append(name)
    return usable


def backend_for_array(x: object) -> Backend:
    """The backend whose array type ``x`` is. Only libraries already imported are considered (an
    array of a library cannot exist before the library is imported), so this never imports jax, cupy
    or torch. Raises :class:`~burncoll.UsageError` when ``x`` is not an array of any backend."""
    for name in BACKEND_NAMES:
        if _IMPLEMENTATIONS[name][2] not in sys.modules:
            continue
        try:
            backend = get_backend(name)
        except BackendUnavailable:
            continue
        if backend.is_array(x):
            return backend
    raise UsageError(f"expected a numpy, jax, cupy or torch array, got "
                     f"{type(x).__module__}.{type(x).__qualname__}")


#: How each backend's arrays are called in messages.
_ARRAY_NAMES = {"numpy": "numpy.ndarray", "jax": "jax.Array", "cupy": "cupy.ndarray",
                "torch": "torch.Tensor"}


def foreign_array(x: object, backend: str) -> str:
    """Why ``x`` is no array of ``backend``, and what to do: the backend to choose when ``x``
    is an array of another one (``backend="jax"``), else what to convert it to."""
    try:
        other = backend_for_array(x).name
    except UsageError:
        return (f"expected an array of backend {backend!r}, got {type(x).__name__}; convert "
                "it first (the backend is set in CollectiveConfig)")
    return (f"a {_ARRAY_NAMES[other]} was given to a communicator of backend {backend!r}: "
            f"pass backend={other!r} to CollectiveConfig, or convert the array to a "
            f"{_ARRAY_NAMES[backend]}")


def _has_gpu(backend: Backend) -> bool:
    """True when the CuPy backend sees at least one CUDA device; False on any CUDA failure."""
    from burncoll.backends.cupy import CupyBackend

    if not isinstance(backend, CupyBackend):
        return False
    try:
        return backend.device_count() > 0
    except Exception:  # a broken CUDA set-up raises many kinds of error: no usable GPU
        return False
