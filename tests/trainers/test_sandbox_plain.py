"""The plain-data codec between the test process and the candidate process (child/plain.py).

``loads`` reads bytes written by a hostile program: whatever it is given, it returns a value made
of exact builtin types only, or raises ValueError.
"""
from __future__ import annotations

import math
import os
import random

import pytest

from gradscope.trainers.sandbox.child import plain

PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


def assert_plain(x, depth=0):
    assert type(x) in PLAIN_TYPES, type(x)
    assert depth <= plain.MAX_DEPTH + 1
    if type(x) in (list, tuple, set, frozenset):
        for v in x:
            assert_plain(v, depth + 1)
    elif type(x) is dict:
        for k, v in x.items():
            assert_plain(k, depth + 1)
            assert_plain(v, depth + 1)


def same(a, b) -> bool:
    """Equal, with exactly the same types all the way down (1 == 1.0 == True is not enough)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) is complex:
        return same(a.real, b.real) and same(a.imag, b.imag)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


VALUES = [
    None, True, False, 0, -1, 2**64, -(2**200) + 7, 10**5000, 0.1, -0.0, float("inf"), float("nan"),
    1e-310, 3 + 4j, complex(float("nan"), -0.0), "", "héllo \ud800 \x00", b"", b"\x00\xff",
    [], (), {}, set(), frozenset(), [1, [2, [3.5, "x"]]], (1,), ((),), {"a": 1, 2: "b", (3, 4): [5]},
    {1, 2.5, "s", (1, 2), frozenset({3})}, frozenset({None, b"b"}), [True, 1, 1.0],
    {"nested": {"deep": [{"t": 1}, {"d": [[1, 2]]}]}},  # dicts that look like type tags
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_plain_values_cross_unchanged(value):
    back = plain.loads(plain.dumps(value))
    assert same(back, value), (value, back)
    assert_plain(back)


class Always:
    def __eq__(self, other):
        return True


class MyInt(int):
    pass


def _cycle():
    x = []
    x.append(x)
    return x


@pytest.mark.parametrize("value", [
    Always(), [1, Always()], {"k": Always()}, MyInt(3), (1, MyInt(3)), lambda: 1, print,
    (i for i in range(3)), bytearray(b"x"), range(3), object, _cycle(), {MyInt(1): 2},
], ids=lambda v: type(v).__name__)
def test_other_values_are_refused(value):
    with pytest.raises(plain.NotPlain):
        plain.dumps(value)


class Lying(float):
    """A float subclass whose every method lies: only its own data may cross."""
    def __eq__(self, other):
        return True

    def __float__(self):
        return 42.0

    def __repr__(self):
        return "42.0"


class LyingStr(str):
    def __str__(self):
        return "forged"

    def __iter__(self):
        return iter("forged")


class LyingDict(dict):
    def items(self):
        return [("forged", 1)]

    def copy(self):
        return {"forged": 1}

    def __iter__(self):  # (dict.copy then reads keys() and __getitem__)
        return iter(["forged"])

    def keys(self):
        return ["forged"]

    def __getitem__(self, key):
        return 99


class Liar:
    """Claims to be a dict (``isinstance`` believes ``__class__``; the codec must not)."""
    __class__ = dict

    def __eq__(self, other):
        return True


def test_a_reply_crosses_subclasses_as_their_own_data():
    from collections import Counter, OrderedDict, defaultdict, namedtuple
    from enum import IntEnum

    pair = namedtuple("pair", "a b")
    Colour = IntEnum("Colour", "RED GREEN")
    value = [Counter("aab"), OrderedDict(x=1), defaultdict(list, {1: [2]}), pair(1, MyInt(2)), Colour.GREEN,
             Lying(1.5), LyingStr("abc"), LyingDict(k=MyInt(7)), {MyInt(1): frozenset({MyInt(3)})}]
    back = plain.loads(plain.dumps(value, subclasses=True))
    assert_plain(back)
    assert same(back, [{"a": 2, "b": 1}, {"x": 1}, {1: [2]}, (1, 2), 2, 1.5, "abc", {"k": 7}, {1: frozenset({3})}])
    for refused in (Always(), Liar(), [Liar()], MyInt):  # subclasses of nothing plain, a lying __class__, a type
        with pytest.raises(plain.NotPlain):
            plain.dumps(refused, subclasses=True)
    class LyingOrdered(OrderedDict):
        def __iter__(self):
            return iter(["forged"])

        def items(self):
            return [("forged", 1)]

    lru = LyingOrdered(a=1, b=2, c=3)
    lru.move_to_end("a")  # an OrderedDict crosses in its own order, read by OrderedDict's (built-in) items
    assert list(plain.loads(plain.dumps(lru, subclasses=True)).items()) == [("b", 2), ("c", 3), ("a", 1)]
    # an int subclass is no container: it may sit as deep as an int; a dict subclass is one
    assert plain.loads(plain.dumps(_nest(MyInt(5), plain.MAX_DEPTH), subclasses=True)) == _nest(5, plain.MAX_DEPTH)
    with pytest.raises(plain.TooDeep):
        plain.dumps(_nest(LyingDict(k=1), plain.MAX_DEPTH), subclasses=True)


def _nest(x, n):
    for _ in range(n):
        x = [x]
    return x


def test_depth_limit():
    deep = []
    for _ in range(plain.MAX_DEPTH):
        deep = [deep]
    with pytest.raises(plain.NotPlain):
        plain.dumps(deep)
    assert plain.loads(plain.dumps(deep[0])) == deep[0]


@pytest.mark.parametrize("data", [
    b'{"a": 1, "b": 2}', b'{"x": 1}', b'{"d": [[[1], 2]]}', b'{"s": [[1]]}', b'{"d": [[1]]}',
    b'{"b": "zz"}', b'{"c": [1, 2]}', b'{"i": "1_0"}', b"[" * 100_000, b"9" * 5000, b"\xff\xfe",
    b"", b"[1,", b"NaN NaN", "\"\u00e9\"".encode(), b'{"t": 5}',
])
def test_malformed_messages_are_refused(data):
    with pytest.raises(ValueError):
        plain.loads(data)


def test_fuzz_loads_returns_plain_data_or_refuses():
    """Mutations of valid messages and random bytes (seeded): never a non-plain value, never any
    exception other than ValueError."""
    rng = random.Random(15)
    seeds = [plain.dumps(v) for v in VALUES]
    alphabet = b'{}[]",:0123456789.eE-+ tdsfbci truefalsenullNaNInfinity\\u'
    accepted = 0
    for i in range(600):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            op, pos = rng.randrange(3), rng.randrange(len(data) + 1)
            if op == 0:
                data[pos:pos] = bytes([rng.choice(alphabet)])
            elif op == 1 and data:
                del data[min(pos, len(data) - 1)]
            elif data:
                data[min(pos, len(data) - 1)] = rng.choice(alphabet)
        if i % 5 == 0:
            data = bytearray(rng.randbytes(rng.randrange(40)))
        try:
            value = plain.loads(bytes(data))
        except ValueError:
            continue
        assert_plain(value)
        accepted += 1
    assert 0 < accepted < 600  # both outcomes were exercised


def test_framing_over_a_pipe():
    r, w = os.pipe()
    try:
        plain.write_message(w, plain.dumps([1, "two"]))
        assert plain.loads(plain.read_message(r)) == [1, "two"]
        os.write(w, (plain.MAX_MESSAGE + 1).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="over the"):
            plain.read_message(r)
        os.write(w, (10).to_bytes(4, "big") + b"short")
        os.close(w)
        w = -1
        with pytest.raises(EOFError):
            plain.read_message(r)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
