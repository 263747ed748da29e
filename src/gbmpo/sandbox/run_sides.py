"""The two sides of a sandbox run: the program's process and the judge.

Part of the sandbox worker (:mod:`gbmpo.sandbox.worker`), shipped with it as text by
:func:`gbmpo.sandbox.isolation.worker_program` and, like it, standard library only.
:func:`_program_side` runs the untrusted program and answers the judge's calls;
:func:`_judge_side` runs the trusted prelude, setup and tests (never the program), the calls of
program names crossing to the program's process as plain data (:mod:`gbmpo.sandbox.plain_data`),
and reports each verdict on the result channel; :func:`_judge_loop` is the judge's life, one run
after another. The worker forks both and supervises them.
"""

import builtins
import contextlib
import fcntl
import json
import os
import resource
import socket
import struct
import sys
import types

try:  # in the sandbox: the modules the launcher defined from their files' text
    import gbmpo_plain_data as plain_data
    import gbmpo_strict_compare as strict_compare
except ImportError:  # imported from an installed gbmpo (documentation, tests)
    from gbmpo.sandbox import plain_data, strict_compare

RESULT_FD = 3  # the judge's result channel (the program's process has no such descriptor)
_CALL_IN, _CALL_OUT = 3, 4  # the program's process: the judge's calls in, its answers out
_J_CALL_OUT, _J_CALL_IN = 5, 6  # the judge: calls out, answers in
_J_SOCK = 7  # the judge: a unix socket on which each run's two call pipes arrive
_HELPERS = None  # the strict comparison helpers, built once in the worker (every judge forks)


def build_strict_helpers():
    """Build the strict comparison helpers once, in the worker before it forks its children."""
    global _HELPERS
    _HELPERS = strict_compare.strict_helpers(strict_compare.kind_table())


def _frame_writer(fd):
    def send(data):
        view = memoryview(struct.pack(">I", len(data)) + data)
        while view:
            view = view[os.write(fd, view):]
    return send


def _frame_reader(fd, cap):
    def read_exact(n):
        chunks = []
        while n:
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv():
        head = read_exact(4)
        if head is None:
            return None
        n = struct.unpack(">I", head)[0]
        if n > cap:
            raise plain_data.TooLarge(f"a message of {n} bytes")
        return read_exact(n)
    return recv


#: answer envelopes: b'["v",VALUE,[[arg, VALUE], ...]]' (a value and the arguments the call
#: changed in place), b'["x",MODULE,QUALNAME,MESSAGE]' (the call raised), b'["big",TEXT]' (the
#: answer is over the cap); the first message is b'["names",[[NAME,KIND,PAYLOAD], ...]]' or
#: b'["error",TYPENAME]' (the program raised at top level)
_MUTABLE = (list, dict, set, bytearray)


def _program_side(req):
    """The program's process: run the program, describe its names, then answer the judge's calls
    (fd 3 in, fd 4 out) until the judge hangs up. Nothing here decides a verdict: every byte it
    writes is an answer that the judge decodes as plain data and judges itself."""
    send_frame, recv = _frame_writer(_CALL_OUT), _frame_reader(_CALL_IN, 1 << 30)
    handles, numbers = [], {}

    def send(data):  # the program's buffered output first, so that it is never lost
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        send_frame(data)

    def handle_of(obj):  # an object that stays here: the judge gets its number
        n = numbers.get(id(obj))
        if n is None:
            n = numbers[id(obj)] = len(handles)
            handles.append(obj)
        return {"h": n}

    def by_handle(n):
        if not 0 <= n < len(handles):
            raise plain_data.NotPlain("no such handle")
        return handles[n]

    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    ns = module.__dict__
    ns["__file__"] = "solution.py"

    def by_name(name):
        try:
            return ns[name]
        except KeyError:
            raise NameError(f"name {name!r} is not defined") from None

    cap = int(req["max_answer_bytes"])
    dumps = plain_data.make_encoder(handle_of, cap)
    dumps_value = plain_data.make_encoder(max_bytes=min(cap, 1 << 20), draw_iterators=False)
    loads = plain_data.make_decoder(by_handle, by_name)
    dumps_json = json.dumps
    try:
        exec(compile(req["code"], "solution.py", "exec"), ns)  # the untrusted program
    except BaseException as exc:  # noqa: BLE001 - reported to the judge
        send(dumps_json(["error", type(exc).__name__]).encode())
        return
    entries = []
    for name, value in list(ns.items()):
        if type(name) is not str or name.startswith("__"):
            continue
        ref = plain_data.std_ref(value)
        try:
            if ref is not None:
                entries.append(b'[%s,"std",%s]' % (dumps_json(name).encode(),
                                                   dumps_json(ref).encode()))
            else:
                entries.append(b'[%s,"val",%s]' % (dumps_json(name).encode(),
                                                   dumps_value(value)))
        except Exception:  # noqa: BLE001 - not plain data: the judge reaches it by name
            entries.append(b'[%s,"obj",null]' % dumps_json(name).encode())
    send(b'["names",[' + b",".join(entries) + b"]]")
    while True:
        msg = recv()
        if msg is None:
            return
        try:
            op = loads(msg)
            if op[0] == "c":
                args, kwargs = op[2], dict(op[3])
                before = {i: dumps(a) for i, a in enumerate(args) if type(a) in _MUTABLE}
                before.update((k, dumps(a)) for k, a in kwargs.items() if type(a) in _MUTABLE)
                value = dumps(op[1](*args, **kwargs))
                changed = []
                for key, old in before.items():
                    new = dumps(args[key] if type(key) is int else kwargs[key])
                    if new != old:
                        changed.append(b"[%s,%s]" % (dumps_json(key).encode(), new))
                answer = b'["v",%s,[%s]]' % (value, b",".join(changed))
            elif op[0] == "g":
                answer = b'["v",%s,[]]' % dumps(getattr(op[1], op[2]))
            else:
                setattr(op[1], op[2], op[3])
                answer = b'["v",null,[]]'
        except plain_data.TooLarge as exc:
            answer = dumps_json(["big", str(exc)[:200]]).encode()
        except BaseException as exc:  # noqa: BLE001 - the call raised: the judge re-raises
            t = type(exc)
            try:
                text = str(exc)[:2000]
            except BaseException:  # noqa: BLE001
                text = ""
            answer = dumps_json([
                "x", str(getattr(t, "__module__", "")), str(getattr(t, "__qualname__", "")), text,
            ]).encode()
        send(answer)


class _Unjudged(BaseException):
    """The test needed the program's own objects (compared, tested for truth...)."""


class _Gone(BaseException):
    """The program's process ended or broke the protocol."""


class ProgramError(Exception):
    """An exception of a class the judge does not have (defined by the program)."""


_SAFE_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


def _judge_side(req):
    """The judge: runs the trusted prelude, setup and tests, never the program, and reports each
    verdict with the run's marker on the result channel (fd 3). A name the program defined is a
    value (plain data) or a :class:`_Remote`: calls, attribute reads and writes cross to the
    program's process (fd 5 out, fd 6 in) as plain data; comparing, hashing or testing the truth
    of the program's own objects leaves the test unjudged."""

    write = os.write
    marker = req.pop("marker")
    cap = int(req["max_answer_bytes"])

    def emit(text):
        with contextlib.suppress(OSError):
            write(RESULT_FD, (marker + " " + text + "\n").encode())

    send, recv = _frame_writer(_J_CALL_OUT), _frame_reader(_J_CALL_IN, 4 * cap + (1 << 16))
    state = {"poison": None, "gone": None}
    remotes = {}

    def poison(kind):  # "unjudged" or "fail"; a failure is never downgraded
        if state["poison"] != "fail":
            state["poison"] = kind

    def unjudged(*_args):
        poison("unjudged")
        raise _Unjudged("the test needs the program's own objects")

    def gone(reason):
        state["gone"] = reason
        raise _Gone(reason)

    class _Remote:
        """An object that lives in the program's process (a name or a handle)."""

        __slots__ = ("_gbmpo_ref",)

        def __init__(self, ref):
            object.__setattr__(self, "_gbmpo_ref", ref)

        def __call__(self, *args, **kwargs):
            return ask(["c", self, list(args), [[k, v] for k, v in kwargs.items()]],
                       args, kwargs)

        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return ask(["g", self, attr])

        def __setattr__(self, attr, value):
            ask(["s", self, attr, value])

        def __eq__(self, other):
            return True if self is other else unjudged()

        def __ne__(self, other):
            return False if self is other else unjudged()

        __hash__ = object.__hash__
        __bool__ = __len__ = __iter__ = __contains__ = __getitem__ = __setitem__ = unjudged
        __delitem__ = __lt__ = __le__ = __gt__ = __ge__ = __str__ = __int__ = unjudged
        __float__ = __index__ = __neg__ = __abs__ = __add__ = __sub__ = __mul__ = unjudged

        def __repr__(self):
            return f"<the program's object {self._gbmpo_ref}>"

    def ref_of(obj):
        if type(obj) is _Remote:
            return obj._gbmpo_ref
        poison("unjudged")
        raise plain_data.NotPlain(f"a {type(obj).__name__} cannot be sent to the program")

    def remote_handle(n):
        r = remotes.get(n)
        if r is None:
            r = remotes[n] = _Remote({"h": n})
        return r

    def no_names(_name):
        raise plain_data.NotPlain("a name from the program's process")

    dumps = plain_data.make_encoder(ref_of, 1 << 62)
    loads = plain_data.make_decoder(remote_handle, no_names)

    def exception_class(mod, qual):
        cls = None
        with contextlib.suppress(Exception):
            cls = plain_data.resolve_std(mod, qual)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls
        return ProgramError

    def ask(msg, args=(), kwargs=None):
        try:
            data = dumps(msg)
        except plain_data.NotPlain:
            unjudged()
        try:
            send(data)
            reply = recv()
        except OSError:
            reply = None
        except plain_data.TooLarge:
            gone("sent an oversized answer")
        if reply is None:
            gone("exited")
        try:
            ans = loads(reply)
            kind = ans[0]
        except (plain_data.NotPlain, IndexError, TypeError, KeyError):
            poison("fail")
            raise AssertionError("malformed answer from the program") from None
        if kind == "v" and len(ans) == 3 and type(ans[2]) is list:
            for key, new in ans[2]:
                old = args[key] if type(key) is int and 0 <= key < len(args) else (
                    (kwargs or {}).get(key))
                if type(old) is not type(new):
                    continue
                if type(old) in (list, bytearray):
                    old[:] = new
                elif type(old) in (dict, set):
                    old.clear()
                    old.update(new)
            return ans[1]
        if kind == "x" and len(ans) == 4 and all(type(a) is str for a in ans[1:]):
            cls = exception_class(ans[1], ans[2])
            try:
                exc = cls(ans[3]) if cls is not ProgramError else cls(f"{ans[2]}: {ans[3]}")
            except Exception:  # noqa: BLE001 - a constructor with other arguments
                exc = cls.__new__(cls)
                exc.args = (ans[3],)
            raise exc
        poison("fail")
        raise AssertionError("the program's answer is over the size cap or malformed")

    strict = bool(req.get("strict_compare", True))
    codes = []
    for i, test in enumerate(req["tests"]):
        try:
            codes.append(compile(test, f"<test {i}>", "exec"))
        except BaseException as exc:  # noqa: BLE001 - reported as that test's failure
            codes.append(exc)
    private = dict(builtins.__dict__)
    if strict:
        private.update(_HELPERS or strict_compare.strict_helpers(strict_compare.kind_table()))
    ns = {"__builtins__": private, "__name__": "__main__"}
    try:
        exec(compile(req.get("prelude") or "", "<prelude>", "exec"), ns)  # trusted (a prompt)
    except BaseException as exc:  # noqa: BLE001
        emit("setup-error " + type(exc).__name__)
        return 0
    trusted = frozenset(ns)
    try:
        first = recv()
        listing = None if first is None else loads(first)
    except (OSError, plain_data.NotPlain):
        listing = None
    if not listing or type(listing) is not list or listing[0] not in ("names", "error"):
        emit("program-gone")
        return 3
    if listing[0] == "error":
        name = str(listing[1]) if len(listing) > 1 else ""
        ok = 0 < len(name) <= 100 and all(c in _SAFE_NAME for c in name)
        emit("program-error " + (name if ok else "an-exception"))
        return 0
    keep = frozenset(req.get("keep") or ())
    builtin_names = frozenset(builtins.__dict__) | frozenset(strict_compare.HELPER_NAMES)
    for entry in listing[1] if type(listing[1]) is list else ():
        if type(entry) is not list or len(entry) != 3 or type(entry[0]) is not str:
            continue
        name, kind, payload = entry
        if not name.isidentifier() or name.startswith("__"):
            continue
        if name not in keep and (name in builtin_names or name in trusted):
            continue
        value = _Remote({"p": name})
        if kind == "val":
            value = payload
        elif kind == "std" and type(payload) is list and len(payload) == 2:
            with contextlib.suppress(plain_data.NotPlain):
                value = plain_data.resolve_std(payload[0], payload[1])
        ns[name] = value
    try:
        exec(compile(req.get("setup") or "", "<setup>", "exec"), ns)  # trusted task setup
    except BaseException as exc:  # noqa: BLE001
        if state["gone"] is not None:
            emit("program-gone")
            return 3
        if state["poison"] == "unjudged" or isinstance(exc, _Unjudged):
            emit("setup-unjudged")
            emit("done")
            return 0
        emit("setup-error " + type(exc).__name__)
        return 0
    for i, code in enumerate(codes):
        state["poison"] = None
        failure = None
        try:
            if isinstance(code, BaseException):
                raise code
            exec(code, ns)  # trusted test code
        except BaseException as exc:  # noqa: BLE001
            failure = type(exc).__name__
        if state["gone"] is not None:
            emit("program-gone")
            return 3
        if state["poison"] == "unjudged":
            emit(f"unjudged {i}")
        elif state["poison"] == "fail" or failure is not None:
            emit(f"fail {i} {failure or 'AssertionError'}")
        else:
            emit(f"pass {i}")
    emit("done")
    return 0


def _judge_loop():
    """The judge's life: one request after another (fd 4), each with its run's call pipes (fd 7),
    judged by :func:`_judge_side`; the end of each run is the line ``<marker> end <code>``."""
    recv = _frame_reader(4, 1 << 30)
    sock = socket.socket(fileno=_J_SOCK)
    while True:
        data = recv()
        if data is None:
            os._exit(0)
        req = json.loads(data.decode("utf-8"))
        _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        lifted = [fcntl.fcntl(fd, fcntl.F_DUPFD, 32) for fd in fds]
        for fd in fds:
            os.close(fd)
        for fd, target in zip(lifted, (_J_CALL_OUT, _J_CALL_IN), strict=True):
            os.dup2(fd, target)
            os.close(fd)
        marker = req["marker"]
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        resource.setrlimit(resource.RLIMIT_CPU,
                           (int(used + float(req["timeout_s"])) + 2, resource.RLIM_INFINITY))
        if "random" in sys.modules:
            sys.modules["random"].seed()
        try:
            code = _judge_side(req) or 0
        except BaseException as exc:  # noqa: BLE001 - a harness failure, shown in the output
            code = 71
            with contextlib.suppress(BaseException):
                os.write(2, f"sandbox judge error: {type(exc).__name__}: {exc}\n".encode())
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        for fd in (_J_CALL_OUT, _J_CALL_IN):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.write(RESULT_FD, f"{marker} end {code}\n".encode())
        if code not in (0, 3):
            os._exit(code)
