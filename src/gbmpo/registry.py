"""Name -> object registries, so that a config string selects every pluggable piece.

Every family of pluggable parts (advantage estimators, surrogates, regularizers, aggregation
modes, potentials, tasks, rewards, ...) keeps one :class:`Registry`. An unknown name raises
:class:`UnknownNameError`, whose message lists every valid name.

Plugins. A registry made with ``entry_point_group`` (tasks: ``gbmpo.tasks``, rewards:
``gbmpo.rewards``, regularizers: ``gbmpo.regularizers``) also holds what third-party packages
declare in that Python entry-point group, e.g. in a plugin's ``pyproject.toml``::

    [project.entry-points."gbmpo.rewards"]
    my_reward = "my_pkg.rewards:my_reward"

The entry point's name is the registry name and the object it points at is registered as is (a
task factory, a TRL-style reward function, a regularizer factory). The modules listed in
``$GBMPO_PLUGINS`` (comma-separated; set by the CLI's ``--import``) are imported too, so that
their ``REGISTRY.register`` calls run, in this process and in the processes it starts. Both are
loaded lazily, the first time a name is not found among the registered ones or the full list of
names is asked for, so built-in names keep working whatever plugins are installed. A plugin that
fails to load raises :class:`PluginError` naming the entry point or module.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: environment variable listing plugin modules to import (comma-separated)
PLUGINS_ENV = "GBMPO_PLUGINS"


class PluginError(ImportError):
    """A plugin module or entry point could not be loaded (the message names it)."""


def env_plugin_modules() -> list[str]:
    """The module names of ``$GBMPO_PLUGINS``."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def import_plugin_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Import each module (so that its registrations run); :class:`PluginError` names a module
    that cannot be imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - reported with the module's name
            raise PluginError(
                f"plugin module {name!r} cannot be imported: {type(err).__name__}: {err} "
                f"(from --import / {PLUGINS_ENV}; is it installed or on PYTHONPATH?)"
            ) from err


def add_plugin_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Import ``modules`` now and add them to ``$GBMPO_PLUGINS`` so that child processes (ES
    workers, compare runs) import them too."""
    import_plugin_modules(modules)
    known = env_plugin_modules()
    merged = known + [m for m in modules if m not in known]
    if merged:
        os.environ[PLUGINS_ENV] = ",".join(merged)


class UnknownNameError(KeyError, ValueError):
    """Raised for a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """A mapping from names to objects of one kind (``kind`` is used in error messages)."""

    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._items: dict[str, T] = {}
        self._plugins_loaded = entry_point_group is None
        #: ``name -> "entry point 'x = mod:obj' of distribution d"`` for plugin entries
        self.origins: dict[str, str] = {}

    def load_plugins(self) -> None:
        """Import ``$GBMPO_PLUGINS`` and register this registry's entry points (once)."""
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        import_plugin_modules(env_plugin_modules())
        assert self.entry_point_group is not None
        for ep in metadata.entry_points(group=self.entry_point_group):
            dist = getattr(ep, "dist", None)
            origin = f"entry point '{ep.name} = {ep.value}' (group {self.entry_point_group!r}" + (
                f", distribution {dist.name} {dist.version})" if dist is not None else ")")
            try:
                obj: Any = ep.load()
            except Exception as err:  # noqa: BLE001 - reported with the entry point's name
                self._plugins_loaded = False
                raise PluginError(
                    f"{self.kind} plugin {origin} failed to load: {type(err).__name__}: {err}"
                ) from err
            if ep.name in self._items:
                if self._items[ep.name] is obj:
                    continue
                self._plugins_loaded = False
                raise PluginError(
                    f"{self.kind} plugin {origin} uses the name {ep.name!r}, which is already "
                    f"registered ({self.origins.get(ep.name, 'built in')}); rename the entry point"
                )
            self._items[ep.name] = obj
            self.origins[ep.name] = origin

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; without ``obj``, return a decorator."""

        def _add(o: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = o
            return o

        if obj is None:
            return _add
        return _add(obj)

    def get(self, name: str) -> T:
        """Return the object registered as ``name`` or raise :class:`UnknownNameError`."""
        if name not in self._items:
            self.load_plugins()
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items))
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid names: {valid}"
            ) from None

    def build(self, name: str, /, **params: Any) -> Any:
        """Call the factory (or class) registered as ``name`` with ``params``.

        Raises :class:`UnknownNameError` (listing the valid names) for an unknown name and
        ``TypeError`` naming each parameter the factory does not take, with the ones it does
        (a factory taking ``**kwargs`` accepts any).
        """
        factory: Any = self.get(name)
        try:
            sig = inspect.signature(factory)
        except (TypeError, ValueError):  # a builtin without a signature: let the call check
            return factory(**params)
        kinds = {p.name: p.kind for p in sig.parameters.values()}
        if inspect.Parameter.VAR_KEYWORD not in kinds.values():
            accepted = [
                n for n, k in kinds.items()
                if k in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]  # fmt: skip
            unknown = sorted(set(params) - set(accepted))
            if unknown:
                raise TypeError(
                    f"{self.kind} {name!r} got unknown parameter(s) "
                    f"{', '.join(map(repr, unknown))}; valid parameters: "
                    f"{', '.join(accepted) if accepted else '(none)'}"
                )
        return factory(**params)

    def names(self) -> list[str]:
        self.load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        if name not in self._items:
            self.load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())
