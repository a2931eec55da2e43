"""The allow-list unpickler: the only pickle code streamckpt runs (a DCP ``.metadata``,
an item's ``data.pkl``, small non-tensor items).

``RestrictedUnpickler`` resolves only the globals a caller allows (and torch dtypes
when asked), each mapped onto an inert stand-in: ``Record`` subclasses that only
store fields, ``Inert`` callables whose attributes a pickle cannot set. Any other
global raises ``CorruptCheckpointError`` before it could be resolved, so a hostile
file never runs code. Before unpickling, ``check_memo`` walks the opcode stream
and refuses memo indices a pickler never writes (the C unpickler sizes its memo by
the largest index a PUT names). No I/O.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any, Callable

import torch

from ..errors import CheckpointError, CorruptCheckpointError


class Sealed(type):
    """Classes whose attributes a pickle cannot change (BUILD on a class object)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise TypeError(f"cannot set {name!r} on {cls.__name__}")

    def __delattr__(cls, name: str) -> None:
        raise TypeError(f"cannot delete {name!r} on {cls.__name__}")


class Record(metaclass=Sealed):
    """An inert stand-in for an allow-listed dataclass: it only stores fields."""

    fields: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(self.fields):
            raise TypeError(f"{type(self).__name__} takes {len(self.fields)} fields")
        self.__dict__.update(zip(self.fields, args))
        self.__setstate__(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (dict_state, slot_state) with no dict state
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise TypeError(f"unexpected state for {type(self).__name__}")
        self.__dict__.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)


class Inert:
    """A callable or marker a pickle may name but never change: BUILD on it (which
    would otherwise set attributes such as a function's ``__defaults__``) fails."""

    __slots__ = ("_fn", "value")

    def __init__(self, fn: Callable[..., Any] | None = None, value: Any = None) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "value", value)

    def __call__(self, *args: Any) -> Any:
        if self._fn is None:
            raise TypeError("not callable")
        return self._fn(*args)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("immutable")

    def __setstate__(self, state: Any) -> None:
        raise TypeError("immutable")


TORCH_DTYPES: dict[str, torch.dtype] = {
    name: obj for name in dir(torch) if isinstance(obj := getattr(torch, name), torch.dtype)
}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``allowed`` (plus torch dtypes when asked);
    anything else raises before a callable is ever looked up."""

    def __init__(self, data: bytes, *, allowed: dict[tuple[str, str], Any], where: str,
                 dtypes_ok: bool = True, persistent: Callable[[Any], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._where = where
        self._dtypes_ok = dtypes_ok
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None and self._dtypes_ok and module == "torch":
            found = TORCH_DTYPES.get(name)
        if found is None:
            raise Refused(f"{self._where}: pickle references {module}.{name}, which is not on the allow-list")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise Refused(f"{self._where}: unexpected persistent id in pickle")
        return self._persistent(pid)


class Refused(pickle.UnpicklingError):
    pass


_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_NO_ARG, _FIXED, _LINES, _COUNTED = range(4)


def _opcode_table() -> dict[int, tuple[str, int, int, bool]]:
    """Per opcode byte: (name, how its argument is laid out, a size, signed), from
    ``pickletools``' own descriptions (the unpickler's layout)."""
    counted = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
               pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}
    out = {}
    for op in pickletools.opcodes:
        a = op.arg
        if a is None:
            entry = (op.name, _NO_ARG, 0, False)
        elif a.n >= 0:
            entry = (op.name, _FIXED, a.n, False)
        elif a.n == pickletools.UP_TO_NEWLINE:
            entry = (op.name, _LINES, 2 if a.reader is pickletools.read_stringnl_noescape_pair else 1, False)
        else:
            entry = (op.name, _COUNTED, *counted[a.n])
        out[ord(op.code)] = entry
    return out


_OPCODES = _opcode_table()  # immutable after import: a lookup table, not state


_PLAIN, _PUT, _GET, _MEMOIZE, _STOP = range(5)


def _walk_table() -> tuple[tuple[str, int, int, bool, int] | None, ...]:
    """``_OPCODES`` indexed by byte, with each opcode's memo role."""
    roles = {**{n: _PUT for n in _PUTS}, **{n: _GET for n in _GETS}, "MEMOIZE": _MEMOIZE, "STOP": _STOP}
    out: list[tuple[str, int, int, bool, int] | None] = [None] * 256
    for code, (name, kind, size, signed) in _OPCODES.items():
        out[code] = (name, kind, size, signed, roles.get(name, _PLAIN))
    return tuple(out)


_WALK = _walk_table()  # immutable after import, like _OPCODES
_BARE = frozenset(i for i, e in enumerate(_WALK) if e is not None and e[1] == _NO_ARG and e[4] == _PLAIN)
_MEMOIZE_OP = ord(pickle.MEMOIZE)
_BINGET_OP = ord(pickle.BINGET)


def check_memo(data: bytes, *, where: str) -> None:
    """Refuse memo indices a pickler would never write, before unpickling.

    The C unpickler sizes its memo array by the largest index a PUT names, so a
    12-byte pickle saying ``LONG_BINPUT 2**30`` would allocate 16 GiB. Picklers
    number memo entries 0, 1, 2, ...; anything else is hostile. This pre-scan
    walks the opcode stream as the unpickler does (``pickletools.genops`` without
    building every argument; no objects are built) and bounds the memo by the
    input. Entries stored so far are always ``0 .. count-1`` (a PUT may only name
    one of them or the next), so a count is the whole state: a ``.metadata`` of
    ~10,000 opcodes is walked in about a millisecond.
    """
    try:
        _walk(data, where)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed opcode stream is corrupt input
        raise CorruptCheckpointError(f"{where}: malformed pickle ({type(e).__name__}: {e})") from None


def _walk(data: bytes, where: str) -> None:
    """``check_memo``'s loop; ``ValueError`` on a stream malformed or ending before STOP."""
    table, pos, n, count = _WALK, 0, len(data), 0
    bare, memoize, binget = _BARE, _MEMOIZE_OP, _BINGET_OP
    while True:
        if pos >= n:
            raise ValueError("pickle ends before STOP")
        op = data[pos]
        if op in bare:  # most opcodes of a metadata pickle: no argument, no memo role
            pos += 1
            continue
        if op == memoize:
            count += 1
            pos += 1
            continue
        if op == binget and pos + 1 < n:
            if data[pos + 1] >= count:
                raise CorruptCheckpointError(f"{where}: pickle reads memo entry {data[pos + 1]}, never stored")
            pos += 2
            continue
        entry = table[op]
        if entry is None:
            raise ValueError(f"unknown opcode {data[pos]:#x} at {pos}")
        name, kind, size, signed, role = entry
        start = end = pos + 1
        if kind == _FIXED:
            end = start + size
        elif kind == _LINES:
            for _ in range(size):
                nl = data.find(b"\n", end)
                if nl < 0:
                    raise ValueError(f"no newline after {name} at {pos}")
                end = nl + 1
        elif kind == _COUNTED:
            length = int.from_bytes(data[start:start + size], "little", signed=signed)
            if start + size > n or length < 0:
                raise ValueError(f"bad length for {name} at {pos}")
            end = start + size + length
        if end > n:
            raise ValueError(f"{name} at {pos} runs past the end")
        if role:
            if role == _MEMOIZE:
                count += 1
            elif role == _STOP:
                return
            else:
                arg = data[start:end]
                idx = int(arg) if kind == _LINES else int.from_bytes(arg, "little")
                if role == _PUT:
                    if idx < 0 or idx > count:
                        raise CorruptCheckpointError(f"{where}: pickle stores memo entry {idx!r:.40}, out of sequence")
                    count += idx == count
                elif idx < 0 or idx >= count:
                    raise CorruptCheckpointError(f"{where}: pickle reads memo entry {idx!r:.40}, never stored")
        pos = end


def safe_unpickle(data: bytes, *, allowed: dict[tuple[str, str], Any], where: str, dtypes_ok: bool = True,
                  persistent: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle with an allow-list after a memo pre-scan; every failure is a
    ``CorruptCheckpointError``."""
    check_memo(data, where=where)
    try:
        return RestrictedUnpickler(
            data, allowed=allowed, where=where, dtypes_ok=dtypes_ok, persistent=persistent
        ).load()
    except Refused as e:
        raise CorruptCheckpointError(f"{e}; refusing to load it") from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle is corrupt input
        raise CorruptCheckpointError(f"{where}: malformed pickle ({type(e).__name__}: {e})") from None
