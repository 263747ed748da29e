r"""``GBMPOConfig``: TRL's ``GRPOConfig`` plus gbmpo's objective knobs, checked and mapped onto
an objective spec when it is built (see :mod:`gbmpo.integrations.trl` for the ``beta`` /
``regularizer_coef`` rule).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from transformers.generation.configuration_utils import STATIC_CACHE_IMPLEMENTATIONS
from trl import GRPOConfig

from gbmpo.config.hosts.trl import TRL_LOSS_TYPES, TRL_SCALE_REWARDS
from gbmpo.engines.trl.objective import (
    CLIP_MODES,
    LOSS_TYPE_AGGREGATION,
    LOSS_TYPE_SURROGATES,
    REGULARIZER_ANCHORS,
    TRL_CORRECTION_DEFAULTS,
    check_reward_placement,
    refuse_advantage_placement,
    rollout_correction_args,
    spec_from_trl_fields,
)
from gbmpo.objectives.regularizers import REGULARIZERS, get_regularizer
from gbmpo.objectives.spec import ObjectiveSpec, SpecError, parse_coefficient
from gbmpo.objectives.surrogates import SURROGATES

__all__ = ["GBMPOConfig"]

#: GBMPOConfig's alias fields (TRL's spelling of the objective) and their defaults; with
#: ``objective=`` they must keep these values.
_ALIAS_DEFAULTS: dict[str, Any] = {
    "regularizer": "kl_k3",
    "regularizer_coef": None,
    "regularizer_anchor": "ref",
    "regularizer_clamp": None,
    "mirror_path": None,
    "clip_mode": "ratio",
    "atr_delta": None,
    "dual_clip_c": None,
    "rpg_variant": "none",
    "rpg_beta": 0.0,
    "monitor_regularizers": False,
}

#: Former GBMPOConfig fields -> the field that replaces each (refused, naming it).
_RENAMED_FIELDS: dict[str, str] = {
    "log_all_regularizers": "monitor_regularizers",
    "monitor_reference": "monitor_regularizers",
}

def _clampable(name: str) -> bool:
    """Whether the registered regularizer ``name`` takes a ``clamp`` (it declares it itself:
    ``Regularizer.clampable``)."""
    if name not in REGULARIZERS:
        return False
    try:
        return bool(getattr(get_regularizer(name), "clampable", False))
    except Exception:  # noqa: BLE001 - one that needs parameters: reported when it is built
        return False


def _clampable_names() -> list[str]:
    return [n for n in REGULARIZERS.names() if _clampable(n)]



@dataclass
class GBMPOConfig(GRPOConfig):
    r"""``GRPOConfig`` plus gbmpo's objective knobs (every TRL field keeps its meaning; each
    added field is described where it is defined).

    Every default is ``GRPOConfig``'s, ``use_bias_correction_kl=True`` included (a TRL config
    swapped in trains the same KL gradient): it maps ``regularizer="kl_k3"`` onto ``kl_k3_is``,
    TRL's corrected KL (k3 times the token importance ratio, identical at token level); set it
    False for the plain k3. Other regularizers are used as named. With ``objective=`` the spec
    names the regularizer exactly, and ``use_bias_correction_kl`` is rewritten to whether it is
    ``kl_k3_is`` (TRL's ``kl`` metric follows it).

    Every ``GRPOConfig`` field is honoured, mapped onto the gbmpo objective that is the same
    quantity, or refused with the reason (:data:`TRL_FIELDS`). Refused (``ValueError``):
    settings a loss type does not use (``delta`` / ``importance_sampling_level="sequence"`` with
    cispo / sapo / vespo), a cispo cap below 1, vespo with vLLM importance-sampling correction,
    and inconsistent combinations (listed in the errors).
    """

    # TRL's default (True: k3 times the importance ratio, gbmpo's kl_k3_is); see the docstring
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "TRL's importance-weighted k3: True turns regularizer='kl_k3' into 'kl_k3_is' "
            "(TRL's default); with objective= it follows the spec's regularizer."
        },
    )
    regularizer: str = field(
        default="kl_k3",
        metadata={"help": "Per-token regularizer (gbmpo REGULARIZERS name); kl_k3 = TRL's KL."},
    )
    """Per-token regularizer, a :data:`gbmpo.objectives.regularizers.REGULARIZERS` name (``kl_k3`` =
    TRL's KL; the f-divergences' parameters through ``objective=``)."""
    regularizer_coef: float | None = field(
        default=None,
        metadata={"help": "Regularizer coefficient; replaces `beta` (unset: take `beta`)."},
    )
    r"""Its coefficient :math:`\lambda`; ``None`` takes ``beta``, which it replaces (the exact rule:
    :mod:`gbmpo.integrations.trl`)."""
    regularizer_anchor: str = field(
        default="ref",
        metadata={"help": "Anchor of the regularizer: 'ref' (reference model) or 'old' (rollout)."},
    )
    """``ref`` (the frozen reference; with PEFT the adapter-disabled base, TRL's mechanism) or
    ``old`` (the rollout policy's log-probs, RPG's iterative reference; no reference is loaded)."""
    regularizer_clamp: float | None = field(
        default=None,
        metadata={"help": "Clip the regularizer value to [-c, c] (kl_k3, kl_k3_is, rpg_*)."},
    )
    """Clip the regularizer value to ``[-c, c]`` (the ``clampable`` ones: ``kl_k3``, ``kl_k3_is``,
    ``kl_k3_st``, ``rpg_*``; the RPG code uses 10); ``None``: no clip, as TRL."""
    mirror_path: str | None = field(
        default=None,
        metadata={"help": "Neural mirror map file for regularizer='neural_mirror'."},
    )
    """Neural mirror map file (``NeuralMirrorMap.save`` / an ES result) of
    ``regularizer="neural_mirror"``; ``None`` draws the NM-GRPO random init
    (``NeuralMirrorMap.random(0.01, seed=42)``)."""
    clip_mode: str = field(
        default="ratio",
        metadata={"help": "Surrogate clip: 'ratio', 'atr' (ATR-GRPO), 'divergence' (clip by "
                  "clip_measure) or 'rpg_dual'."},
    )
    """``ratio`` (TRL's clip with ``epsilon`` / ``epsilon_high`` / ``delta``; GSPO's sequence ratio
    with ``importance_sampling_level="sequence"``), ``atr`` (ATR-GRPO, bounds from ``atr_delta``;
    ``epsilon`` ignored), ``divergence`` (the ``divergence_clip`` surrogate, ``clip_measure``) or
    ``rpg_dual`` (RPG-style: ``epsilon`` / ``epsilon_high`` plus ``dual_clip_c``, default 3)."""
    atr_delta: float | None = field(
        default=None,
        metadata={"help": "KL3 radius delta of clip_mode='atr'."},
    )
    r"""KL3 radius :math:`\delta` of ``clip_mode="atr"`` (required there)."""
    clip_measure: str | None = field(
        default=None,
        metadata={"help": "Divergence of clip_mode='divergence': ratio, k1, k2, k3, prob_l2, "
                  "neural_mirror."},
    )
    """The measure of ``clip_mode="divergence"``: ``ratio``, ``k1``, ``k2``, ``k3``, ``prob_l2``,
    ``neural_mirror``."""
    clip_delta: float | None = field(
        default=None,
        metadata={"help": "Radius delta of clip_mode='divergence' (lower side if "
                  "clip_delta_high is set)."},
    )
    r"""The radius :math:`\delta` of ``clip_mode="divergence"`` (required; the lower side's when
    ``clip_delta_high`` is set)."""
    clip_delta_high: float | None = field(
        default=None,
        metadata={"help": "Upper-side radius of clip_mode='divergence' (default clip_delta)."},
    )
    """The upper side's radius (default ``clip_delta``)."""
    clip_mirror_path: str | None = field(
        default=None,
        metadata={"help": "Neural mirror map file for clip_measure='neural_mirror'."},
    )
    """The mirror map file of ``clip_measure="neural_mirror"``."""
    dual_clip_c: float | None = field(
        default=None,
        metadata={"help": "Dual-clip constant c > 1 (default 3 with clip_mode='rpg_dual')."},
    )
    """Dual-clip constant ``c > 1`` for negative advantages; optional with ``ratio`` / ``atr`` /
    ``divergence``, default 3.0 with ``rpg_dual``."""
    rpg_variant: str = field(
        default="none",
        metadata={"help": "RPG regularized advantage with rpg_dual: 'none', 'urkl' or 'rkl'."},
    )
    r"""With ``rpg_dual``, RPG's regularized advantage: ``none`` (plain A), ``urkl``
    (:math:`A - \beta_{\text{rpg}}\log w`) or ``rkl``."""
    rpg_beta: float = field(
        default=0.0,
        metadata={"help": "Coefficient of rpg_variant's regularized advantage."},
    )
    r""":math:`\beta_{\text{rpg}}` of ``rpg_variant`` (``urkl`` / ``rkl`` only)."""
    monitor_regularizers: bool = field(
        default=False,
        metadata={
            "help": "Log reg/<name> = D(pi_old || pi_ref) for every registered regularizer (loads "
            "the reference model even when the loss does not use it)."
        },
    )
    r"""Log ``reg/<name>`` = :math:`D(\pi_{old}\,\|\,\pi_{ref})` for every registered regularizer
    (the objective section's setting); it needs the reference, so ``beta`` becomes TRL's switch
    for loading it (1 when the loss needs none; the loss uses ``regularizer_coef``). ``False``
    here; with ``objective=`` the spec's decides (default ``True``, as ``gbmpo train``)."""
    compile_generation: bool = field(
        default=False,
        metadata={"help": "Let transformers compile the decode step of generate (on CUDA, with "
                  "cache_implementation='static'); TRL disables that compilation."},
    )
    """Generation without vLLM: ``True`` lets transformers' ``generate`` compile the model's
    decode step (``torch.compile``, ``CompileConfig``'s default mode ``reduce-overhead``: CUDA
    graphs), which it does on CUDA with a static cache only; TRL builds its generation config
    with ``disable_compile=True`` and GBMPOTrainer clears that flag. It needs
    ``cache_implementation="static"`` (or ``generation_kwargs`` naming a static cache) and no
    vLLM; ``False``: TRL's behaviour. ``gbmpo train --engine trl`` sets it from
    ``rollout.decode_step``."""
    objective: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "gbmpo objective spec (the `objective:` section of a gbmpo config, as a dict, "
            "a YAML file path or an ObjectiveSpec); replaces the alias fields above, loss_type "
            "and scale_rewards."
        },
    )
    """The gbmpo objective spec (a dict, a YAML path or an ``ObjectiveSpec``); it replaces the
    alias fields above, ``loss_type`` and ``scale_rewards``."""

    def __post_init__(self) -> None:
        self._validate_gbmpo()
        # TRL 1.16 sets gradient_checkpointing (True by default), which transformers 5 reads as
        # a deprecated alias of activation_checkpointing and warns about; the same value under
        # the new name (when that is unset) keeps the setting and drops the warning.
        if getattr(self, "activation_checkpointing", False) is None:
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        self._check_compile_generation()
        accum = self.gradient_accumulation_steps
        if self.loss_type == "bnpo" and self.steps_per_generation % accum:
            raise ValueError(
                f"GBMPOConfig: loss_type='bnpo' is the token mean of each optimizer step, whose "
                f"micro-batches must come from one generation batch: steps_per_generation="
                f"{self.steps_per_generation} must be a multiple of gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}"
            )

    def _check_compile_generation(self) -> None:
        """``compile_generation`` needs transformers' generation with a static cache (the only
        one transformers compiles the decode step for): refused with vLLM or another cache."""
        if not self.compile_generation:
            return
        if self.use_vllm:
            raise ValueError("GBMPOConfig: compile_generation is transformers' generation; "
                             "use_vllm=True generates with vLLM")  # fmt: skip
        extra = self.generation_kwargs if isinstance(self.generation_kwargs, dict) else {}
        cache = extra.get("cache_implementation", self.cache_implementation)
        if cache not in STATIC_CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"GBMPOConfig: compile_generation needs a static cache (cache_implementation in "
                f"{STATIC_CACHE_IMPLEMENTATIONS}), got {cache!r}: transformers compiles the "
                "decode step only with one"
            )

    def _validate_gbmpo(self) -> None:
        if self.objective is not None:
            self._apply_objective_spec()
        if self.regularizer not in REGULARIZERS:
            REGULARIZERS.get(self.regularizer)  # raises UnknownNameError listing valid names
        if self.regularizer_anchor not in REGULARIZER_ANCHORS:
            raise ValueError(
                f"GBMPOConfig: unknown regularizer_anchor {self.regularizer_anchor!r}; valid: "
                f"{', '.join(REGULARIZER_ANCHORS)}"
            )
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(
                f"GBMPOConfig: unknown clip_mode {self.clip_mode!r}; valid: {', '.join(CLIP_MODES)}"
            )
        if self.loss_type not in LOSS_TYPE_AGGREGATION:
            raise ValueError(
                f"GBMPOConfig: unknown loss_type {self.loss_type!r}; supported: "
                f"{', '.join(LOSS_TYPE_AGGREGATION)}"
            )
        if self.objective is not None:
            self.use_bias_correction_kl = self._built[1].spec.regularizer_label == "kl_k3_is"
        elif self.use_bias_correction_kl:
            self._map_bias_correction_kl()
        if self.loss_type in LOSS_TYPE_SURROGATES and self.objective is None:
            self._check_loss_type_surrogate()
        self._resolve_coefficient()
        if self.objective is not None:  # built once by _apply_objective_spec
            return
        if self.mirror_path is not None and self.regularizer != "neural_mirror":
            raise ValueError(
                f"GBMPOConfig: mirror_path is set but regularizer={self.regularizer!r}; "
                "mirror_path is used only by regularizer='neural_mirror'"
            )
        if self.regularizer_clamp is not None and not _clampable(self.regularizer):
            raise ValueError(
                f"GBMPOConfig: regularizer_clamp is set but regularizer {self.regularizer!r} takes "
                f"no clamp (only {', '.join(_clampable_names())})"
            )
        if self.clip_mode == "atr":
            if self.atr_delta is None:
                raise ValueError("GBMPOConfig: clip_mode='atr' needs atr_delta (KL3 radius > 0)")
        elif self.atr_delta is not None:
            raise ValueError(
                f"GBMPOConfig: atr_delta is set but clip_mode={self.clip_mode!r}; "
                "set clip_mode='atr' to use it"
            )
        divergence_fields = {
            "clip_measure": self.clip_measure,
            "clip_delta": self.clip_delta,
            "clip_delta_high": self.clip_delta_high,
            "clip_mirror_path": self.clip_mirror_path,
        }
        if self.clip_mode == "divergence":
            if self.clip_measure is None or self.clip_delta is None:
                raise ValueError(
                    "GBMPOConfig: clip_mode='divergence' needs clip_measure and clip_delta"
                )
        elif any(v is not None for v in divergence_fields.values()):
            given = ", ".join(k for k, v in divergence_fields.items() if v is not None)
            raise ValueError(
                f"GBMPOConfig: {given} set but clip_mode={self.clip_mode!r}; set "
                "clip_mode='divergence' to use them"
            )
        if self.clip_mode != "ratio":
            if self.importance_sampling_level != "token":
                raise ValueError(
                    f"GBMPOConfig: clip_mode={self.clip_mode!r} clips token ratios; "
                    "importance_sampling_level='sequence' (GSPO) works only with clip_mode='ratio'"
                )
            if self.delta is not None:
                raise ValueError(
                    f"GBMPOConfig: TRL's delta (cap on the unclipped ratio) works only with "
                    f"clip_mode='ratio', not {self.clip_mode!r}"
                )
        if self.clip_mode != "rpg_dual" and (self.rpg_variant != "none" or self.rpg_beta != 0):
            raise ValueError(
                "GBMPOConfig: rpg_variant / rpg_beta are used only with clip_mode='rpg_dual'"
            )
        # Build the objective once: surrogate / regularizer parameter errors surface here; the
        # trainer uses this build unless a field changed since (build_objective compares specs).
        spec = spec_from_trl_fields(self)
        self._built = (spec.to_dict(), spec.build())

    def _map_bias_correction_kl(self) -> None:
        r"""TRL's ``use_bias_correction_kl=True`` (its k3 times the token importance ratio
        :math:`\pi_\theta/\pi_{old}`) is gbmpo's ``kl_k3_is``: ``kl_k3`` becomes ``kl_k3_is``;
        any other regularizer is not TRL's k3 and stays as named. Refused where TRL would weight
        an active k3 by the sequence ratio (GSPO), which ``kl_k3_is`` does not."""
        if self.regularizer != "kl_k3":
            return
        coef = self.regularizer_coef if self.regularizer_coef is not None else self.beta
        if self.importance_sampling_level != "token":
            if coef != 0:
                raise ValueError(
                    "GBMPOConfig: use_bias_correction_kl=True with importance_sampling_level="
                    f"{self.importance_sampling_level!r}: TRL then weights the KL by the sequence "
                    "ratio; gbmpo's kl_k3_is weights it by the token ratio. Set "
                    "use_bias_correction_kl=False or importance_sampling_level='token'"
                )
            return
        self.regularizer = "kl_k3_is"

    def _check_loss_type_surrogate(self) -> None:
        """``loss_type`` in cispo / sapo / vespo selects the gbmpo surrogate of that name; the
        TRL settings it does not use are refused rather than ignored."""
        name = self.loss_type
        if name not in SURROGATES:
            raise ValueError(
                f"GBMPOConfig: loss_type={name!r} needs gbmpo's {name!r} surrogate, which this "
                f"gbmpo does not register (surrogates: {', '.join(SURROGATES.names())})"
            )
        if self.clip_mode != "ratio":
            raise ValueError(
                f"GBMPOConfig: loss_type={name!r} selects the {name} surrogate; clip_mode="
                f"{self.clip_mode!r} selects another. Use one: loss_type in grpo, bnpo, dr_grpo, "
                "dapo, luspo with clip_mode, or clip_mode='ratio'"
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                f"GBMPOConfig: loss_type={name!r} with importance_sampling_level="
                f"{self.importance_sampling_level!r}: gbmpo's {name} surrogate is token level"
                + (" (VESPO already weights by the sequence ratio)" if name == "vespo" else "")
                + "; set importance_sampling_level='token'"
            )
        if self.delta is not None:
            raise ValueError(
                f"GBMPOConfig: delta={self.delta:g} caps the clipped ratio of the clip loss types; "
                f"TRL's {name} does not use it. Unset delta"
            )
        if self.dual_clip_c is not None:
            raise ValueError(f"GBMPOConfig: dual_clip_c is not used by loss_type={name!r}")
        if name == "cispo":
            cap = self.epsilon_high if self.epsilon_high is not None else self.epsilon
            if cap < 1.0:
                raise ValueError(
                    f"GBMPOConfig: loss_type='cispo' caps the importance weight at epsilon_high "
                    f"(here {cap:g}{', from epsilon' if self.epsilon_high is None else ''}); a "
                    "cap below 1 would scale down the gradient of every on-policy token. Set "
                    "epsilon_high to the cap, e.g. 5.0 (ScaleRL, TRL's recommendation)"
                )
        if name == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "GBMPOConfig: loss_type='vespo' with vLLM importance-sampling correction: TRL "
                "folds the sampler ratio into VESPO's sequence weight, which gbmpo's vespo "
                "surrogate does not take. Set vllm_importance_sampling_correction=False"
            )

    def _apply_objective_spec(self) -> None:
        """``objective=`` given: parse the spec and build it once (kept for the trainer), refuse
        alias fields set beside it, and set the fields it determines (``loss_type``,
        ``scale_rewards``, ``monitor_regularizers``); ``beta`` follows in
        :meth:`_resolve_coefficient`. The spec is stored back as a dict (``GRPOConfig`` fields
        stay plain data)."""
        spec = ObjectiveSpec.load(self.objective)
        built = spec.build()
        # monitor_regularizers may also repeat the spec's value (it is set from it below)
        changed = [
            name
            for name, default in _ALIAS_DEFAULTS.items()
            if getattr(self, name) != default
            and not (name == "monitor_regularizers"
                     and getattr(self, name) == spec.monitor_regularizers)
        ]
        if changed:
            raise ValueError(
                f"GBMPOConfig: objective= is given, so the alias fields must keep their defaults; "
                f"got {', '.join(changed)} (put them into the objective spec instead)"
            )
        coefs = spec.coef_label
        try:
            beta = parse_coefficient(self.beta, "beta")
        except SpecError as err:
            raise ValueError(f"GBMPOConfig: {err}") from None
        if beta not in (0.0, *(coefs if isinstance(coefs, list) else [coefs])):
            raise ValueError(
                f"GBMPOConfig: beta={beta:g} disagrees with the objective's "
                f"regularizer.coef={coefs}; leave beta at 0"
            )
        check_reward_placement(spec, self)
        refuse_advantage_placement(spec)
        if spec.aggregation not in TRL_LOSS_TYPES or spec.advantage not in TRL_SCALE_REWARDS:
            raise ValueError(
                f"GBMPOConfig: the objective's aggregation {spec.aggregation!r} / advantage "
                f"{spec.advantage!r} has no TRL counterpart; supported aggregations: "
                f"{', '.join(TRL_LOSS_TYPES)}; advantages: {', '.join(TRL_SCALE_REWARDS)}"
            )
        self._apply_rollout_correction(spec)
        self.objective = spec.to_dict()
        self._built = (spec.to_dict(), built)
        self.loss_type = TRL_LOSS_TYPES[spec.aggregation]
        self.scale_rewards = TRL_SCALE_REWARDS[spec.advantage]
        self.monitor_regularizers = spec.monitor_regularizers

    def _apply_rollout_correction(self, spec: ObjectiveSpec) -> None:
        """The spec's ``rollout_correction`` decides TRL's vLLM importance sampling and the
        off-policy mask (mode ``none``: TRL's correction off, whatever TRL's default); a TRL field
        set away from TRL's default to another value is refused (put it into the spec)."""
        wanted = rollout_correction_args(spec.rollout_correction)
        clash = [f"{k}={getattr(self, k)!r}" for k, d in TRL_CORRECTION_DEFAULTS.items()
                 if getattr(self, k) != d and getattr(self, k) != wanted.get(k, d)]
        if clash:
            raise ValueError(
                f"GBMPOConfig: objective= is given, so its rollout_correction section sets TRL's "
                f"vLLM importance sampling; got {', '.join(clash)} (put them into "
                "objective.rollout_correction instead)"
            )
        for key, value in wanted.items():
            setattr(self, key, value)

    def _resolve_coefficient(self) -> None:
        if self.objective is not None:  # the spec's coefficient (checked by its build)
            built = self._built[1]
            # beta: the coefficient of the first active term anchored on the reference (any
            # nonzero value switches TRL's reference forward on; GBMPOTrainer's loss replaces
            # TRL's use of it), 0 without one
            ref_coefs = [t.coef for t in built.terms if t.active and t.needs_ref]
            self._set_beta(ref_coefs[0] if ref_coefs else 0.0, built.anchored_on_ref)
            self._check_sync_ref_model(built.spec.regularizer_label,
                                       "+".join(t.anchor for t in built.terms),
                                       "+".join(f"{t.coef:g}" for t in built.terms))  # fmt: skip
            return
        # the objective's one rule for a coefficient (gbmpo.objectives.spec.parse_coefficient):
        # a number or a numeric string ("5e-2"), finite and >= 0
        try:
            beta = parse_coefficient(self.beta, "beta")
            coef = beta if self.regularizer_coef is None else parse_coefficient(
                self.regularizer_coef, "regularizer_coef")
        except SpecError as err:
            raise ValueError(f"GBMPOConfig: {err}") from None
        if self.regularizer_coef is not None and beta != 0.0 and beta != coef:
            raise ValueError(
                f"GBMPOConfig: beta={beta:g} and regularizer_coef={coef:g} disagree. "
                "regularizer_coef replaces TRL's beta: set only regularizer_coef (or set both to "
                "the same value)"
            )
        if self.regularizer == "none" and coef != 0:
            raise ValueError(
                f"GBMPOConfig: regularizer='none' but the coefficient is {coef:g} (from "
                f"{'beta' if self.regularizer_coef is None else 'regularizer_coef'}); set it to 0 "
                "or choose a regularizer"
            )
        self.regularizer_coef = coef
        self._set_beta(coef, self.needs_reference_model)
        self._check_sync_ref_model(self.regularizer, self.regularizer_anchor, f"{coef:g}")

    def _set_beta(self, coef: float, needs_reference: bool) -> None:
        # TRL loads the reference model and computes its log-probs exactly when beta != 0; TRL's
        # own use of beta (its KL term) is replaced by GBMPOTrainer's loss, so when only the
        # monitored divergences need the reference, beta = 1 just switches it on.
        if needs_reference:
            self.beta = coef
        else:
            self.beta = 1.0 if self.monitor_regularizers else 0.0

    def _check_sync_ref_model(self, regularizer: str, anchor: str, coef: str) -> None:
        """``regularizer``, ``anchor`` and ``coef``: the terms' names, anchors and coefficients
        joined by ``+`` (one term: its own), for the message."""
        if self.sync_ref_model and not (self.needs_reference_model or self.monitor_regularizers):
            raise ValueError(
                "GBMPOConfig: sync_ref_model=True but no reference model is used "
                f"(regularizer={regularizer!r}, anchor={anchor!r}, coefficient={coef})"
            )

    def __getstate__(self) -> dict[str, Any]:
        # the built objective holds functions and is rebuilt from the fields where needed
        # (HF's Trainer pickles its arguments into every checkpoint)
        state = dict(self.__dict__)
        state.pop("_built", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def needs_reference_model(self) -> bool:
        """True when the loss needs the reference model's log-probs (TRL's ``beta != 0``)."""
        if self.objective is not None:
            if getattr(self, "_built", None) is None:  # e.g. unpickled from a checkpoint
                spec = ObjectiveSpec.load(self.objective)
                self._built = (spec.to_dict(), spec.build())
            return bool(self._built[1].anchored_on_ref)
        coef = self.regularizer_coef if self.regularizer_coef is not None else self.beta
        return self.regularizer != "none" and self.regularizer_anchor == "ref" and coef != 0


def _refuse_renamed_fields(init: Any) -> Any:
    """Wrap the dataclass ``__init__`` so that a former field name (:data:`_RENAMED_FIELDS`) is
    refused with the name that replaces it (a setting is honoured or refused, never aliased)."""
    @functools.wraps(init)
    def __init__(self: GBMPOConfig, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        for old, new in _RENAMED_FIELDS.items():
            if old in kwargs:
                raise TypeError(
                    f"GBMPOConfig: {old!r} was renamed: use {new!r} (one setting for the "
                    "monitored divergences reg/<name>, the objective section's name)"
                )
        init(self, *args, **kwargs)

    return __init__


GBMPOConfig.__init__ = _refuse_renamed_fields(GBMPOConfig.__init__)  # type: ignore[method-assign]
