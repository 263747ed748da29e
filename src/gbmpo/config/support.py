"""The support matrix: every config key x every engine -> honoured, refused or no effect.

One config is one experiment on every engine, so each key has one answer per engine:

* ``honoured``: the engine does what the key says, with the own engine's meaning (``how``
  names the host setting it becomes);
* ``refused``: some (or all) values cannot be expressed on that engine; such a value stops the
  run with exit 2 before anything is written, naming the key, its value and the engine
  (``refuse`` says which values, ``how`` says why);
* ``no_effect``: a speed or display key that does not change results on that engine (printed
  once at the start when set to a non-default value).

:func:`check_support` applies the matrix to a config: it raises
:class:`gbmpo.config.ConfigError` for a refused value and returns the notices for
no-effect keys set to non-default values. :func:`gbmpo.config.validate` calls it, so every
engine refuses before anything is written; ``gbmpo train`` prints the notices once.
``docs/cli-and-config.md`` holds the rendered table (:func:`render_markdown`), and a test fails
for a config key without an entry for every engine.
"""

from __future__ import annotations

from typing import Any

from gbmpo.config.hosts.own import GBMPO
from gbmpo.config.hosts.trl import TRL
from gbmpo.config.hosts.verl import VERL, VERL_REQUIRED
from gbmpo.config.matrix import (
    HONOURED,
    NO_EFFECT,
    REFUSED,
    Support,
    Together,
    config_keys,
    default_of,
    never_default,
    probe_settings,
    value_at,
)
from gbmpo.config.schema import TRAIN_ENGINES, ConfigError

__all__ = [
    "ENGINES",
    "GBMPO",
    "HONOURED",
    "NO_EFFECT",
    "REFUSED",
    "SUPPORT",
    "REQUIRED",
    "TRL",
    "VERL",
    "VERL_REQUIRED",
    "Support",
    "Together",
    "check_support",
    "config_keys",
    "probe_settings",
    "render_markdown",
]

#: the engines, in the matrix's column order: the config's ``engine`` values (one tuple, also
#: the names of the engine registry :data:`gbmpo.engines.ENGINES`)
ENGINES: tuple[str, ...] = TRAIN_ENGINES

#: engine -> key -> :class:`Support` (the tables in the order of :data:`ENGINES`)
SUPPORT: dict[str, dict[str, Support]] = dict(zip(ENGINES, (GBMPO, TRL, VERL), strict=True))

#: engine -> the values it needs where the own engine's defaults are refused (a config for that
#: engine starts from these; tests check every other key from there)
REQUIRED: dict[str, dict[str, Any]] = {"gbmpo": {}, "trl": {}, "verl": VERL_REQUIRED}


# ------------------------------------------------------------------- applying the matrix


def _listed(value: Any, cfg: Any) -> bool:
    """Whether ``objective.regularizer`` is a list of terms."""
    return isinstance(value, list)


def check_support(cfg: Any, engine: str | None = None) -> list[str]:
    """Refuse (``ConfigError``, exit 2) a value ``engine`` (default ``cfg.engine``) cannot honour;
    return one notice per no-effect key set to a non-default value."""
    engine = engine or cfg.engine
    table = SUPPORT[engine]
    notices = []
    for key in config_keys():
        entry = table.get(key)
        if entry is None:
            raise ConfigError(f"{key!r} has no entry for engine {engine!r} in the support matrix")
        value = value_at(cfg, key)
        if entry.status == REFUSED:
            refused = (entry.refuse or never_default(key))(value, cfg)
            if refused:
                raise ConfigError(
                    f"{key!r}={value!r} is not supported by engine {engine!r}: {entry.how}"
                )
        elif entry.status == NO_EFFECT and value != default_of(key):
            notices.append(f"{key}={value!r} has no effect on results with engine {engine!r} "
                           f"({entry.how})")  # fmt: skip
    notices.extend(placement_notes(cfg))
    return notices


#: advantages divided by a standard deviation (``placement: reward`` is then rescaled)
STD_NORMALISED: tuple[str, ...] = ("grpo", "batch")


def placement_notes(cfg: Any) -> list[str]:
    """One note when a term is placed in the reward and the advantage divides by a standard
    deviation: the penalty then reaches the gradient as beta / sigma_g (each group's std), so
    it is the exact KL-regularised gradient only with ``dr_grpo`` (Dr. GRPO)."""
    placed = [t.name for t in cfg.objective.terms
              if t.placement == "reward" and t.name != "none" and t.coef != 0]  # fmt: skip
    if not placed or cfg.objective.advantage not in STD_NORMALISED:
        return []
    return [
        f"objective.regularizer.placement=reward ({', '.join(placed)}) with objective.advantage="
        f"{cfg.objective.advantage}: the penalty is subtracted before the advantages are divided "
        "by the std, so beta is divided by each group's std (exact only with advantage: "
        "dr_grpo, Dr. GRPO); placement: advantage adds it after the normalisation (FRPO)"
    ]


def _cell_text(text: str) -> str:
    """Table-cell Markdown: ``|`` escaped; outside code spans ``<``/``>`` written as entities
    (so that ``reg/<name>`` is not read as an HTML tag) and ``_``/``*`` escaped (so that
    ``CUDA_VISIBLE_DEVICES`` is not read as emphasis)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = (parts[i].replace("<", "&lt;").replace(">", "&gt;")
                    .replace("_", "\\_").replace("*", "\\*"))
    return "`".join(parts).replace("|", "\\|")


def _label(e: Support) -> str:
    """What happens, in words: a refusal with a ``refuse`` test refuses only some values."""
    if e.status == HONOURED:
        head = "honoured"
    elif e.status == NO_EFFECT:
        head = "no effect"
    elif e.refuse is None:
        head = "**only the default**"
    else:
        head = "honoured, **some values refused**"
    return head + (f": {_cell_text(e.how)}" if e.how else "")


def render_markdown() -> str:
    """The matrix as Markdown: one table per top-level section of the config (its heading
    anchored ``support-SECTION``), one row per key and engine, a key whose three entries are
    alike on one row ("all engines")."""
    sections: dict[str, list[str]] = {}
    for key in config_keys():
        sections.setdefault(key.split(".", 1)[0], []).append(key)
    out: list[str] = []
    for section, keys in sections.items():
        out += [f"### `{section}` {{#support-{section}}}", "",
                "| key | engine | what happens |", "|---|---|---|"]  # fmt: skip
        for key in keys:
            entries = [SUPPORT[engine][key] for engine in ENGINES]
            # a key breaks only after a dot (docs/stylesheets/extra.css: .config-key)
            shown = f'<code class="config-key">{key.replace(".", ".<wbr>")}</code>'
            if all((e.status, e.how) == (entries[0].status, entries[0].how) for e in entries):
                out.append(f"| {shown} | all engines | {_label(entries[0])} |")
                continue
            for engine, e in zip(ENGINES, entries, strict=True):
                out.append(f"| {shown} | {engine} | {_label(e)} |")
                shown = ""
        out.append("")
    return "\n".join(out)
