"""Plain data <-> bytes, for the calls between the test process and the candidate process.

Plain data is what ``marshal`` accepts minus code objects: ``None``, ``bool``, ``int``, ``float``,
``complex``, ``str``, ``bytes``, and ``list``/``tuple``/``dict``/``set``/``frozenset`` of plain data,
each of *exactly* that type, at most :data:`MAX_DEPTH` containers deep (not counting the message's
own envelope, see :func:`dumps`). Anything else - an object with its own ``__eq__``, a generator, a
function - is refused by :func:`dumps`. A sender may let instances of *subclasses* of those types
(``OrderedDict``, ``Counter``, a namedtuple, numpy's ``float64``) cross as their base type's own
data (``subclasses=True``: the candidate's replies), read with the base type's methods, so that no
method of the subclass (its ``__eq__``, ``__iter__``, ``__str__``) plays any part.

The wire format is JSON (ASCII) with one-key objects as type tags (``{"t": [...]}`` a tuple,
``{"d": [[k, v], ...]}`` a dict, ``{"s": ...}`` a set, ``{"f": ...}`` a frozenset, ``{"b": hex}``
bytes, ``{"c": [re, im]}`` complex, ``{"i": hex}`` an int of more than 64 bits). :func:`loads` is
the side that matters: it reads bytes written by a hostile program, so it parses with the standard
``json`` parser (pure data, no code paths chosen by the input, unlike ``marshal.loads``, which is
documented as unsafe on malicious data) and builds only exact builtin types, or raises ``ValueError``.

This file runs inside the sandbox (copied in by the launcher, imported as ``plain``) and is
imported by the caller's tests; it uses the standard library only.
"""
import json
import os

MAX_DEPTH = 100
#: Largest message either side accepts (bytes); a longer reply is an error, not a read.
MAX_MESSAGE = 16 * 2**20
_HEADER = 4  # big-endian length before each message


class NotPlain(TypeError):
    """The value is not plain data (its type name is the message)."""


class TooDeep(NotPlain):
    """The value is plain data nested deeper than :data:`MAX_DEPTH` containers."""


#: The plain base types a subclass instance crosses as (``subclasses=True``), each with the base method that
#: copies an instance's own storage into an exact instance of the base type without calling a method of the
#: subclass (``dict.copy`` would call an overridden ``keys``: a dict subclass's pairs are read by :func:`_own_items`).
_AS_BASE = ((int, int.__int__), (float, float.__float__), (complex, complex.__complex__), (str, str.__str__),
            (bytes, bytes.__bytes__), (list, list.copy), (tuple, lambda x: tuple.__getitem__(x, slice(None))),
            (set, set.copy), (frozenset, frozenset.copy))
_PLAIN = frozenset((type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset))


def _pack(x, depth, subclasses=False):
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if subclasses and t not in _PLAIN:
        if issubclass(t, dict):  # (type(x), not isinstance: an object's __class__ can lie)
            return _pack_pairs(_own_items(x), depth, subclasses)
        for base, copy in _AS_BASE:
            if issubclass(t, base):
                return _pack(copy(x), depth, subclasses)
    if t is int:
        return x if x.bit_length() <= 64 else {"i": format(x, "x")}
    if t is float:
        return x
    if t is bytes:
        return {"b": x.hex()}
    if t is complex:
        return {"c": [x.real, x.imag]}
    if depth >= MAX_DEPTH:
        raise TooDeep("nested deeper than %d" % MAX_DEPTH)
    if t is list:
        return [_pack(v, depth + 1, subclasses) for v in x]
    if t is tuple:
        return {"t": [_pack(v, depth + 1, subclasses) for v in x]}
    if t is dict:
        return _pack_pairs(x.items(), depth, subclasses)
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [_pack(v, depth + 1, subclasses) for v in x]}
    raise NotPlain(t.__name__)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class written in Python


def _own_items(x):
    """The pairs of ``x`` (a dict subclass) as the nearest built-in class of its type reads them (``dict.items``;
    an ``OrderedDict``'s own order): no method written in Python, the candidate's, plays a part."""
    cls = next(c for c in type(x).__mro__ if not c.__flags__ & _HEAPTYPE)
    return cls.items(x)


def _pack_pairs(items, depth, subclasses):
    """A dict's ``items`` (a ``dict_items`` view) at ``depth``."""
    if depth >= MAX_DEPTH:
        raise TooDeep("nested deeper than %d" % MAX_DEPTH)
    return {"d": [[_pack(k, depth + 1, subclasses), _pack(v, depth + 1, subclasses)] for k, v in items]}


def dumps(x, envelope: int = 0, subclasses: bool = False) -> bytes:
    """``x`` as bytes; raises :class:`NotPlain` if any part of it is not plain data. The outer
    ``envelope`` levels of containers do not count towards :data:`MAX_DEPTH`: a value may cross
    in a request ``(args, kwargs)`` (envelope 2) as deep as in a reply ``("ok", value)``
    (envelope 1). ``subclasses``: an instance of a subclass of a plain type crosses as its base
    type's own data (see :data:`_AS_BASE`) instead of being refused."""
    return json.dumps(_pack(x, -envelope, subclasses), separators=(",", ":")).encode("ascii")


def _tagged(obj):
    if len(obj) != 1:
        raise ValueError("not a type tag")
    (tag, v), = obj.items()
    if tag == "t" and type(v) is list:
        return tuple(v)
    if tag == "d" and type(v) is list:
        if not all(type(p) is list and len(p) == 2 for p in v):
            raise ValueError("malformed dict")
        return {p[0]: p[1] for p in v}
    if tag in ("s", "f") and type(v) is list:
        return set(v) if tag == "s" else frozenset(v)
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(p) is float for p in v):
        return complex(v[0], v[1])
    if tag == "i" and type(v) is str and v.lstrip("-").isalnum():
        return int(v, 16)  # linear in the length, unlike a decimal string
    raise ValueError("unknown type tag")


def loads(data: bytes):
    """The plain value ``data`` encodes; ``ValueError`` for anything malformed or too deep."""
    if type(data) is not bytes or len(data) > MAX_MESSAGE:
        raise ValueError("not a message")
    try:
        return json.loads(data.decode("ascii"), object_hook=_tagged)
    except (ValueError, TypeError, RecursionError, MemoryError) as e:  # TypeError: unhashable key
        raise ValueError("malformed message: %s" % type(e).__name__) from None


def _read_exactly(fd, n):
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise EOFError("the other process closed the channel")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_message(fd: int) -> bytes:
    """One length-prefixed message from ``fd``; ``EOFError`` at end of stream, ``ValueError`` if
    it announces more than :data:`MAX_MESSAGE` bytes."""
    n = int.from_bytes(_read_exactly(fd, _HEADER), "big")
    if n > MAX_MESSAGE:
        raise ValueError("message of %d bytes is over the %d-byte limit" % (n, MAX_MESSAGE))
    return _read_exactly(fd, n)


def write_message(fd: int, body: bytes) -> None:
    """Write ``body`` with its length prefix to ``fd``."""
    if len(body) > MAX_MESSAGE:
        raise ValueError("message of %d bytes is over the %d-byte limit" % (len(body), MAX_MESSAGE))
    data = memoryview(len(body).to_bytes(_HEADER, "big") + body)
    while data:
        data = data[os.write(fd, data):]
