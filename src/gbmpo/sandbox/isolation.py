"""The isolation layers around a sandbox worker: what they are, how to get each one back, and
the command that starts a worker inside them (bubblewrap, an empty environment, ``python3 -I
-S``). :class:`gbmpo.sandbox.client.Sandbox` checks which layers are active from the worker's
greeting and refuses to run without one unless the user opted in (see its module docstring).
"""

from __future__ import annotations

import os
from importlib import resources

__all__ = [
    "ALLOW_ENV",
    "DEFAULT_PYTHON",
    "ISOLATION_LAYERS",
    "NOBODY",
    "PROTECTIONS",
    "REMEDY",
    "PLAIN_DATA_MODULE",
    "RUN_SIDES_MODULE",
    "STRICT_COMPARE_MODULE",
    "bwrap_args",
    "env_flag",
    "worker_program",
]

#: the protection layers, in the order they are reported
PROTECTIONS = (
    "bubblewrap",  # namespaces: private fs view (/usr read-only), no network, own PID space
    "unprivileged",  # no power over the caller: uid 65534, or a non-root caller inside bwrap
    "seccomp",  # no sockets, no new processes, no exec, no signals to other PIDs
    "rlimits",  # address space, CPU time, file size, open files, no core dumps
    "process_group",  # own session; the whole group is killed after every run
    "pidfd",  # race-free wait on the child
    "output_cap",  # captured output is read up to a cap, then the program is killed
)

#: the layers without which the sandbox refuses to run unless the user opts in (``pidfd`` only
#: makes waiting race-free; without it the worker polls)
ISOLATION_LAYERS = tuple(p for p in PROTECTIONS if p != "pidfd")

#: the environment variable that opts in to running code with fewer isolation layers
ALLOW_ENV = "GBMPO_ALLOW_UNSANDBOXED_CODE"

#: how to get each layer back
REMEDY = {
    "bubblewrap": "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap) and allow "
    "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), or run as root",
    "unprivileged": "run as root (programs then run as uid 65534) or with bubblewrap available",
    "seccomp": "install libseccomp's Python bindings for the sandbox interpreter "
    "(Debian/Ubuntu: apt-get install -y python3-seccomp)",
    "pidfd": "use Linux >= 5.3 and Python >= 3.9",
}

NOBODY = 65534
DEFAULT_PYTHON = "/usr/bin/python3"

#: the name under which the worker finds :mod:`gbmpo.sandbox.strict_compare` in the sandbox
STRICT_COMPARE_MODULE = "gbmpo_strict_compare"
#: the name under which the worker finds :mod:`gbmpo.sandbox.plain_data` in the sandbox
PLAIN_DATA_MODULE = "gbmpo_plain_data"
#: the name under which the worker finds :mod:`gbmpo.sandbox.run_sides` in the sandbox
RUN_SIDES_MODULE = "gbmpo_run_sides"


def env_flag(name: str) -> bool:
    """True iff the environment variable ``name`` is set to 1/true/yes/on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def worker_program() -> str:
    """The text the sandbox interpreter runs (``python3 -I -S -c TEXT``): the worker
    (:mod:`gbmpo.sandbox.worker`), with :mod:`gbmpo.sandbox.strict_compare`,
    :mod:`gbmpo.sandbox.plain_data` and :mod:`gbmpo.sandbox.run_sides` defined first, in that
    order, as the modules it imports (the sandbox sees no gbmpo installation)."""
    pkg = resources.files("gbmpo.sandbox")
    text = "import sys, types\n"
    for name, file in ((STRICT_COMPARE_MODULE, "strict_compare.py"),
                       (PLAIN_DATA_MODULE, "plain_data.py"),
                       (RUN_SIDES_MODULE, "run_sides.py")):
        src = pkg.joinpath(file).read_text(encoding="utf-8")
        text += (
            f"m = types.ModuleType({name!r})\n"
            f"sys.modules[{name!r}] = m\n"
            f"exec(compile({src!r}, {file!r}, 'exec'), m.__dict__)\n"
        )
    worker = pkg.joinpath("worker.py").read_text(encoding="utf-8")
    return text + (
        "del m\n"
        f"exec(compile({worker!r}, 'worker.py', 'exec'), {{'__name__': '__main__'}})\n"
    )


def bwrap_args(python: str, tmp_mb: int, shm_mb: int) -> list[str]:
    """bubblewrap flags: only /usr (and the interpreter's prefix) of the host, read-only."""
    args = [
        "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
        "--new-session", "--as-pid-1", "--cap-drop", "ALL",
        "--ro-bind", "/usr", "/usr",
    ]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    real = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(real))
    if not (real.startswith("/usr/") or prefix in ("/", "")):
        args += ["--ro-bind", prefix, prefix]
    args += [
        "--dev", "/dev",
        "--size", str(shm_mb << 20), "--tmpfs", "/dev/shm",
        "--proc", "/proc",
        "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
        "--chdir", "/tmp",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
    ]
    return args

