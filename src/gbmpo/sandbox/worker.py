"""Sandbox worker ("zygote"): runs untrusted programs one at a time, each in a forked child.

This file is **not imported** by gbmpo: :func:`gbmpo.sandbox.isolation.worker_program` ships its
text, after that of :mod:`gbmpo.sandbox.strict_compare` (the comparison helpers the harness
installs), :mod:`gbmpo.sandbox.plain_data` and :mod:`gbmpo.sandbox.run_sides` (the program's
process and the judge), to ``python3 -I -S -c <program> <base_dir> <config json>``, usually
inside bubblewrap and as uid 65534. It uses the standard library only, so that any system
interpreter can run it.

Protocol with the client (both directions): a 4-byte big-endian length, then that many bytes of
UTF-8 JSON.

* On start the worker sends ``{"hello": true, "pid", "uid", "gid", "python", "seccomp": null |
  "error text", "seccomp_selftest": {...}, "seccomp_active", "dumpable", "pidfd"}``.
* A request ``{"code", "tests", "setup", "prelude", "keep", "marker", "timeout_s",
  "memory_mb", "fsize_mb", "max_output_bytes", "max_answer_bytes", "strict_compare"}`` is
  answered by ``{"exit", "signal", "timed_out", "output_overflow", "output", "results",
  "duration_s"}``; ``results`` is everything the judge wrote on the result channel (the client
  parses it; the worker does not judge).

Each program runs in a child forked from this process *before* its request arrives (so the fork
and the sandboxing are off the critical path), the **program's process**, and is judged by the
worker's **judge**, a child forked once that judges one run after another (and is forked again
after a run it did not finish: a deadline, an output flood, a crash). Each run's call pipes
between the two are new: created with the program's process and handed to the judge over a unix
socket when the run starts. Each child starts a new session, asks for SIGKILL when the worker
dies, is not dumpable, moves into the run's fresh directory (the judge: ``/``), redirects stdin
to /dev/null and stdout/stderr into one capped pipe, keeps only its own pipes, sets
RLIMIT_NOFILE, RLIMIT_CORE (and, without seccomp, RLIMIT_NPROC), and loads a seccomp filter (no
sockets, no new processes, no exec, no signals to other processes, no ptrace, mount or
namespaces). When the request arrives the program's process sets RLIMIT_CPU, RLIMIT_AS and
RLIMIT_FSIZE (the judge: a CPU limit of its own for the run). The program's process gets only
the code: it runs it, lists the program's names, and answers the judge's calls. The judge gets
the rest and never runs the program: it runs the prelude, the setup and each test, calls of
program names crossing to the program's process as plain data (:mod:`gbmpo.sandbox.plain_data`),
and reports ``<marker> pass i`` / ``fail i`` / ``unjudged i`` per test and ``<marker> done`` at
the end on the result channel, a descriptor only it holds, then ``<marker> end <code>``. After
answering, the worker kills whatever is left in its PID namespace but the judge, deletes the
run's files and forks the next program's process.

Shipped as text into the sandbox, where nothing of gbmpo can be imported, it reads top to bottom
(seccomp, protocol, limits, pre-forked children, clean-up, supervision, main loop); the two sides
of a run are :mod:`gbmpo.sandbox.run_sides`.
"""

import contextlib
import errno
import fcntl
import gc
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

try:  # in the sandbox: the module the launcher defined from its file's text
    import gbmpo_run_sides as run_sides
except ImportError:  # imported from an installed gbmpo (documentation, tests)
    from gbmpo.sandbox import run_sides

# the two sides of a run and their descriptors (gbmpo.sandbox.run_sides)
RESULT_FD, _J_SOCK = run_sides.RESULT_FD, run_sides._J_SOCK
_CALL_IN, _CALL_OUT = run_sides._CALL_IN, run_sides._CALL_OUT
_program_side, _judge_loop = run_sides._program_side, run_sides._judge_loop
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


def _child(cfg, run_dir, fds, req_fd, body):
    """Body of a pre-forked child (the program's process or the judge); never returns.

    ``fds`` maps each descriptor number the child keeps (above 2: its pipes) to the worker's
    descriptor; stdin is /dev/null and every other descriptor is closed. Everything that does
    not depend on the request happens before it arrives (off the critical path): new session,
    death signal, descriptors, work directory, base rlimits and the seccomp filter. The request
    is then read from ``req_fd``; its time and memory limits are applied and ``body`` runs.
    """
    code = 70
    try:
        os.setsid()
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(_PR_SET_DUMPABLE, 0)
        # Lift the pipe ends above the target numbers first, so no dup2 clobbers another.
        lifted = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 32) for target, fd in fds.items()}
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        for target, fd in lifted.items():
            os.dup2(fd, target)
        for fd in range(3, max(fds)):
            if fd not in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.closerange(max(fds) + 1, 1 << 16)
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
        if body is None:
            _judge_loop()
        chunks = []
        while True:
            chunk = os.read(req_fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(req_fd)
        if not chunks:  # the worker shut down without using us
            os._exit(0)
        req = json.loads(b"".join(chunks).decode("utf-8"))
        _set_limits(req)
        code = body(req) or 0
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


def _sweep_namespace(keep):
    """Inside our own PID namespace (we are PID 1): kill and reap every other process but
    ``keep`` (the judge)."""
    if os.getpid() != 1:
        return
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, keep):
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


class _Judge:
    """The judge of one worker: forked once, it judges one run after another (only trusted code
    and plain data run in it) and is forked again after a run it did not finish (a deadline, an
    output flood, a crash). Its requests (fd 4), the result channel (fd 3; no program's process
    has a descriptor of it) and the output pipe (fds 1 and 2, shared with each program's
    process) outlive the runs; each run's call pipes are new, created with the program's process
    and passed to the judge over a unix socket (fd 7) when the run starts, so nothing a program
    writes reaches the judge after its run.
    """

    def __init__(self, cfg):
        j_req, self.req_w = os.pipe()
        self.out_r, self.out_w = os.pipe()
        self.res_r, res_w = os.pipe()
        self.sock, j_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine = (self.req_w, self.out_r, self.res_r, self.sock.fileno(), _PROTO_IN, _PROTO_OUT)
        self.pid = os.fork()
        if self.pid == 0:
            for fd in mine:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _child(cfg, "/", {1: self.out_w, 2: self.out_w, RESULT_FD: res_w, 4: j_req,
                              _J_SOCK: j_sock.fileno()}, 4, None)
        for fd in (j_req, res_w):
            os.close(fd)
        j_sock.close()
        os.set_blocking(self.out_r, False)
        os.set_blocking(self.res_r, False)
        self.pidfd = None
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)

    def stop(self):
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.sock.close()
        for fd in (self.req_w, self.out_r, self.out_w, self.res_r, self.pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


class _Warm:
    """A pre-forked program's process waiting for its request, with its run's call pipes (the
    judge's ends kept here until the run starts)."""

    def __init__(self, cfg, base_dir, counter, judge):
        self.run_dir = os.path.join(base_dir, f"run{counter}")
        os.mkdir(self.run_dir, 0o700)
        p_req, self.req_w = os.pipe()
        calls_r, self.calls_w = os.pipe()
        self.answers_r, answers_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in (self.req_w, self.calls_w, self.answers_r):
                with contextlib.suppress(OSError):
                    os.close(fd)
            _child(cfg, self.run_dir,
                   {1: judge.out_w, 2: judge.out_w, _CALL_IN: calls_r, _CALL_OUT: answers_w,
                    5: p_req}, 5, _program_side)
        for fd in (p_req, calls_r, answers_w):
            os.close(fd)
        self.pidfd = None
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)

    def kill(self):
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)

    def close_fds(self):
        for name in ("req_w", "calls_w", "answers_r", "pidfd"):
            fd = getattr(self, name)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, None)

    def discard(self):
        self.kill()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.close_fds()


def _write_all(fd, data):
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass  # the child is gone; its status tells what happened


def _discard(fd):
    """Read and drop what is available on non-blocking ``fd``."""
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass


def _exited(pid, pidfd, wait_s):
    """``pid``'s wait status if it ends within ``wait_s`` seconds, else None."""
    if pidfd is not None and wait_s > 0:
        select.select([pidfd], [], [], wait_s)
    got, status = os.waitpid(pid, os.WNOHANG)
    return status if got else None


def _run(req, warm, judge):
    """Hand ``req`` to the pre-forked program's process and to the judge, and supervise them
    until the judge reports the run's end (``<marker> end <code>``), dies, or time is up.

    The program's process gets only the code; the judge gets the tests, setup, prelude, the
    marker and this run's call pipes. When the judge says the program's process ended (code 3),
    that process's own exit status is reported. Returns the response and whether the judge
    must be forked again.
    """
    out_r, res_r = judge.out_r, judge.res_r
    _discard(out_r)  # what the last run's program wrote after its last answer
    start = time.monotonic()
    end = b"\n" + req["marker"].encode() + b" end "
    limits = {k: req[k] for k in ("timeout_s", "memory_mb", "fsize_mb", "max_answer_bytes")}
    _write_all(warm.req_w, json.dumps(dict(limits, code=req["code"])).encode("utf-8"))
    judge_req = json.dumps({k: v for k, v in req.items() if k != "code"}).encode("utf-8")
    _write_all(judge.req_w, struct.pack(">I", len(judge_req)) + judge_req)
    with contextlib.suppress(OSError):
        socket.send_fds(judge.sock, [b"x"], [warm.calls_w, warm.answers_r])
    os.close(warm.req_w)
    os.close(warm.calls_w)
    os.close(warm.answers_r)
    warm.req_w = warm.calls_w = warm.answers_r = None
    max_out = int(req["max_output_bytes"])
    out, res = bytearray(), bytearray(b"\n")
    caps = {out_r: (out, max_out), res_r: (res, 1 << 20)}
    poller = select.poll()
    for fd in caps:
        poller.register(fd, select.POLLIN)
    if judge.pidfd is not None:
        poller.register(judge.pidfd, select.POLLIN)
    deadline = start + float(req["timeout_s"])
    timed_out = overflow = judge_died = False
    code = None
    while code is None and not judge_died:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        wait_ms = remaining * 1000.0 if judge.pidfd is not None else min(remaining * 1000.0, 20.0)
        for fd, _ev in poller.poll(wait_ms):
            if fd == judge.pidfd:
                judge_died = True
            elif fd in caps:
                buf, cap = caps[fd]
                if _drain(fd, buf, cap) is None and fd == out_r:
                    overflow = True
                    break
        if overflow:
            break
        if judge.pidfd is None and os.waitpid(judge.pid, os.WNOHANG)[0]:
            judge_died = True
        at = res.find(end)
        if at >= 0 and res.find(b"\n", at + 1) >= 0:
            line = bytes(res[at + len(end):res.find(b"\n", at + 1)])
            code = int(line) if line.isdigit() else 71
            del res[at + 1:]
    if code is None:
        _drain(res_r, res, 1 << 20)
    status = None
    if judge_died:  # a crash, or its CPU limit (collected here, or already between runs)
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(judge.pid, 0)
    if code == 3:  # the judge saw the program's process end: give it a moment to be collectable
        status = _exited(warm.pid, warm.pidfd, max(0.0, min(1.0, deadline - time.monotonic())))
    warm.kill()  # the program's process is collected after the answer is sent (main loop)
    duration = time.monotonic() - start
    if status is not None:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    elif code is None:  # killed at the deadline or for its output
        sig, exit_code = signal.SIGKILL, None
    else:
        sig, exit_code = None, (code if code != 3 else None)
    return {
        "exit": exit_code,
        "signal": sig,
        "killed_by_worker": timed_out or overflow,
        "timed_out": timed_out,
        "output_overflow": overflow,
        "output": bytes(out).decode("utf-8", "replace"),
        "results": bytes(res[1:]).decode("utf-8", "replace"),
        "duration_s": duration,
    }, code not in (0, 3)


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
    run_sides.build_strict_helpers()
    # Everything loaded so far is shared with every child: frozen, the collector never walks it
    # in a child (a walk would copy each page it touches: forks stay cheap).
    gc.collect()
    gc.freeze()
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
    judge = _Judge(cfg)
    warm = _Warm(cfg, base_dir, counter, judge)
    while True:
        req = _recv()
        if req is None:
            warm.discard()
            judge.stop()
            return
        restart = True
        try:
            resp, restart = _run(req, warm, judge)
        except Exception as exc:  # noqa: BLE001 - reported, the worker keeps serving
            resp = {"worker_error": f"{type(exc).__name__}: {exc}"}
        _send(resp)
        # Off the critical path: clean up after this run and prepare the next one.
        warm.discard()
        _sweep_namespace(judge.pid)
        _reap()
        _cleanup(base_dir)
        if restart:
            judge.stop()
            judge = _Judge(cfg)
        counter += 1
        warm = _Warm(cfg, base_dir, counter, judge)


if __name__ == "__main__":
    main()
