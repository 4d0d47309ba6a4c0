"""The shape of an object record's msgpack body, checked before msgpack decodes any of it.

A member holding the token chooses these bytes, and msgpack allocates on their word: a list
for every array header as it is read (8 bytes per item it declares), a pair for every map
entry, an object for every value. :func:`check` reads the headers alone, in one pass over the
body (runs of small ints or of floats at once), and refuses (:class:`~burncoll.ProtocolError`
saying what and where):

- containers (lists, tuples, dicts) and dict entries beyond ``limit`` in all;
- nesting deeper than ``max_depth`` containers (tuple keys count);
- a container declaring more items than the bytes left could hold (each takes at least one),
  counting the items every open container still owes: what msgpack reserves ahead stays
  within 8 bytes per byte of the record;
- values that would decode to more than :data:`PER_BYTE` times the record's bytes, or
  :data:`FLOOR` when that is more, by what each costs in Python (a 2-character str: about
  59 bytes for its 3; an int past 256: 36 for 3; a float: 32 for 9; containers are counted
  above): an 8 MiB record of short strings would otherwise take ~200 MiB;
- anything :func:`burncoll.comm.objects.encode` would not write where it stands: a dict key
  that is not None, a bool, an int, a float, a str or a tuple of those; a tuple mark other
  than msgpack's ``c7 00 01`` first in an array; an unknown ext type; a 32-bit float; the
  reserved byte 0xc1; bytes after the value.

What it leaves to the decoder: UTF-8, the contents of arrays, keys that repeat or collide.
"""

from __future__ import annotations

import struct

from burncoll.errors import ProtocolError

__all__ = ["FLOOR", "PER_BYTE", "check"]

# kinds of the byte that starts a msgpack value
_LEAF, _BIN, _ARRAY, _MAP, _EXT, _BAD = range(6)
# what an element may be, by where it stands
_VALUE, _KEY = range(2)
# frames: a list's items are values, a map's alternate key and value, a tuple key's are keys
_LIST, _DICT, _TUPLE_KEY = range(3)
_EXT_ARRAY, _EXT_SCALAR = 2, 3
#: What heads an array that is a tuple (ext type 1, empty), as msgpack writes it.
_MARK = b"\xc7\x00\x01"
#: The bytes that are a whole value on their own: fixints, nil, true, false.
_ONE_BYTE = bytes([*range(0x80), 0xC0, 0xC2, 0xC3, *range(0xE0, 0x100)])


def _table() -> list[tuple[int, int, int]]:
    """Per first byte: (kind, size, count). Leaves: the whole size when ``count`` is -1, else
    a length of ``size`` bytes follows; containers: ``count`` items when not -1, else a count
    of ``size`` bytes follows; ext types: a length of ``size`` bytes follows (``count`` -1)
    or ``count`` data bytes."""
    table = [(_BAD, 0, 0)] * 256
    for b in _ONE_BYTE:
        table[b] = (_LEAF, 1, -1)
    for b in range(0xA0, 0xC0):
        table[b] = (_LEAF, 1 + (b & 0x1F), -1)  # fixstr
    for b in range(16):
        table[0x80 + b], table[0x90 + b] = (_MAP, 0, b), (_ARRAY, 0, b)
    for b, size in ((0xCB, 9), (0xCC, 2), (0xCD, 3), (0xCE, 5), (0xCF, 9),
                    (0xD0, 2), (0xD1, 3), (0xD2, 5), (0xD3, 9)):
        table[b] = (_LEAF, size, -1)
    for b, size in ((0xD9, 1), (0xDA, 2), (0xDB, 4)):
        table[b] = (_LEAF, size, 0)  # str8/16/32
    for b, size in ((0xC4, 1), (0xC5, 2), (0xC6, 4)):
        table[b] = (_BIN, size, 0)
    for b, size in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):
        table[b] = (_EXT, size, -1)
    for b, size in ((0xD4, 1), (0xD5, 2), (0xD6, 4), (0xD7, 8), (0xD8, 16)):
        table[b] = (_EXT, 0, size)  # fixext
    table[0xDC], table[0xDD] = (_ARRAY, 2, -1), (_ARRAY, 4, -1)
    table[0xDE], table[0xDF] = (_MAP, 2, -1), (_MAP, 4, -1)
    return table


_TABLE = _table()
#: What a record's values may cost in Python, per byte of the record, and at least.
PER_BYTE, FLOOR = 12, 64 << 20


def _costs() -> list[int]:
    """Per first byte, what the value costs decoded (its object and the list slot holding it;
    cached small ints, None, bools and 0-1 character strs only the slot), before the length
    of a str, bytes or ext value that follows its header."""
    costs = [8] * 256
    for b in range(0xA2, 0xC0):
        costs[b] = 57 + (b & 0x1F)  # fixstr of 2-31 bytes
    for b in (0xCB, 0xD9, 0xDA, 0xDB):
        costs[b] = 32 if b == 0xCB else 57  # float; str8/16/32 (plus the length)
    for b in (0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
        costs[b] = 36  # ints past the small ones CPython caches
    for b in (0xC4, 0xC5, 0xC6):
        costs[b] = 41  # bytes (plus the length)
    return costs


_COSTS = _costs()
#: Big-endian lengths and counts of 1, 2 and 4 bytes (``struct.error`` past the end).
_READ = {size: struct.Struct(f">{code}").unpack_from for size, code in ((1, "B"), (2, "H"),
                                                                        (4, "I"))}


def check(body: memoryview, limit: int, max_depth: int) -> None:
    """Refuse ``body`` unless it is one msgpack value :func:`~burncoll.comm.objects.encode`
    could have written, with at most ``limit`` containers and dict entries and at most
    ``max_depth`` containers deep (see the module docstring)."""
    try:
        _check(body, limit, max_depth)
    except struct.error:
        raise ProtocolError("the msgpack body ends inside a length or a count") from None


def _check(body: memoryview, limit: int, max_depth: int) -> None:
    end, pos, role, spent = len(body), 0, _VALUE, [0]
    frames: list[list[int]] = []  # [items left, frame kind]
    owed, count = 1, 0  # items declared and not begun (the root's first); containers, entries
    while True:  # one container (or the root), then the leaves after it
        if pos >= end:
            raise ProtocolError(f"the msgpack body ends at byte {end} in the middle of a value")
        owed -= 1
        kind, size, n = _TABLE[body[pos]]
        if kind == _ARRAY or (kind == _MAP and role == _VALUE):
            if n < 0:
                n = _READ[size](body, pos + 1)[0]
            pos += 1 + size
            count += 1 + n if kind == _MAP else 1
            items = 2 * n if kind == _MAP else n
            owed += items
            if count > limit or len(frames) >= max_depth or owed > end - pos:
                _refuse_open(count, limit, len(frames) + 1, max_depth, owed, end - pos, pos)
            marked = kind == _ARRAY and n > 0 and body[pos:pos + 3] == _MARK
            if role == _KEY and not marked:
                raise ProtocolError(f"an array as a dict key that is not a tuple (byte {pos})")
            if marked:  # a tuple: the mark is its first item
                pos, owed, items = pos + 3, owed - 1, items - 1
            frame = _DICT if kind == _MAP else _TUPLE_KEY if role == _KEY else _LIST
            skip = _run(body, pos, items) if frame == _LIST and items > 8 else 0
            if skip:  # all its items one run of leaves
                pos, rest, read = pos + skip, 0, 0
                spent[0] += 8 * items if skip == items else 32 * items
            else:
                pos, rest, read = _leaves(body, pos, items, frame, len(frames) + 1 < max_depth,
                                          spent)
            owed, count = owed - (items - rest), count + read
            if rest:
                frames.append([rest, frame])
                role = _KEY if frame == _TUPLE_KEY or (frame == _DICT and rest % 2 == 0) \
                    else _VALUE
                continue
        elif frames or kind == _BAD or role == _KEY:  # not where a leaf reader stopped
            raise ProtocolError(_misplaced(body[pos], pos))
        else:  # the root is a leaf
            pos = _leaves(body, pos, 1, _LIST, False, spent)[0]
        if frames:
            frames[-1][0] -= 1  # the container just read
        pos, owed, count, role = _advance(body, pos, owed, count, frames, max_depth, spent)
        if not frames:
            if count > limit:
                _refuse_open(count, limit, 0, max_depth, 0, 0, pos)
            if spent[0] > max(FLOOR, PER_BYTE * end):
                raise ProtocolError(
                    f"values that would take about {spent[0] >> 20} MiB decoded, over "
                    f"{PER_BYTE} times the record's {end} bytes (or {FLOOR >> 20} MiB)")
            _done(pos, end)
            return


def _advance(body: memoryview, pos: int, owed: int, count: int, frames: list[list[int]],
             max_depth: int, spent: list[int]) -> tuple[int, int, int, int]:
    """Read the leaves that follow in the open containers, closing those they complete: the
    offset then, the items still owed, the containers so far, and where the next value
    stands (a key or a value)."""
    while frames:
        frame = frames[-1]
        left = frame[0]
        if left:
            pos, rest, read = _leaves(body, pos, left, frame[1], len(frames) < max_depth, spent)
            owed, count, frame[0] = owed - (left - rest), count + read, rest
            if rest:
                return pos, owed, count, _KEY if frame[1] == _TUPLE_KEY or (
                    frame[1] == _DICT and rest % 2 == 0) else _VALUE
        frames.pop()
        if frames:
            frames[-1][0] -= 1
    return pos, owed, count, _VALUE


def _leaves(body: memoryview, pos: int, left: int, frame: int, inner: bool,
            spent: list[int]) -> tuple[int, int, int]:
    """Read up to ``left`` items of a ``frame`` from ``pos`` while they are not containers,
    or (``inner``: the depth allows one more) short arrays of such items: the offset after
    them, how many of the ``left`` remain, and how many short arrays were read. Keys may be
    None, bools, ints, floats, strs or tuples of those; values also bytes and arrays; what
    they cost decoded is added to ``spent[0]``."""
    end, table, costs, read, cost = len(body), _TABLE, _COSTS, 0, 0
    while left and pos < end:
        first = body[pos]
        kind, size, n = table[first]
        if kind == _LEAF:
            if n < 0:
                pos, cost = pos + size, cost + costs[first]
            else:
                length = _READ[size](body, pos + 1)[0]
                pos, cost = pos + 1 + size + length, cost + costs[first] + length
            left -= 1
            continue
        key = frame == _TUPLE_KEY or (frame == _DICT and left % 2 == 0)
        if kind == _EXT and not key:
            at, pos = pos, _ext(body, pos, size, n)
            cost += 128 + pos - at  # an array object and its data
        elif kind == _ARRAY and size == 0 and inner:  # a fixarray: up to 15 items
            at = pos + 1
            if body[at:at + 3] == _MARK:
                at, n = at + 3, n - 1
            elif key or not n:
                break  # not a tuple key (refused by the caller); an empty list
            at, rest, _ = _leaves(body, at, n, _TUPLE_KEY if key else _LIST, False, spent)
            if rest:
                break  # it holds a container: the caller opens it
            pos, read = at, read + 1
        elif kind == _BIN and not key:
            length = _READ[size](body, pos + 1)[0]
            pos, cost = pos + 1 + size + length, cost + costs[first] + length
        else:
            break
        left -= 1
    spent[0] += cost
    return pos, left, read


def _run(body: memoryview, pos: int, n: int) -> int:
    """The bytes of ``n`` values at ``pos`` when every one is a one-byte value or every one a
    float64 (a list of small ints, or of floats: read at once), else 0."""
    if pos + n <= len(body) and not bytes(body[pos:pos + n]).translate(None, _ONE_BYTE):
        return n
    if pos + 9 * n <= len(body) and bytes(body[pos:pos + 9 * n:9]).count(0xCB) == n:
        return 9 * n
    return 0


def _done(pos: int, end: int) -> None:
    if pos > end:
        raise ProtocolError(f"the msgpack body ends at byte {end} in the middle of a value")
    if pos < end:
        raise ProtocolError(f"{end - pos} bytes follow the msgpack value")


def _ext(body: memoryview, pos: int, size: int, n: int) -> int:
    """The offset after the ext value at ``pos``, an array or an array scalar (a tuple mark
    stands only first in an array, read there)."""
    start = pos + 2 + size  # after the first byte, the length and the type
    if start > len(body):
        raise ProtocolError(f"the msgpack body ends inside an ext header at byte {pos}")
    if n < 0:
        n = _READ[size](body, pos + 1)[0]
    code = body[start - 1]
    if code not in (_EXT_ARRAY, _EXT_SCALAR):
        raise ProtocolError(f"unknown msgpack ext type {code} at byte {pos} (only arrays, "
                            "array scalars and the empty tuple mark heading an array are sent)")
    return start + n


def _refuse_open(count: int, limit: int, depth: int, max_depth: int, owed: int, left: int,
                 pos: int) -> None:
    """A container opened at ``pos`` past a limit, or declaring more items than can follow."""
    if count > limit:
        raise ProtocolError(
            f"more than {limit} containers and dict entries (the limit for a record of this "
            "size: CollectiveConfig.max_object_containers, or one per 16 bytes of the record)")
    if depth > max_depth:
        raise ProtocolError(f"containers nested deeper than {max_depth}")
    if owed > left:
        raise ProtocolError(f"containers declare {owed} more items at byte {pos}, but only "
                            f"{left} bytes follow (each item takes at least one)")


def _misplaced(first: int, pos: int) -> str:
    """Why the value at ``pos`` (first byte ``first``) cannot stand there."""
    kind = _TABLE[first][0]
    if kind == _BAD:
        return f"msgpack type byte 0x{first:02x} (never written: reserved, or a 32-bit float)"
    what = {_BIN: "bytes", _MAP: "a dict"}.get(kind, "an array or array scalar")
    return f"{what} as a dict key (byte {pos})"
