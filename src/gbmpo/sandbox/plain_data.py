"""Plain data between the program's process and the judge: a safe encoding, never pickle.

The sandbox runs the trusted tests in a *judge* process that never loads the program; each call
of a program name crosses to the program's process and back as plain data in this encoding
(:mod:`gbmpo.sandbox.worker`). It is JSON in which Python's ``None``, ``bool``, ``int``,
``float`` (``nan``, ``inf`` and ``-0.0`` included, exactly: JSON ``true`` is never ``1``) and
``str`` are themselves, a ``list`` is a JSON array, and everything else is a JSON object with
exactly one key, its tag:

=========  ================================  =========  ================================
tag        value                             tag        value
=========  ================================  =========  ================================
``t``      tuple                             ``s``      set
``fs``     frozenset                         ``d``      dict, as ``[[key, value], ...]``
``b``      bytes (latin-1 text)              ``ba``     bytearray
``c``      complex ``[re, im]``              ``r``      range ``[start, stop, step]``
``C``      Counter                           ``O``      OrderedDict
``dd``     defaultdict ``[factory, pairs]``  ``q``      deque ``[items, maxlen]``
``F``      Fraction ``[num, den]``           ``D``      Decimal (text)
``date``   ``datetime``, ``time``: ISO text  ``td``     timedelta ``[d, s, us]``
``it``     an iterator or generator, drawn   ``dk``,    dict views ``keys()``,
           into a list (the judge gets       ``dv``,    ``values()``, ``items()``
           ``iter`` of it)                   ``di``
``re``     compiled pattern ``[p, flags]``   ``m``      match ``[p, flags, string, start,
                                                        end, pos, endpos]``
``std``    a standard-library object         ``h``      a handle: an object that stays in
           ``[module, qualname]`` (modules:             the program's process, by number
           qualname ``""``)                  ``p``      a program name
=========  ================================  =========  ================================

Only exact types encode as values (a subclass of ``int`` or ``list`` does not); whatever else
the program returns becomes a *handle* (see the worker), never a value. Decoding validates every
tag's payload, so a malformed answer is refused (:class:`NotPlain`), never half-built. This module
uses the standard library only: the worker's launcher ships its text into the sandbox, like
:mod:`gbmpo.sandbox.strict_compare`.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import importlib
import json
import re
import sys

__all__ = [
    "DENIED_BUILTINS",
    "DENIED_MODULES",
    "MAX_ITEMS",
    "NotPlain",
    "TooLarge",
    "make_decoder",
    "make_encoder",
    "resolve_std",
    "std_ref",
]

#: elements drawn at most from one iterator the program returns (an endless one fails)
MAX_ITEMS = 1_000_000
#: standard-library modules the judge never imports or hands out on the program's say-so (side
#: effects on import, or power over the process: a name of the program bound to one of these is
#: reached through the program's process instead)
DENIED_MODULES = frozenset((
    "this", "antigravity", "idlelib", "tkinter", "turtle", "turtledemo", "__hello__",
    "__phello__", "webbrowser", "pydoc", "os", "posix", "sys", "gc", "ctypes", "_ctypes",
    "subprocess", "signal", "pty", "shutil", "importlib", "inspect", "code", "codeop", "pdb",
    "runpy", "multiprocessing", "threading", "_thread", "socket", "io", "_io", "faulthandler",
    "resource", "fcntl", "mmap", "tracemalloc", "pathlib", "tempfile", "atexit", "marshal",
    "pickle", "_pickle", "shelve", "sqlite3", "select", "selectors", "asyncio", "posixpath",
))
#: builtins the judge never hands out on the program's say-so
DENIED_BUILTINS = frozenset((
    "exec", "eval", "compile", "open", "__import__", "breakpoint", "input", "exit", "quit",
    "help", "globals", "locals", "vars", "setattr", "delattr", "getattr", "memoryview",
    "__build_class__", "__loader__", "__spec__",
))
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"builtins"}


class NotPlain(ValueError):
    """A value that is not plain data, or a malformed encoding."""


class TooLarge(NotPlain):
    """A value over the size cap (bytes, iterator length or nesting depth)."""


def _handed_out(mod, qual):
    """True iff the judge resolves ``mod``/``qual`` (a standard-library name not denied)."""
    top = mod.partition(".")[0]
    return (top in _STDLIB and top not in DENIED_MODULES and "<" not in qual
            and not (mod == "builtins" and qual.partition(".")[0] in DENIED_BUILTINS))


def std_ref(obj):
    """``[module, qualname]`` when ``obj`` is a standard-library module, class or function
    found again by that name (identity) that the judge hands out (:func:`resolve_std`); else
    None (the object then travels as a handle)."""
    if type(obj) is type(sys):
        name = getattr(obj, "__name__", None)
        if type(name) is str and _handed_out(name, "") and sys.modules.get(name) is obj:
            return [name, ""]
        return None
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if type(mod) is not str or type(qual) is not str or not _handed_out(mod, qual):
        return None
    try:
        found = sys.modules.get(mod)
        for part in qual.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - not found again: not a reference
        return None
    return [mod, qual] if found is obj else None


def resolve_std(mod, qual):
    """The standard-library object named ``mod``/``qual`` (imported here); NotPlain when it is
    not one or its module is in :data:`DENIED_MODULES`."""
    if type(mod) is not str or type(qual) is not str:
        raise NotPlain("bad standard-library reference")
    if not _handed_out(mod, qual):
        raise NotPlain(f"not a standard-library name the judge hands out: {mod}.{qual}")
    try:
        found = importlib.import_module(mod)
        for part in qual.split(".") if qual else ():
            found = getattr(found, part)
    except Exception as exc:  # noqa: BLE001
        raise NotPlain(f"cannot resolve {mod}.{qual}") from exc
    return found


def _not_plain(obj):
    raise NotPlain(f"not plain data: {type(obj).__name__}")


def make_encoder(other=_not_plain, max_bytes=16 << 20, draw_iterators=True):
    """``dumps(value) -> bytes``: the encoding of ``value``; ``other(obj)`` gives the tag object
    of anything that is not plain data (a handle, a reference) or raises :class:`NotPlain`
    (the default). Iterators are drawn into a list (at most :data:`MAX_ITEMS`) when
    ``draw_iterators``, else handed to ``other``. Raises :class:`TooLarge` past ``max_bytes``
    bytes."""
    _dumps = json.dumps
    counter, ordered, ddict, deque = (collections.Counter, collections.OrderedDict,
                                      collections.defaultdict, collections.deque)
    fraction, dec = fractions.Fraction, decimal.Decimal
    date, dtime, time, tdelta = (datetime.date, datetime.datetime, datetime.time,
                                 datetime.timedelta)
    pattern, match = re.Pattern, re.Match
    views = {type({}.keys()): "dk", type({}.values()): "dv", type({}.items()): "di"}
    scalar = (int, float, str, bool, type(None))

    def pairs(d):
        return [[enc(k), enc(v)] for k, v in d.items()]

    def enc(x):
        t = type(x)
        if t in scalar:
            return x
        if t is list:
            return [enc(v) for v in x]
        if t is tuple:
            return {"t": [enc(v) for v in x]}
        if t is dict:
            return {"d": pairs(x)}
        if t is set:
            return {"s": [enc(v) for v in x]}
        if t is frozenset:
            return {"fs": [enc(v) for v in x]}
        if t is bytes:
            return {"b": x.decode("latin-1")}
        if t is bytearray:
            return {"ba": x.decode("latin-1")}
        if t is complex:
            return {"c": [x.real, x.imag]}
        if t is range:
            return {"r": [x.start, x.stop, x.step]}
        if t is counter:
            return {"C": pairs(x)}
        if t is ordered:
            return {"O": pairs(x)}
        if t is ddict:
            f = x.default_factory
            return {"dd": [None if f is None else enc(f), pairs(x)]}
        if t is deque:
            return {"q": [[enc(v) for v in x], x.maxlen]}
        if t is fraction:
            return {"F": [x.numerator, x.denominator]}
        if t is dec:
            return {"D": str(x)}
        if t is dtime:
            return {"datetime": x.isoformat()}
        if t is date:
            return {"date": x.isoformat()}
        if t is time:
            return {"time": x.isoformat()}
        if t is tdelta:
            return {"td": [x.days, x.seconds, x.microseconds]}
        if t is pattern:
            return {"re": [enc(x.pattern), x.flags]}
        if t is match:
            return {"m": [enc(x.re.pattern), x.re.flags, enc(x.string), x.start(), x.end(),
                          x.pos, x.endpos]}
        if t in views:
            return {views[t]: [enc(v) for v in x]}
        ref = std_ref(x)
        if ref is not None:
            return {"std": ref}
        if draw_iterators and hasattr(t, "__next__") and hasattr(t, "__iter__"):
            items = []
            for v in x:
                if len(items) >= MAX_ITEMS:
                    raise TooLarge(f"an iterator of more than {MAX_ITEMS} items")
                items.append(enc(v))
            return {"it": items}
        return other(x)

    def dumps(value):
        try:
            data = _dumps(enc(value), separators=(",", ":")).encode("utf-8")
        except RecursionError:
            raise TooLarge("nested too deeply") from None
        except ValueError as exc:  # an int too long to print
            if isinstance(exc, NotPlain):
                raise
            raise TooLarge(str(exc)) from None
        if len(data) > max_bytes:
            raise TooLarge(f"{len(data)} bytes (cap {max_bytes})")
        return data

    return dumps


def make_decoder(handle, name):
    """``loads(bytes) -> value``: decodes the encoding above, validating every payload;
    ``handle(n)`` and ``name(text)`` give the objects of ``h`` and ``p`` tags. Raises
    :class:`NotPlain` on anything malformed."""
    L, S, I = list, str, int  # noqa: N806

    def need(ok, what):
        if not ok:
            raise NotPlain(f"malformed {what}")

    def seq(v, what):
        need(type(v) is L, what)
        return v

    def kv(v, what):
        for p in seq(v, what):
            need(type(p) is L and len(p) == 2, what)
        return v

    def seq2(v, what):
        need(type(v) is L and len(v) == 2, what)
        return v

    def num(v):
        return type(v) in (I, float)

    def d_ctor(cls):
        return lambda v: cls(dict((k, x) for k, x in kv(v, "dict")))

    def dd(v):
        need(type(v) is L and len(v) == 2, "defaultdict")
        need(v[0] is None or callable(v[0]), "defaultdict factory")
        return collections.defaultdict(v[0], ((k, x) for k, x in kv(v[1], "defaultdict")))

    def deque(v):
        need(type(v) is L and len(v) == 2 and (v[1] is None or type(v[1]) is I), "deque")
        return collections.deque(seq(v[0], "deque"), v[1])

    def ints(v, n, what):
        need(type(v) is L and len(v) == n and all(type(x) is I for x in v), what)
        return v

    def txt(v, what):
        need(type(v) is S, what)
        return v

    def compiled(p, flags):
        need(type(p) in (S, bytes) and type(flags) is I, "pattern")
        return re.compile(p, flags)

    def match(v):
        need(type(v) is L and len(v) == 7, "match")
        p, flags, s, start, end, pos, endpos = v
        need(type(s) is type(p) and all(type(x) is I for x in (start, end, pos, endpos)),
             "match")
        m = compiled(p, flags).match(s, start, endpos)
        need(m is not None and m.span() == (start, end), "match (not found again)")
        return m

    def std(v):
        need(type(v) is L and len(v) == 2, "reference")
        return resolve_std(v[0], v[1])

    def fraction(v):
        a, b = ints(v, 2, "fraction")
        need(b != 0, "fraction")
        return fractions.Fraction(a, b)

    def complex_(v):
        need(type(v) is L and len(v) == 2 and num(v[0]) and num(v[1]), "complex")
        return complex(v[0], v[1])

    table = {
        "t": lambda v: tuple(seq(v, "tuple")),
        "s": lambda v: set(seq(v, "set")),
        "fs": lambda v: frozenset(seq(v, "frozenset")),
        "d": d_ctor(dict),
        "C": d_ctor(collections.Counter),
        "O": d_ctor(collections.OrderedDict),
        "dd": dd,
        "q": deque,
        "b": lambda v: txt(v, "bytes").encode("latin-1"),
        "ba": lambda v: bytearray(txt(v, "bytearray").encode("latin-1")),
        "c": complex_,
        "r": lambda v: range(*ints(v, 3, "range")),
        "F": fraction,
        "D": lambda v: decimal.Decimal(txt(v, "decimal")),
        "date": lambda v: datetime.date.fromisoformat(txt(v, "date")),
        "datetime": lambda v: datetime.datetime.fromisoformat(txt(v, "datetime")),
        "time": lambda v: datetime.time.fromisoformat(txt(v, "time")),
        "td": lambda v: datetime.timedelta(*ints(v, 3, "timedelta")),
        "it": lambda v: iter(seq(v, "iterator")),
        "dk": lambda v: dict.fromkeys(seq(v, "keys")).keys(),
        "dv": lambda v: dict(enumerate(seq(v, "values"))).values(),
        "di": lambda v: dict((k, x) for k, x in kv(v, "items")).items(),
        "re": lambda v: compiled(*seq2(v, "pattern")),
        "m": match,
        "std": std,
        "h": lambda v: handle(v) if type(v) is I else need(False, "handle"),
        "p": lambda v: name(txt(v, "name")),
    }

    def hook(obj):
        need(len(obj) == 1, "tag")
        ((tag, v),) = obj.items()
        f = table.get(tag)
        need(f is not None, f"tag {tag!r}")
        return f(v)

    def loads(data):
        try:
            return json.loads(data, object_hook=hook)
        except NotPlain:
            raise
        except (ValueError, TypeError, RecursionError, OverflowError, re.error,
                decimal.InvalidOperation, UnicodeError, MemoryError) as exc:
            raise NotPlain(f"malformed: {type(exc).__name__}") from None

    return loads
