"""The sandbox's errors and warning."""

from __future__ import annotations

__all__ = ["SandboxError", "SandboxUnavailableError", "SandboxWarning"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (cannot start a worker, protocol error)."""


class SandboxUnavailableError(SandboxError):
    """A required protection is unavailable on this machine (and the user did not opt in)."""


class SandboxWarning(UserWarning):
    """The sandbox runs with fewer protections than the full design."""
