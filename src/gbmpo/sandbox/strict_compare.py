"""Type-strict comparisons for the trusted test code: the sandbox's reward-hacking defences.

Both halves of the feature live here, so that the names that tie them together are defined once
(:data:`HELPER_NAMES`):

* the **rewrite** (host side): :func:`strict_test_source` compiles a test with ``==``, ``!=``,
  ``in``, ``not in``, ``<``, ``<=``, ``>``, ``>=`` and the truth of every ``assert`` turned
  into calls of four helpers;
* the **helpers** (sandbox side): :func:`strict_helpers` builds those four functions inside the
  sandbox worker, before the untrusted program runs. They compare builtin values by kind
  (numbers with numbers, strings with strings, containers element by element) and refuse what a
  program could have redefined: an object whose ``__eq__`` is always true, a subclass of ``int``
  or ``str`` with its own ``__eq__``, ``True`` for an expected ``1`` (or ``1`` for ``True``:
  equal only by coercion), an object with ``__bool__`` or ``__lt__`` always true.

This module uses the standard library only and is not imported inside the sandbox: the worker's
launcher (:func:`gbmpo.sandbox.isolation.worker_program`) ships its text to the sandbox
interpreter together with :mod:`gbmpo.sandbox.worker`. See :mod:`gbmpo.sandbox.client` for the
documented limits of these defences.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import threading

__all__ = ["HELPER_NAMES", "KIND_NAMES", "kind_table", "strict_helpers", "strict_test_source"]

#: the four helpers a rewritten test calls: equality, membership, ordering, truth
EQ, IN, ORDER, TRUTH = "__gbmpo_eq__", "__gbmpo_in__", "__gbmpo_order__", "__gbmpo_bool__"
HELPER_NAMES = (EQ, IN, ORDER, TRUTH)

# --------------------------------------------------------------------------------------------
# the rewrite (host side)

_STRICT_ORDER = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}


def _helper_call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


def _strict_truth(expr: ast.expr) -> ast.expr:
    """The condition of an ``assert``: the truth helper on every operand of and/or/not."""
    if isinstance(expr, ast.BoolOp):
        expr.values = [_strict_truth(v) for v in expr.values]
        return expr
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr.operand = _strict_truth(expr.operand)
        return expr
    if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name)
            and expr.func.id in HELPER_NAMES):
        return expr
    return _helper_call(TRUTH, expr)


class _StrictRewriter(ast.NodeTransformer):
    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        if len(node.ops) != 1:  # chains keep Python's semantics
            return node
        op, left, right = node.ops[0], node.left, node.comparators[0]
        if isinstance(op, (ast.Eq, ast.NotEq)):
            eq = _helper_call(EQ, left, right)
            return eq if isinstance(op, ast.Eq) else ast.UnaryOp(op=ast.Not(), operand=eq)
        if isinstance(op, (ast.In, ast.NotIn)):
            isin = _helper_call(IN, left, right)
            return isin if isinstance(op, ast.In) else ast.UnaryOp(op=ast.Not(), operand=isin)
        sym = _STRICT_ORDER.get(type(op))
        if sym is not None:
            return _helper_call(ORDER, left, right, ast.Constant(sym))
        return node

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        self.generic_visit(node)
        node.test = _strict_truth(node.test)
        return node


#: one ``ast.parse`` at a time in this process: CPython 3.11's AST constructor (3.11.7 here)
#: tracks its recursion depth in state the threads share, so two parses at once
#: (``Sandbox.run_many``'s thread pool) can fail with "SystemError: AST constructor recursion
#: depth mismatch"
_PARSE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4096)
def strict_test_source(source: str) -> str:
    """Trusted test code rewritten with type-strict comparisons (cached: a group's G programs
    share their tests).

    ``a == b`` -> ``__gbmpo_eq__(a, b)``, ``a != b`` -> ``not __gbmpo_eq__(a, b)``, ``x in c`` /
    ``not in`` -> ``__gbmpo_in__``, ``<``/``<=``/``>``/``>=`` -> ``__gbmpo_order__``, and the
    condition of every ``assert`` (through ``and``, ``or``, ``not``) -> ``__gbmpo_bool__``; the
    sandbox worker defines the four helpers (:func:`strict_helpers`). Source that does not
    parse is returned unchanged (that test then fails with its ``SyntaxError``).
    """
    try:
        with _PARSE_LOCK:
            tree = ast.parse(source, "<test>", "exec")
    except (SyntaxError, ValueError):
        return source
    return ast.unparse(ast.fix_missing_locations(_StrictRewriter().visit(tree)))


# --------------------------------------------------------------------------------------------
# the helpers (sandbox side)

# Types whose comparisons cannot be redefined by a program, grouped into kinds: values of one
# kind compare by value (``1 == 1.0``; a Counter equals the dict with the same items), values of
# different kinds never compare equal (``True == 1`` and ``1 == True`` are False here). Anything
# else (a class the program defined, a subclass of a builtin, an object from a module the program
# imported) equals only an object of its own exact type, by that type's own ``__eq__``.
KIND_NAMES = (
    ("bool", ("builtins.bool",)),
    ("num", ("builtins.int", "builtins.float", "fractions.Fraction", "decimal.Decimal")),
    ("complex", ("builtins.complex",)),
    ("str", ("builtins.str",)),
    ("bytes", ("builtins.bytes", "builtins.bytearray")),
    ("none", ("builtins.NoneType",)),
    ("list", ("builtins.list",)),
    ("tuple", ("builtins.tuple",)),
    ("deque", ("collections.deque",)),
    ("dict", ("builtins.dict", "collections.OrderedDict", "collections.defaultdict",
              "collections.Counter")),
    ("set", ("builtins.set", "builtins.frozenset")),
    ("same", ("builtins.range", "datetime.date", "datetime.datetime", "datetime.time",
              "datetime.timedelta", "re.Match", "re.Pattern")),
)
_SCALAR_KINDS = frozenset(("bool", "num", "complex", "str", "bytes", "none"))


def kind_table():
    """``{type: kind}`` of :data:`KIND_NAMES`, resolved now (before any program runs)."""
    # local: bound here, before any program runs, so a program cannot patch it
    import importlib

    table = {}
    for kind, names in KIND_NAMES:
        for dotted in names:
            mod, _, attr = dotted.rpartition(".")
            if mod == "builtins" and attr == "NoneType":
                table[type(None)] = kind
                continue
            with contextlib.suppress(Exception):
                table[getattr(importlib.import_module(mod), attr)] = kind
    return table


def strict_helpers(kinds):
    """The trusted comparison functions the rewritten tests call, by their names in
    :data:`HELPER_NAMES` (``kinds``: :func:`kind_table`).

    Every global they use is bound here, before the program runs, so that patching builtins or
    modules cannot change them.
    """
    # local: bound here, before any program runs, so a program cannot patch it
    import operator

    _type, _len, _zip, _all, _any, _bool = type, len, zip, all, any, bool
    _te = TypeError
    _ops = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
    scalar = _SCALAR_KINDS
    get = kinds.get

    def plain(x):
        k = get(_type(x))
        if k in scalar:
            return True
        if k in ("tuple", "set"):
            return _all(plain(v) for v in x)
        return False

    def eq(a, b):
        if a is b:
            return True
        kind_a, kind_b = get(_type(a)), get(_type(b))
        if kind_a is None or kind_b is None:
            # an unlisted type equals only its own type, by its own __eq__ (a documented limit)
            return _type(a) is _type(b) and (a == b) is True
        if kind_a != kind_b:
            return False
        if kind_a in scalar:
            return _bool(a == b)
        if kind_a == "same":
            return _type(a) is _type(b) and _bool(a == b)
        if kind_a in ("list", "tuple", "deque"):
            return _len(a) == _len(b) and _all(eq(x, y) for x, y in _zip(a, b))
        if kind_a == "dict":
            if _len(a) != _len(b) or not _all(plain(k) for k in a):
                return False
            return _all(k in b and eq(a[k], b[k]) for k in a)
        # sets: plain elements only, then the builtin comparison
        return plain(a) and plain(b) and _bool(a == b)

    def contains(item, container):
        k = get(_type(container))
        if k in ("str", "bytes") and get(_type(item)) == k:
            return item in container
        if k in ("list", "tuple", "deque", "set", "dict"):
            return _any(eq(item, v) for v in container)
        if k == "same" and _type(container) is range and get(_type(item)) == "num":
            return item in container
        raise _te(f"membership test on an unlisted type {_type(container).__name__}")

    def order(a, b, op):
        ka, kb = get(_type(a)), get(_type(b))
        flat = (
            ka in scalar
            or ka in ("list", "tuple", "set") and _all(plain(v) for v in a)
            and _all(plain(v) for v in b)
            or ka == "same" and _type(a) is _type(b)
        )
        if ka is None or ka != kb or not flat:
            raise _te(f"ordering of {_type(a).__name__} and {_type(b).__name__} refused")
        return _bool(_ops[op](a, b))

    def truth(x):
        if get(_type(x)) is None:
            raise _te(f"truth value of an unlisted type {_type(x).__name__} refused")
        return _bool(x)

    return {EQ: eq, IN: contains, ORDER: order, TRUTH: truth}
