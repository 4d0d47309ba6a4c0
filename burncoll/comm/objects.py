"""Python objects as bytes for :meth:`~burncoll.Communicator.broadcast_object` and
:meth:`~burncoll.Communicator.all_gather_object`: msgpack plus a NumPy ext type, never pickle.

The bytes come from other nodes, so nothing here runs code they choose: only msgpack's data
model and three ext types of our own. The exact types that may be sent are in
docs/operations.md ("Python objects"); anything else, nesting deeper than :data:`MAX_DEPTH` or
an encoding over :data:`MAX_OBJECT_BYTES` is a :class:`~burncoll.UsageError` naming the type
and where it sits (``obj['metrics'][2]``). Results are NumPy arrays on the host, writable.

A payload is one record: a tag byte, the body's length (8 bytes, little endian) and the body.
Tag 1: the msgpack encoding of the object. Tag 2: why the sending peer could not encode its
object (UTF-8, at most :data:`MAX_MESSAGE_BYTES`), so that every peer raises the same
:class:`~burncoll.UsageError` at once. An all-gather's result is every peer's record in rank
order. Bytes this module would not have written raise :class:`~burncoll.ProtocolError`
naming what was wrong, never another exception.

Decoding is bounded by the record and a cap: :mod:`burncoll.comm.object_scan` checks the
body's shape before msgpack allocates anything (containers and dict entries at most
``max(cap, bytes // 16)``, what the values cost decoded (at most 12 times the record's bytes
or 64 MiB), nesting, counts against the bytes left, keys and ext types where
:func:`encode` puts them); a dict whose keys share a hash value more than
:data:`MAX_SAME_HASH` times is refused before it is built; bool arrays hold only 0 and 1.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Protocol

import msgpack
import numpy as np

from burncoll.comm.object_scan import FLOOR, check
from burncoll.config.collective import CollectiveConfig
from burncoll.dtypes import SUPPORTED_DTYPES, dtype_from_name, dtype_name
from burncoll.errors import ProtocolError, UsageError

__all__ = [
    "MAX_CONTAINERS",
    "MAX_DEPTH",
    "MAX_MESSAGE_BYTES",
    "MAX_NDIM",
    "MAX_OBJECT_BYTES",
    "MAX_SAME_HASH",
    "Host",
    "decode",
    "encode",
    "is_refusal",
    "payload",
    "refusal",
    "unpack",
]

#: The largest encoded object, in bytes (1 GiB); larger ones are refused on the sender.
MAX_OBJECT_BYTES = 2**30
#: How many containers (lists, tuples, dicts) deep an object may nest.
MAX_DEPTH = 100
#: The most dimensions an array may have.
MAX_NDIM = 32
#: How many containers (lists, tuples, dicts) and dict entries a received object may hold, by
#: default (:attr:`~burncoll.CollectiveConfig.max_object_containers`). A record of more than
#: 16 times as many bytes may hold one per 16 bytes.
MAX_CONTAINERS: int = CollectiveConfig.max_object_containers
#: How many keys of one received dict may share a hash value: honest keys do too, since
#: ``hash(-1) == hash(-2)`` (a dict keyed by 4-D offsets in -2..2 has 16 sharing one), and 64
#: cost a dict built of such groups 3 times what 8 do (0.3 s for 2**19 int keys).
MAX_SAME_HASH = 64
#: The longest reason a peer may give for not sending its object, in UTF-8 bytes.
MAX_MESSAGE_BYTES = 2000

_OBJECT, _REFUSED = 1, 2  # record tags
_HEADER = struct.Struct("<BQ")
_EXT_TUPLE, _EXT_ARRAY, _EXT_SCALAR = 1, 2, 3  # ext type codes
#: Heads a msgpack array that is a tuple; users cannot send an ExtType, so it is unambiguous.
_TUPLE_HEAD = msgpack.ExtType(_EXT_TUPLE, b"")
_LEAVES = (type(None), bool, float, str, bytes, np.str_, np.bytes_)  # NumPy's: as str, bytes
_KEYS = (type(None), bool, int, float, str, np.str_)
_SUPPORTED = ("None, bool, int, float, str, bytes, list, tuple, dict, NumPy arrays and scalars "
             "(JAX and CuPy arrays are sent as NumPy arrays)")


class _TupleMark:
    """What the tuple ext type decodes to, until the array it heads becomes a tuple."""


_TUPLE = _TupleMark()
_first = itemgetter(0)


class _Refused(UsageError):
    """An object that cannot be sent; ``path`` grows as the error leaves the containers."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[object] = []

    def __str__(self) -> str:
        keys = [f"[{_short(key)}]" for key in self.path]
        if len(keys) > 12:  # a deep path: its two ends say where
            keys[6:-4] = [f"...({len(keys) - 10} more)..."]
        where = "obj" + "".join(keys)
        return f"cannot send {self.what} at {where}; supported: {_SUPPORTED}"


# -- encoding -----------------------------------------------------------------------------------


def encode(obj: object, cap: int = MAX_CONTAINERS) -> bytes:
    """``obj`` as one tagged record; :class:`~burncoll.UsageError` when it cannot be sent,
    including when it holds more containers and dict entries than a peer of the same ``cap``
    (:attr:`~burncoll.CollectiveConfig.max_object_containers`) accepts (see :func:`unpack`)."""
    try:
        count = _check(obj, 0)
    except _Refused as exc:  # a plain UsageError for the caller, its path rendered
        raise UsageError(str(exc)) from None
    except RecursionError:
        raise UsageError(f"cannot send obj: it nests deeper than {MAX_DEPTH} containers") from None
    try:
        body: bytes = msgpack.packb(obj, default=_default, strict_types=True,
                                    use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:
        raise UsageError(f"cannot send obj: {type(exc).__name__}: {exc}") from exc
    if len(body) > MAX_OBJECT_BYTES:
        raise UsageError(f"cannot send obj: it encodes to {len(body)} bytes, over the limit of "
                         f"{MAX_OBJECT_BYTES} (burncoll.comm.objects.MAX_OBJECT_BYTES)")
    if count > max(cap, len(body) // 16):
        raise UsageError(
            f"cannot send obj: it holds {count} lists, tuples, dicts and dict entries, more than "
            f"the peers accept (max_object_containers={cap}, or one per 16 bytes of its "
            f"{len(body)}-byte encoding); send the numbers as a NumPy array (one entry), or "
            "raise max_object_containers on every peer (BURNCOLL_MAX_OBJECT_CONTAINERS)")
    if len(body) > FLOOR // 48:  # (no value costs 48 times its bytes: smaller ones fit)
        try:
            check(memoryview(body), max(cap, len(body) // 16), MAX_DEPTH)
        except ProtocolError as exc:
            raise UsageError(f"cannot send obj: the peers would refuse it: {exc}; send many "
                             "numbers or strings as a NumPy array or bytes") from None
    return _HEADER.pack(_OBJECT, len(body)) + body


def refusal(message: str) -> bytes:
    """The record a peer sends instead of its object when it cannot encode it."""
    body = message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    body = body.decode("utf-8", "ignore").encode("utf-8")  # no character cut in half
    return _HEADER.pack(_REFUSED, len(body)) + body


def is_refusal(record: Any) -> bool:
    """Whether ``record`` (a :func:`payload`) is a refusal rather than an object."""
    return bool(len(record) > 0 and int(record[0]) == _REFUSED)


class Host(Protocol):
    """The part of a backend (:class:`burncoll.backends.base.Backend`) that moves bytes to its
    arrays."""

    def from_host(self, buffer: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...],
                  device: Any) -> Any: ...


def payload(obj: object, backend: Host | None = None, device: Any = None,
            cap: int = MAX_CONTAINERS) -> Any:
    """``obj``'s record (or a refusal saying why it cannot be sent) as a 1-D uint8 array:
    NumPy, or the ``backend``'s on ``device`` when one is given (``cap``: as for :func:`encode`).

    Never raises for the object itself: a peer whose object is refused still takes part in
    the collective, and :func:`unpack` raises on every peer.
    """
    try:
        record = encode(obj, cap)
    except Exception as exc:  # whatever the object did: tell every peer, never leave them waiting
        record = refusal(str(exc) if isinstance(exc, UsageError)
                         else f"cannot send obj: {type(exc).__name__}: {exc}")
    data = np.frombuffer(bytearray(record), np.uint8)
    return data if backend is None else backend.from_host(data, "uint8", data.shape, device)


def _check(obj: Any, depth: int) -> int:
    """Refuse what cannot be sent, with its path, before msgpack sees it; the containers and
    dict entries in it, as :mod:`~burncoll.comm.object_scan` counts them."""
    kind = type(obj)
    if kind in _LEAVES:
        if kind in (str, np.str_) and not obj.isascii():
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError:
                raise _Refused("a str that is not valid Unicode (a lone surrogate)") from None
        return 0
    if kind is int:
        if not -(2**63) <= obj < 2**64:
            raise _Refused(f"an int outside -2**63..2**64-1 ({_short(obj)})")
        return 0
    if kind in (list, tuple, dict):
        if depth >= MAX_DEPTH:
            raise _Refused(f"a {kind.__name__} nested deeper than {MAX_DEPTH} containers "
                           "(one that holds itself?)")
        count = 1 + len(obj) if kind is dict else 1
        for key, value in obj.items() if kind is dict else enumerate(obj):
            try:
                if kind is dict:
                    count += _check_key(key, depth + 1)
                count += _check(value, depth + 1)
            except _Refused as exc:
                exc.path.insert(0, key)
                raise
        return count
    if kind is np.ndarray or isinstance(obj, np.generic) or _foreign(obj):
        name = dtype_name(np.dtype(obj.dtype))
        if name not in SUPPORTED_DTYPES:
            raise _Refused(f"an array of dtype {name} (supported dtypes: "
                           f"{', '.join(SUPPORTED_DTYPES)})")
        return 0
    raise _Refused(_describe(kind))


def _check_key(key: Any, depth: int) -> int:
    """A dict key ``depth`` containers deep: a scalar, or a tuple of keys (counted as
    :func:`_check` counts)."""
    kind = type(key)
    if kind is tuple:
        if depth >= MAX_DEPTH:
            raise _Refused(f"a dict key nested deeper than {MAX_DEPTH} containers")
        return 1 + sum(_check_key(item, depth + 1) for item in key)
    if kind not in _KEYS:
        hint = "; send a NumPy scalar as key.item()" if issubclass(kind, np.generic) else ""
        raise _Refused(f"a dict key that is {_describe(kind)} (keys may be str, int, float, "
                       f"bool, None or tuples of those{hint})")
    return _check(key, depth)


def _describe(kind: type) -> str:
    name = kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]}"


def _foreign(obj: object) -> bool:
    """A JAX or CuPy array (sent as the NumPy array of its values)."""
    return type(obj).__module__.split(".")[0] in ("jax", "jaxlib", "cupy") and hasattr(
        obj, "dtype")


def _default(obj: Any) -> object:
    """msgpack's hook for what it does not pack itself: tuples and arrays (checked already)."""
    if type(obj) is tuple:
        return [_TUPLE_HEAD, *obj]
    if type(obj) in (np.str_, np.bytes_):
        return obj.item()
    if isinstance(obj, np.generic):
        return _array_ext(np.asarray(obj), _EXT_SCALAR)
    if type(obj).__module__.split(".")[0] == "cupy":  # pragma: no cover - no GPU here
        obj = obj.get()
    return _array_ext(np.asarray(obj), _EXT_ARRAY)


def _array_ext(array: np.ndarray[Any, Any], code: int) -> msgpack.ExtType:
    """dtype name, dimensions and raw C-order native-endian bytes."""
    if array.nbytes > MAX_OBJECT_BYTES:
        raise ValueError(f"an array of {array.nbytes} bytes is over the limit of "
                         f"{MAX_OBJECT_BYTES} (burncoll.comm.objects.MAX_OBJECT_BYTES)")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    name = dtype_name(array.dtype).encode("ascii")
    head = struct.pack(f"<B{len(name)}sB{array.ndim}Q", len(name), name, array.ndim,
                       *array.shape)
    return msgpack.ExtType(code, head + array.tobytes())


# -- decoding -----------------------------------------------------------------------------------


def decode(data: bytes | bytearray | memoryview, cap: int = MAX_CONTAINERS) -> object:
    """The object of one record from :func:`encode` (``cap``: as for :func:`unpack`).

    Raises :class:`~burncoll.ProtocolError` for bytes :func:`encode` would not have written,
    and :class:`~burncoll.UsageError` for a refusal record (carrying the sender's reason).
    """
    view = memoryview(data).cast("B")
    tag, body, end = _record(view, 0)
    if end != len(view):
        raise ProtocolError(f"{len(view) - end} bytes follow the record")
    if tag == _REFUSED:
        raise UsageError(f"the sender could not send its object: {_reason(body)}")
    return _object(body, cap)


def unpack(data: Any, peers: Sequence[int], label: str, cap: int = MAX_CONTAINERS
           ) -> list[object]:
    """The objects of ``len(peers)`` records laid end to end (host bytes or a uint8 array), in
    the order of ``peers``; each may hold ``max(cap, its bytes // 16)`` containers and dict
    entries (:mod:`burncoll.comm.object_scan` checks a record before it is decoded).

    Raises :class:`~burncoll.UsageError` naming every peer that sent a refusal, and
    :class:`~burncoll.ProtocolError` naming the peer whose bytes are not a valid record.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        data = np.ascontiguousarray(data, np.uint8).data
    view = memoryview(data).cast("B")
    records, at = [], 0
    for peer in peers:
        try:
            tag, body, at = _record(view, at)
        except ProtocolError as exc:
            raise ProtocolError(f"{label}: the bytes from peer {peer}: {exc}") from None
        records.append((peer, tag, body))
    if at != len(view):
        raise ProtocolError(f"{label}: {len(view) - at} bytes follow the records of "
                            f"{len(peers)} peers")
    refused = [f"peer {peer} could not send its object: {_reason(body)}"
               for peer, tag, body in records if tag == _REFUSED]
    if refused:
        raise UsageError(f"{label}: " + "; ".join(refused))
    objects = []
    for peer, _, body in records:
        try:
            objects.append(_object(body, cap))
        except ProtocolError as exc:
            raise ProtocolError(f"{label}: the object from peer {peer}: {exc}") from None
    return objects


def _record(view: memoryview, at: int) -> tuple[int, memoryview, int]:
    """The tag and body of the record at offset ``at``, and the offset after it."""
    if len(view) - at < _HEADER.size:
        raise ProtocolError(f"truncated record: {len(view) - at} bytes, fewer than the "
                            f"{_HEADER.size}-byte header")
    tag, size = _HEADER.unpack_from(view, at)
    if tag not in (_OBJECT, _REFUSED):
        raise ProtocolError(f"unknown record tag {tag} (expected {_OBJECT} or {_REFUSED})")
    limit = MAX_OBJECT_BYTES if tag == _OBJECT else MAX_MESSAGE_BYTES
    if size > limit:
        raise ProtocolError(f"the record declares {size} bytes, over the limit of {limit}")
    start = at + _HEADER.size
    if len(view) - start < size:
        raise ProtocolError(f"truncated record: it declares {size} bytes, "
                            f"{len(view) - start} came")
    return tag, view[start:start + size], start + size


def _reason(body: memoryview) -> str:
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("a refusal record whose reason is not UTF-8") from None


def _object(body: memoryview, cap: int) -> object:
    """Unpack a record's body once :func:`~burncoll.comm.object_scan.check` passed it: at most
    ``max(cap, len(body) // 16)`` containers and dict entries."""
    check(body, max(cap, len(body) // 16), MAX_DEPTH)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True,
                               ext_hook=_ext, list_hook=_list, object_pairs_hook=_pairs)
    except (ProtocolError, UsageError):
        raise
    except Exception as exc:  # msgpack's errors: bad UTF-8, ...
        raise ProtocolError(f"not a valid object encoding: {type(exc).__name__}: {exc}"
                            ) from None


def _ext(code: int, data: bytes) -> object:
    if code == _EXT_TUPLE:  # where it may stand, and that it is empty: checked already
        return _TUPLE
    return _array(data, code == _EXT_SCALAR)


def _list(items: list[object]) -> object:
    if items and items[0] is _TUPLE:
        return tuple(items[1:])
    return items


def _pairs(pairs: list[tuple[object, object]]) -> dict[object, object]:
    """A dict, once no hash value is shared by more than :data:`MAX_SAME_HASH` of its keys
    (ints, floats and tuples of them hash alike in every process: a dict of keys chosen to
    share one hash would take time growing with the square of their number to build)."""
    hashes = list(map(hash, map(_first, pairs)))
    if len(set(hashes)) < len(hashes):
        top = max(Counter(hashes).values())
        if top > MAX_SAME_HASH:
            raise ProtocolError(f"a dict of {len(pairs)} keys, {top} of which share one hash "
                                f"value (at most {MAX_SAME_HASH} may: keys chosen to collide)")
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ProtocolError("a map with a repeated key")
    return result


def _array(data: bytes, scalar: bool) -> object:
    """A NumPy array (or scalar) from its ext bytes, checking every field against the data."""
    try:
        size = data[0]
        name = data[1:1 + size].decode("ascii")
        ndim = data[1 + size]
    except (IndexError, UnicodeDecodeError):
        raise ProtocolError("a truncated or garbled array header") from None
    if name not in SUPPORTED_DTYPES:
        raise ProtocolError(f"an array of dtype {name!r}, not one of {', '.join(SUPPORTED_DTYPES)}")
    if ndim > MAX_NDIM or (scalar and ndim):
        raise ProtocolError(f"an array {'scalar ' if scalar else ''}with {ndim} dimensions "
                            f"(at most {0 if scalar else MAX_NDIM})")
    start = 2 + size + 8 * ndim
    if len(data) < start:
        raise ProtocolError(f"an array header declares {ndim} dimensions but is truncated")
    shape = struct.unpack_from(f"<{ndim}Q", data, 2 + size)
    if max(shape, default=0) >= 2**63:
        raise ProtocolError(f"an array with shape {shape}: dimensions must be below 2**63")
    dtype = dtype_from_name(name)
    want = math.prod(shape) * dtype.itemsize
    if want != len(data) - start:
        raise ProtocolError(f"an array of {name} with shape {shape} needs {want} bytes, "
                            f"{len(data) - start} came")
    if name == "bool" and want and np.frombuffer(data, np.uint8, offset=start).max() > 1:
        raise ProtocolError(f"a bool array with shape {shape} holding a byte other than 0 or 1")
    try:
        array = np.frombuffer(data, dtype, offset=start).reshape(shape).copy()
    except ValueError as exc:  # a shape NumPy cannot hold ((0, 2**62) of float32)
        raise ProtocolError(f"an array of {name} with shape {shape}: {exc}") from None
    return array[()] if scalar else array
