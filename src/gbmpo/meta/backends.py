"""Where ES population members run: in-process, on a local process pool, or as Ray Core tasks.

Every backend has the same interface (:class:`Backend`): ``evaluate(fn, thetas)`` applies the
picklable ``fn(theta) -> float`` to every parameter vector and returns one result per member, in
order: the fitness, or the exception the member raised (a crashed worker process included). One
failing member never stops the others; :func:`gbmpo.meta.es.es_step` records and skips it.

* ``serial``: one member after another in this process (a baseline, and for debugging), with
  ``threads`` torch threads while it runs (``None``: leave the process setting).
* ``local`` (default): :class:`concurrent.futures.ProcessPoolExecutor` with the ``spawn`` or
  ``forkserver`` start method (never ``fork``: torch and threads do not survive it). Each worker
  pins ``torch.set_num_threads(max(1, cores // workers))``. A worker that dies (segfault, OOM
  kill, ``os._exit``) breaks the pool; the pool is rebuilt and every member caught in the break
  is rerun alone, so only the member that kills its worker is reported as failed.
* ``ray``: one Ray Core task per member (``ray`` is imported only here). A member asks for one
  GPU when the cluster has GPUs, else ``cpus_per_member`` CPUs. ``address`` joins an existing
  cluster (``ray.init(address=...)``); without it a local Ray instance is started with
  ``num_cpus`` CPUs and no dashboard. The same command therefore runs on a laptop and a cluster.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import signal as _signal
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gbmpo.io import RunStopped
from gbmpo.registry import Registry

__all__ = [
    "BACKENDS",
    "Backend",
    "LocalPoolBackend",
    "RayBackend",
    "SerialBackend",
    "available_cores",
    "get_backend",
]

#: ``name -> Backend class``; build with :func:`get_backend`
BACKENDS: Registry[type[Backend]] = Registry("ES backend")

FitnessFn = Callable[[np.ndarray], float]


def available_cores() -> int:
    """CPU cores this process may use (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _set_torch_threads(threads: int) -> None:
    """Worker initializer: pin torch (and OpenMP/MKL) to ``threads`` threads.

    The environment variables make a later ``import torch`` start with ``threads`` threads; if
    torch is already imported, ``torch.set_num_threads`` applies it now. Importing torch here
    would cost every worker seconds of start-up for fitness functions that never use it.
    """
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


class Backend(ABC):
    """Evaluate a population of members; use as a context manager or call :meth:`close`."""

    name: str = ""

    @abstractmethod
    def evaluate(self, fn: FitnessFn, thetas: Sequence[np.ndarray]) -> list[Any]:
        """``[fn(theta) or the exception it raised, for theta in thetas]`` (same order)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release workers (idempotent)."""

    def request_stop(self, signame: str) -> None:  # noqa: B027 - optional hook
        """A stop was requested (SIGTERM / SIGINT to this process): start no further member and
        pass the signal on to the members in flight where the backend can (the local pool
        does; the default, used by Ray, lets members in flight run to their end)."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@BACKENDS.register("serial")
class SerialBackend(Backend):
    """Members one after another in the calling process (``threads`` torch threads if given)."""

    name = "serial"

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"serial backend: threads must be >= 1, got {threads}")
        self.threads = threads

    def evaluate(self, fn: FitnessFn, thetas: Sequence[np.ndarray]) -> list[Any]:
        previous = None
        if self.threads is not None:
            # deferred: torch is heavy; ES's workers import gbmpo.meta without it
            import torch

            previous = torch.get_num_threads()
            torch.set_num_threads(self.threads)
        out: list[Any] = []
        try:
            for theta in thetas:
                try:
                    out.append(fn(theta))
                except Exception as e:  # a failing member must not stop the population
                    out.append(e)
        finally:
            if previous is not None:
                torch.set_num_threads(previous)
        return out

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "threads": self.threads}


@BACKENDS.register("local")
class LocalPoolBackend(Backend):
    """A process pool on this machine (module docstring)."""

    name = "local"

    def __init__(
        self,
        workers: int | None = None,
        *,
        threads_per_worker: int | None = None,
        start_method: str = "spawn",
    ) -> None:
        cores = available_cores()
        self.workers = workers if workers is not None else cores
        if self.workers < 1:
            raise ValueError(f"local backend: workers must be >= 1, got {self.workers}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"local backend: start_method must be 'spawn' or 'forkserver', got {start_method!r}"
            )
        self.start_method = start_method
        self.threads_per_worker = threads_per_worker or max(1, cores // self.workers)
        self._pool: cf.ProcessPoolExecutor | None = None
        self._futures: list[cf.Future[Any]] = []

    def request_stop(self, signame: str) -> None:
        """Cancel the members not started yet and send ``signame`` to every worker process
        (a member that trains stops after its step, saving a checkpoint)."""
        for fut in self._futures:
            fut.cancel()
        pool = self._pool
        processes = dict(getattr(pool, "_processes", None) or {}) if pool is not None else {}
        for pid in processes:  # (a worker gone already, or a name that is no signal: skip)
            with contextlib.suppress(OSError, AttributeError):
                os.kill(pid, getattr(_signal, signame))

    def _ensure_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=mp.get_context(self.start_method),
                initializer=_set_torch_threads,
                initargs=(self.threads_per_worker,),
            )
        return self._pool

    def evaluate(self, fn: FitnessFn, thetas: Sequence[np.ndarray]) -> list[Any]:
        out = self._run_batch(fn, list(thetas))
        # A dying worker breaks the whole pool, so innocent members in flight fail with it. Rerun
        # each of those alone on a fresh pool: the culprit breaks its pool again and is recorded
        # as failed; the others get their real result.
        for i, res in enumerate(out):
            if isinstance(res, cf.process.BrokenProcessPool):
                out[i] = self._run_batch(fn, [thetas[i]])[0]
        return out

    def _run_batch(self, fn: FitnessFn, thetas: list[np.ndarray]) -> list[Any]:
        pool = self._ensure_pool()
        futures: list[cf.Future[Any] | BaseException] = []
        for t in thetas:
            try:
                futures.append(pool.submit(fn, np.asarray(t)))
            except cf.process.BrokenProcessPool as e:  # broke while we were submitting
                futures.append(e)
        self._futures = [f for f in futures if isinstance(f, cf.Future)]
        out: list[Any] = []
        broken = False
        for fut in futures:
            if isinstance(fut, BaseException):
                broken = True
                out.append(fut)
                continue
            try:
                out.append(fut.result())
            except cf.process.BrokenProcessPool as e:
                broken = True
                out.append(e)
            except (Exception, RunStopped) as e:  # RunStopped: a member stopped on a signal
                out.append(e)
        self._futures = []
        if broken:  # this pool is unusable: start a fresh one next time
            pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "workers": self.workers,
            "threads_per_worker": self.threads_per_worker,
            "start_method": self.start_method,
        }


def _ray_member(fn: FitnessFn, theta: np.ndarray, threads: int) -> float:
    """Body of one Ray task: pin torch threads, then evaluate the member."""
    # deferred: torch is heavy; ES's workers import gbmpo.meta without it
    import torch

    torch.set_num_threads(max(1, threads))
    return fn(theta)


@BACKENDS.register("ray")
class RayBackend(Backend):
    """Ray Core tasks, one per member (module docstring). ``ray`` is imported lazily."""

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        cpus_per_member: int = 1,
        gpus_per_member: float | None = None,
    ) -> None:
        if cpus_per_member < 1:
            raise ValueError(f"ray backend: cpus_per_member must be >= 1, got {cpus_per_member}")
        try:
            # deferred: ray is optional (the ray extra)
            import ray
        except ImportError as e:
            raise ImportError(
                "the 'ray' ES backend needs Ray: pip install 'gbmpo[ray]' (or `pip install ray`)"
            ) from e
        self._ray = ray
        self.address = address
        self._owns_ray = False
        if not ray.is_initialized():
            if address:
                ray.init(address=address)
            else:
                # local instance: no token auth and no dashboard on a single machine
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                ray.init(
                    num_cpus=num_cpus or available_cores(),
                    include_dashboard=False,
                    log_to_driver=True,
                )
            self._owns_ray = True
        cluster_gpus = float(ray.cluster_resources().get("GPU", 0.0))
        self.gpus_per_member = (
            gpus_per_member if gpus_per_member is not None else (1.0 if cluster_gpus > 0 else 0.0)
        )
        self.cpus_per_member = cpus_per_member
        options: dict[str, Any] = {"max_retries": 0}
        if self.gpus_per_member > 0:
            options["num_gpus"] = self.gpus_per_member
            options["num_cpus"] = 1
        else:
            options["num_cpus"] = cpus_per_member
        self._remote = ray.remote(_ray_member).options(**options)

    def evaluate(self, fn: FitnessFn, thetas: Sequence[np.ndarray]) -> list[Any]:
        ray = self._ray
        fn_ref = ray.put(fn)
        refs = [self._remote.remote(fn_ref, np.asarray(t), self.cpus_per_member) for t in thetas]
        out: list[Any] = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except Exception as e:  # RayTaskError, WorkerCrashedError, ...
                out.append(e)
        return out

    def close(self) -> None:
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns_ray = False

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "address": self.address,
            "cpus_per_member": self.cpus_per_member,
            "gpus_per_member": self.gpus_per_member,
        }


def get_backend(name: str, **params: Any) -> Backend:
    """Build the backend registered as ``name`` (``serial``, ``local``, ``ray``)."""
    return BACKENDS.build(name, **params)  # type: ignore[no-any-return]
