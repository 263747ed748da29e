"""Sandbox worker ("zygote"): runs untrusted programs one at a time, each in a forked child.

This file is **not imported** by gbmpo: :func:`gbmpo.sandbox.isolation.worker_program` ships its
text, after that of :mod:`gbmpo.sandbox.strict_compare` (the comparison helpers the harness
installs), to ``python3 -I -S -c <program> <base_dir> <config json>``, usually inside bubblewrap
and as uid 65534. It uses the standard library only, so that any system interpreter can run it.

Protocol (both directions): a 4-byte big-endian length, then that many bytes of UTF-8 JSON.

* On start the worker sends ``{"hello": true, "pid", "uid", "gid", "python", "seccomp": null |
  "error text", "seccomp_selftest": {...}, "seccomp_active", "dumpable", "pidfd"}``.
* A request ``{"code", "tests", "setup", "keep", "marker", "timeout_s", "memory_mb",
  "fsize_mb", "max_output_bytes"}`` is answered by ``{"exit", "signal", "timed_out",
  "output_overflow", "output", "results", "duration_s"}``; ``results`` is everything the harness
  wrote on the result channel (the grader parses it; the worker does not judge).

Each program runs in a child forked from this process *before* its request arrives (so the
fork and the sandboxing are off the critical path). The child: starts a new session (its own
process group), asks for SIGKILL when the worker dies, moves into a fresh directory, redirects
stdin to /dev/null and stdout/stderr into a capped pipe, keeps fd 3 as the result channel and
fd 4 for its request, closes every other descriptor (so it cannot speak the protocol), sets
RLIMIT_NOFILE, RLIMIT_CORE (and, without seccomp, RLIMIT_NPROC), and loads a seccomp filter (no
sockets, no new processes, no exec, no signals to other processes, no ptrace, mount or
namespaces). When the request arrives it sets RLIMIT_CPU, RLIMIT_AS and RLIMIT_FSIZE and runs
the program, ``setup`` and each test in one module namespace. The harness reports
``<marker> pass i`` / ``<marker> fail i`` per test and ``<marker> done`` at the end. After
answering, the worker kills whatever is left in its PID namespace, deletes the run's files and
forks the next child.

One file of about 680 lines, longer than the others: it is shipped as text into the sandbox, where
nothing of gbmpo can be imported, and reads top to bottom (seccomp, protocol, limits, harness,
pre-forked child, supervision, clean-up, main loop).
"""

import contextlib
import errno
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import threading
import time

try:  # in the sandbox: the module the launcher defined from strict_compare.py's text
    import gbmpo_strict_compare as strict_compare
except ImportError:  # imported from an installed gbmpo (documentation, tests)
    from gbmpo.sandbox import strict_compare

RESULT_FD = 3
_REQ_FD = 4
_PROTO_IN = 10
_PROTO_OUT = 11
_CLONE_THREAD = 0x00010000
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4

# Modules that programs commonly import: loading them once here makes every child faster.
_PRELOAD = (
    "typing", "math", "re", "collections", "itertools", "functools", "heapq", "bisect",
    "string", "operator", "copy", "random", "fractions", "decimal", "statistics", "datetime",
    "json", "types", "dataclasses", "cmath", "array", "textwrap", "enum", "hashlib", "tempfile",
    "fcntl", "resource",
)

_DENY_EPERM = (
    "socket", "socketpair", "fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv",
    "process_vm_writev", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "tkill", "mount",
    "umount2", "unshare", "setns", "pivot_root", "chroot", "kexec_load", "kexec_file_load",
    "reboot", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "fsopen", "fsmount", "open_tree",
    "move_mount", "swapon", "swapoff", "init_module", "finit_module", "delete_module",
    "acct", "quotactl", "settimeofday", "clock_settime", "sethostname", "setdomainname",
)

_seccomp = None
_seccomp_error = None
_libc = None


def _load_optional_modules():
    global _seccomp, _seccomp_error, _libc
    extra = "/usr/lib/python3/dist-packages"
    added = extra not in sys.path
    if added:
        sys.path.append(extra)
    try:
        # deferred: python3-seccomp is optional (a system package)
        import seccomp  # Debian's python3-seccomp (libseccomp bindings)

        _seccomp = seccomp
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        _seccomp_error = f"{type(exc).__name__}: {exc}"
    finally:
        if added:
            sys.path.remove(extra)
    try:
        # deferred: ctypes may be missing from a minimal system interpreter (then no prctl)
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    except Exception:  # noqa: BLE001
        _libc = None


def _prctl(option, arg):
    if _libc is None:
        return -1
    return _libc.prctl(option, arg, 0, 0, 0)


def _load_filter(pid):
    """Install the child's seccomp filter (``pid``: the only process it may signal)."""
    sc = _seccomp
    eperm = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in _DENY_EPERM:
        with contextlib.suppress(Exception):  # a syscall unknown to this libseccomp
            flt.add_rule(eperm, name)
    # glibc creates threads with clone3 and falls back to clone when it returns ENOSYS; clone
    # is then allowed only for threads (CLONE_THREAD set), i.e. no new processes.
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    flt.add_rule(eperm, "kill", sc.Arg(0, sc.NE, pid))
    flt.add_rule(eperm, "tgkill", sc.Arg(0, sc.NE, pid))
    flt.load()


def _send(obj):
    data = json.dumps(obj).encode("utf-8")
    buf = struct.pack(">I", len(data)) + data
    view = memoryview(buf)
    while view:
        n = os.write(_PROTO_OUT, view)
        view = view[n:]


def _read_exact(n):
    chunks = []
    while n:
        chunk = os.read(_PROTO_IN, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv():
    head = _read_exact(4)
    if head is None:
        return None
    body = _read_exact(struct.unpack(">I", head)[0])
    if body is None:
        return None
    return json.loads(body.decode("utf-8"))


def _lim(which, value):
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY and value > hard:
            value = hard
        resource.setrlimit(which, (value, value))


def _base_limits(cfg):
    """Limits that do not depend on the request (set before it arrives)."""
    _lim(resource.RLIMIT_NOFILE, 64)
    _lim(resource.RLIMIT_CORE, 0)
    if cfg.get("nproc"):
        _lim(resource.RLIMIT_NPROC, int(cfg["nproc"]))


def _set_limits(req):
    """Per-request limits: CPU time (timeout + 1 s, then SIGKILL), address space, file size."""
    cpu = int(req["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    _lim(resource.RLIMIT_AS, int(req["memory_mb"]) << 20)
    _lim(resource.RLIMIT_FSIZE, int(req["fsize_mb"]) << 20)


# Modules whose attributes the harness restores before the tests (a program could otherwise
# monkeypatch, say, math.isclose for the tests that call it).
_GUARDED_MODULES = (
    "builtins", "math", "cmath", "re", "random", "string", "itertools", "functools",
    "operator", "heapq", "collections",
)


def _harness(req):
    """Run program, setup and tests in one namespace; report on the result channel only.

    Everything the harness needs after the untrusted program has run is bound to a local name
    first, so that replacing ``builtins.exec``, ``os.write``, ``BaseException`` and the like
    does not change how tests are run or reported. Before the tests, the attributes of the
    builtins module and of common standard modules are restored, and module-level names of the
    program that shadow a builtin (``def abs(x): return 0``) are removed unless listed in
    ``keep`` (a task whose entry point is named like a builtin).
    """
    # local: bound here, before the program runs, so the program cannot patch them
    import builtins
    import types

    _exec, _compile, _base_exc, _type, _enumerate = exec, compile, BaseException, type, enumerate
    _len, _range, _list, _dict, _isinstance, _zip = len, range, list, dict, isinstance, zip
    _id, helper_names = id, strict_compare.HELPER_NAMES
    _module_type, _settrace, _setprofile = types.ModuleType, sys.settrace, sys.setprofile
    write = os.write
    marker = req.pop("marker")
    tests = req["tests"]
    keep = frozenset(req.get("keep") or ())
    builtin_names = frozenset(builtins.__dict__)

    def emit(text):
        try:  # noqa: SIM105 - no module lookups after the program ran
            write(RESULT_FD, (marker + " " + text + "\n").encode())
        except OSError:
            pass

    strict = bool(req.get("strict_compare", True))
    codes = []  # trusted test code, compiled before the program can touch compile or ast
    for i, test in _enumerate(tests):
        try:
            name = f"<test {i}>"
            codes.append(_compile(test, name, "exec"))
        except _base_exc as exc:  # noqa: BLE001 - reported as that test's failure
            codes.append(exc)
    helpers = strict_compare.strict_helpers(strict_compare.kind_table()) if strict else {}

    module = _module_type("solution")
    sys.modules["solution"] = module
    ns = module.__dict__
    ns["__builtins__"] = builtins
    ns["__file__"] = "solution.py"
    guarded = [sys.modules[m] for m in _GUARDED_MODULES if m in sys.modules]
    snapshots = [(m.__dict__, _dict(m.__dict__)) for m in guarded]
    pristine = {m.__name__: saved for m, (_current, saved) in _zip(guarded, snapshots)}
    # Private copies of the guarded modules for the tests (made when first asked for): ``import
    # math`` in a test, and a ``math`` the test finds in the program's namespace, give a module
    # the program never saw.
    copies = {}
    real_import = builtins.__import__

    def module_copy(name):
        copy = copies.get(name)
        if copy is None:
            copy = copies[name] = _module_type(name)
            copy.__dict__.update(pristine[name])
        return copy

    def private_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if level == 0:
            key = name if fromlist else name.partition(".")[0]
            if key in pristine:
                return module_copy(key)
        return module

    def restore():
        _settrace(None)
        _setprofile(None)
        for current, saved in snapshots:
            for name in _list(current):
                if name not in saved:
                    del current[name]
            current.update(saved)

    try:
        # The untrusted program, inside the sandboxed child only.
        _exec(_compile(req["code"], "solution.py", "exec"), ns)
    except _base_exc as exc:  # noqa: BLE001
        emit("program-error " + _type(exc).__name__)
        return
    try:
        restore()
        ns["__builtins__"] = builtins
        for name in _list(ns):
            if name in builtin_names and name not in keep and not name.startswith("__"):
                del ns[name]
    except _base_exc as exc:  # noqa: BLE001
        emit("program-error " + _type(exc).__name__)
        return
    try:
        # Trusted task setup (MBPP's test_setup_code builds inputs from the program's classes).
        _exec(_compile(req["setup"], "<setup>", "exec"), ns)
    except _base_exc as exc:  # noqa: BLE001
        emit("setup-error " + _type(exc).__name__)
        return
    # The tests run in a copy of the program's namespace whose builtins are a private copy taken
    # before the program ran: a program function that patches builtins (or the namespace it
    # sees as globals) while a test calls it cannot change what the test's own names mean.
    test_ns = _dict(ns)
    for name in helper_names:
        test_ns.pop(name, None)
    by_id = {_id(m): m.__name__ for m in guarded}
    for name, value in _list(test_ns.items()):
        if _id(value) in by_id:
            test_ns[name] = module_copy(by_id[_id(value)])
    private = _dict(pristine["builtins"])
    private.update(helpers)
    private["__import__"] = private_import
    for i, code in _enumerate(codes):
        try:
            if _isinstance(code, _base_exc):
                raise code
            restore()
            test_ns["__builtins__"] = private
            _exec(code, test_ns)  # trusted test code
        except _base_exc as exc:  # noqa: BLE001
            emit(f"fail {i} {_type(exc).__name__}")
        else:
            emit(f"pass {i}")
    emit("done")


def _child(cfg, run_dir, req_r, out_w, res_w):
    """Body of a pre-forked child; never returns.

    Everything that does not depend on the request happens before it arrives (off the
    critical path): new session, death signal, descriptors, work directory, base rlimits and
    the seccomp filter. The request is then read from ``req_r``; its time and memory limits are
    applied and the harness runs.
    """
    code = 70
    try:
        os.setsid()
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

        # Lift the pipe ends above the target numbers first, so no dup2 clobbers another.
        out_w, res_w, req_r = (fcntl.fcntl(fd, fcntl.F_DUPFD, 32) for fd in (out_w, res_w, req_r))
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.dup2(res_w, RESULT_FD)
        os.dup2(req_r, _REQ_FD)
        os.closerange(_REQ_FD + 1, 1 << 16)
        os.chdir(run_dir)
        os.environ["TMPDIR"] = run_dir
        os.environ["HOME"] = run_dir
        if "tempfile" in sys.modules:
            sys.modules["tempfile"].tempdir = run_dir
        if "random" in sys.modules:
            sys.modules["random"].seed()
        _base_limits(cfg)
        if cfg["seccomp"]:
            _load_filter(os.getpid())
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        chunks = []
        while True:
            chunk = os.read(_REQ_FD, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(_REQ_FD)
        if not chunks:  # the worker shut down without using us
            os._exit(0)
        req = json.loads(b"".join(chunks).decode("utf-8"))
        _set_limits(req)
        _harness(req)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - a harness failure, shown in the output
        code = 71
        with contextlib.suppress(BaseException):
            os.write(2, f"sandbox harness error: {type(exc).__name__}: {exc}\n".encode())
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def _drain(fd, buf, cap):
    """Read what is available from non-blocking ``fd`` into ``buf`` (up to ``cap``)."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > max(room, 0):
            return None  # overflow


def _sweep_namespace():
    """Inside our own PID namespace (we are PID 1): kill and reap every other process."""
    if os.getpid() != 1:
        return
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != 1:
            with contextlib.suppress(OSError):
                os.kill(int(name), signal.SIGKILL)
    _reap()


def _rmtree(path):
    def retry(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    if os.path.isdir(path) and not os.path.islink(path):
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=retry)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _cleanup(base_dir):
    """Remove everything a run left in the work area (and, in our own namespace, /dev/shm)."""
    dirs = [base_dir] + (["/dev/shm"] if os.getpid() == 1 else [])
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            _rmtree(os.path.join(d, name))


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class _Warm:
    """A pre-forked child waiting for its request."""

    def __init__(self, cfg, base_dir, counter):
        self.run_dir = os.path.join(base_dir, f"run{counter}")
        os.mkdir(self.run_dir, 0o700)
        req_r, self.req_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.res_r, res_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in (self.req_w, self.out_r, self.res_r, _PROTO_IN, _PROTO_OUT):
                with contextlib.suppress(OSError):
                    os.close(fd)
            _child(cfg, self.run_dir, req_r, out_w, res_w)
        for fd in (req_r, out_w, res_w):
            os.close(fd)
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def discard(self):
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        for fd in (self.req_w, self.out_r, self.res_r, self.pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _run(req, warm):
    """Hand ``req`` to the pre-forked child and supervise it until it ends or its time is up."""
    pid, out_r, res_r, pidfd = warm.pid, warm.out_r, warm.res_r, warm.pidfd
    os.set_blocking(out_r, False)
    os.set_blocking(res_r, False)
    start = time.monotonic()
    data = json.dumps(req).encode("utf-8")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(warm.req_w, view):]
    except OSError:
        pass  # the child is gone; its status tells what happened
    os.close(warm.req_w)
    warm.req_w = None
    max_out = int(req["max_output_bytes"])
    out, res = bytearray(), bytearray()
    open_fds = {out_r: (out, max_out), res_r: (res, 1 << 20)}
    poller = select.poll()
    for fd in open_fds:
        poller.register(fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    deadline = start + float(req["timeout_s"])
    timed_out = overflow = exited = False
    status = None
    while not exited:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        wait_ms = remaining * 1000.0 if pidfd is not None else min(remaining * 1000.0, 20.0)
        for fd, _ev in poller.poll(wait_ms):
            if fd == pidfd:
                exited = True
            elif fd in open_fds:
                buf, cap = open_fds[fd]
                alive = _drain(fd, buf, cap)
                if alive is None:
                    if fd == out_r:
                        overflow = True
                        break
                elif not alive:
                    poller.unregister(fd)
                    del open_fds[fd]
        if overflow:
            break
        if pidfd is None:
            got, st = os.waitpid(pid, os.WNOHANG)
            if got:
                exited, status = True, st
    killed_by_us = not exited
    # Whole process group (the child is its leader), then the child itself, then collect it.
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)
    if status is None:
        _, status = os.waitpid(pid, 0)
    for fd in list(open_fds):
        buf, cap = open_fds[fd]
        if _drain(fd, buf, cap) is None and fd == out_r:
            overflow = True
    duration = time.monotonic() - start
    for fd in (out_r, res_r, pidfd):
        if fd is not None:
            os.close(fd)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": sig,
        "killed_by_worker": killed_by_us,
        "timed_out": timed_out,
        "output_overflow": overflow,
        "output": bytes(out).decode("utf-8", "replace"),
        "results": bytes(res).decode("utf-8", "replace"),
        "duration_s": duration,
    }


def _selftest():
    """Check in a throwaway child that the seccomp filter blocks sockets and fork."""
    if _seccomp is None:
        return {"ok": False, "error": _seccomp_error}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        report = {}
        try:
            _load_filter(os.getpid())
            for name, fn in (("socket", _try_socket), ("fork", os.fork)):
                try:
                    got = fn()
                    if got == 0:  # a forked grandchild: leave at once
                        os._exit(0)
                    report[name] = "allowed"
                except OSError as exc:
                    report[name] = errno.errorcode.get(exc.errno, str(exc.errno))

            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()
            report["thread"] = "ok"
        except BaseException as exc:  # noqa: BLE001
            report["error"] = f"{type(exc).__name__}: {exc}"
        os.write(w, json.dumps(report).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    _reap()
    try:
        report = json.loads(data.decode() or "{}")
    except ValueError:
        report = {"error": "no report"}
    report["ok"] = (
        report.get("socket") == "EPERM" and report.get("fork") == "EPERM"
        and report.get("thread") == "ok"
    )
    return report


def _try_socket():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.close()
    return 1


def main():
    base_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    cfg = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    # Keep the protocol on private descriptors; fds 0/1/2 point at /dev/null from now on.
    os.dup2(0, _PROTO_IN)
    os.dup2(1, _PROTO_OUT)
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)
    os.umask(0o077)
    _load_optional_modules()
    # Not dumpable: a same-uid process can then neither ptrace us nor read our memory.
    _prctl(_PR_SET_DUMPABLE, 0)
    for name in _PRELOAD:
        with contextlib.suppress(Exception):
            __import__(name)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    selftest = _selftest()
    want = bool(cfg.get("seccomp", True))
    cfg["seccomp"] = want and _seccomp is not None and selftest.get("ok", False)
    # RLIMIT_NPROC only when seccomp cannot stop forks (it also counts threads).
    cfg["nproc"] = 0 if cfg["seccomp"] else 64
    _send({
        "hello": True,
        "pid": os.getpid(),
        "uid": os.getuid(),
        "gid": os.getgid(),
        "python": sys.version.split()[0],
        "seccomp": None if _seccomp is not None else (_seccomp_error or "unavailable"),
        "seccomp_active": cfg["seccomp"],
        "seccomp_selftest": selftest,
        "dumpable": _prctl(3, 0) == 1,  # PR_GET_DUMPABLE
        "base_dir": base_dir,
        "pidfd": hasattr(os, "pidfd_open"),
    })
    counter = 1
    warm = _Warm(cfg, base_dir, counter)
    while True:
        req = _recv()
        if req is None:
            warm.discard()
            return
        try:
            resp = _run(req, warm)
        except Exception as exc:  # noqa: BLE001 - reported, the worker keeps serving
            warm.discard()
            resp = {"worker_error": f"{type(exc).__name__}: {exc}"}
        _send(resp)
        # Off the critical path: clean up after this run and prepare the next child.
        _sweep_namespace()
        _reap()
        _cleanup(base_dir)
        counter += 1
        warm = _Warm(cfg, base_dir, counter)


if __name__ == "__main__":
    main()
