"""What every subcommand shares: argument types, the ``--section.key VALUE`` overrides, and the
error -> exit-code map.

Exit codes: 0 success; 2 bad input (:func:`input_errors`: unknown key or name, wrong type,
missing model or data file, a reward function that fails for a whole batch, a missing sandbox
layer, an output directory in use...), reported in one line naming the cause; 1 when no intact
checkpoint is left or one could not be written (:class:`gbmpo.io.CheckpointError`); a
subcommand may return 1 for its own partial failures (``compare``: some runs failed); 143 /
130 for a run stopped by SIGTERM / SIGINT after writing a checkpoint (one line naming it and the
resume command).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gbmpo.config import ConfigError, annotation_at, canonical_key
from gbmpo.experiments.runs import RunDirError
from gbmpo.io import CheckpointError, RunDirInUseError, RunStopped
from gbmpo.objectives.spec import did_you_mean
from gbmpo.registry import PluginError, UnknownNameError
from gbmpo.rewards.scoring import RewardError
from gbmpo.sandbox import SandboxUnavailableError
from gbmpo.train import DataError

__all__ = [
    "UsageError",
    "flag_hint",
    "input_errors",
    "one_line",
    "own_flags",
    "parse_overrides",
    "positive_int",
    "report_errors",
    "split_imports",
    "unrecognized",
]


class UsageError(ValueError):
    """Malformed command-line arguments."""


def positive_int(text: str) -> int:
    """``argparse`` type of the subcommands' counts: an integer ``>= 1``."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def own_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The ``--long`` options a (sub)command's parser defines itself."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def flag_hint(token: str, flags: Sequence[str]) -> str:
    """``"; did you mean '--dry-run'?"`` for the option in ``flags`` closest to ``token``."""
    word = token.split("=", 1)[0].lstrip("-")
    return did_you_mean(word, {f.lstrip("-"): f for f in flags}) if word else ""


def unrecognized(extra: Sequence[str], flags: Sequence[str]) -> UsageError:
    """The one-line error for arguments a subcommand does not take, with a "did you mean" for
    the first option among them."""
    first = next((t for t in extra if t.startswith("-")), "")
    return UsageError(f"unrecognized arguments: {' '.join(extra)}{flag_hint(first, flags)}")


def parse_overrides(tokens: Sequence[str], flags: Sequence[str] = ()) -> list[tuple[str, Any]]:
    """``["--optim.lr", "1e-4", "--lora", "--steps=5"]`` -> ``[(key, value-or-True), ...]``.

    A flag without a value means ``true`` (only valid for boolean keys). Every key is checked
    here: an unknown one raises :class:`~gbmpo.config.ConfigError` with a "did you mean"
    among the config keys or, failing that, among the subcommand's own options ``flags``.
    """
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or tok == "--":
            raise UsageError(f"unexpected argument {tok!r}; settings look like --section.key VALUE")
        body = tok[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            key, value = body, tokens[i + 1]
            i += 2
        else:
            key, value = body, None
            i += 1
        try:
            tp = annotation_at(canonical_key(key).split("."))
        except ConfigError as err:
            hint = "" if "did you mean" in str(err) else flag_hint(key, flags)
            if hint:
                raise ConfigError(f"{err}{hint}") from None
            raise
        if value is None:
            if tp is not bool:
                raise UsageError(f"--{key} needs a value")
            value = "true"
        out.append((key, value))
    return out


def split_imports(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Take every ``--import MODULE`` / ``--import=MODULE`` (comma lists allowed) out of
    ``tokens``; returns ``(other tokens, modules)``."""
    rest: list[str] = []
    modules: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--import":
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("-"):
                raise SystemExit("gbmpo: error: --import needs a module name")
            value, i = tokens[i + 1], i + 2
        elif tok.startswith("--import="):
            value, i = tok.split("=", 1)[1], i + 1
        else:
            rest.append(tok)
            i += 1
            continue
        modules += [m.strip() for m in value.split(",") if m.strip()]
    return rest, modules


def input_errors(*extra: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The exceptions that are bad input (exit code 2) for every subcommand, plus ``extra``
    (a subcommand's own, e.g. ``ValueError`` for ``es`` and ``report``)."""
    return (UsageError, ConfigError, DataError, RewardError, UnknownNameError, FileNotFoundError,
            PluginError, SandboxUnavailableError, RunDirInUseError, RunDirError, *extra)


_BREAKS = {ord(c): c.encode("unicode_escape").decode("ascii")
           for c in "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(err: BaseException | str) -> str:
    """An error message on one line: its lines joined with ``"; "``, and any other character
    that breaks a line (a carriage return from the user's input, ...) escaped."""
    text = str(err).translate(_BREAKS)
    return "; ".join(ln.strip() for ln in text.split("\n") if ln.strip())


def report_errors(
    command: str, run: Callable[[], int], *, extra: tuple[type[BaseException], ...] = ()
) -> int:
    """``run()``'s exit code; bad input (:func:`input_errors` plus ``extra``) is reported on
    stderr in one line as ``gbmpo COMMAND: error: ...`` and gives 2, a checkpoint that cannot be
    read or written (:class:`gbmpo.io.CheckpointError`) gives 1; a run stopped by SIGTERM /
    SIGINT (:class:`gbmpo.io.RunStopped`) prints its one line and gives 143 / 130, Ctrl-C
    elsewhere prints ``interrupted`` and gives 130."""
    try:
        return int(run())
    except RunStopped as err:  # SIGTERM / SIGINT: the checkpoint and the resume command
        print(f"gbmpo {command}: {one_line(err)}", file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a training loop: nothing to save
        print(f"gbmpo {command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except input_errors(*extra) as err:
        print(f"gbmpo {command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # no intact checkpoint, or one could not be written
        print(f"gbmpo {command}: error: {one_line(err)}", file=sys.stderr)
        return 1
