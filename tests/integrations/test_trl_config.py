"""GBMPOConfig validation, the beta / regularizer_coef rule, lazy TRL import, hook checks."""

from __future__ import annotations

import dataclasses
import inspect
import math
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from gbmpo.engines.trl.internals import _HOOKED_METHODS  # noqa: E402
from gbmpo.integrations.trl import (  # noqa: E402
    GBMPOConfig,
    GBMPOTrainer,
    TRLInternalsError,
    build_objective,
    check_trl_internals,
    dapo_normalizer,
)
from gbmpo.objectives.surrogates import atr_bounds  # noqa: E402
from gbmpo.registry import UnknownNameError  # noqa: E402

BASE: dict[str, Any] = {"output_dir": "unused", "use_cpu": True, "bf16": False,
                        "report_to": "none"}


def cfg(**kw: Any) -> GBMPOConfig:
    return GBMPOConfig(**{**BASE, **kw})


# --- defaults and the beta / regularizer_coef rule -------------------------------------------


def test_defaults_match_trl_defaults() -> None:
    c, t = cfg(), GRPOConfig(**BASE)
    # TRL's default use_bias_correction_kl=True: its k3 times the token ratio, gbmpo's kl_k3_is
    assert (c.regularizer, c.regularizer_coef, c.regularizer_anchor) == ("kl_k3_is", 0.0, "ref")
    assert c.beta == t.beta == 0.0 and not c.needs_reference_model
    assert (c.loss_type, c.epsilon, c.clip_mode) == (t.loss_type, t.epsilon, "ratio")
    obj = build_objective(c)
    assert obj.spec.surrogate.name == "clip" and obj.aggregation == "bnpo"
    assert obj.terms[0].coef == 0.0
    assert c.use_bias_correction_kl is t.use_bias_correction_kl is True
    assert cfg(use_bias_correction_kl=False, beta=0.04).regularizer == "kl_k3"
    # not TRL's k3: used as named; at coefficient 0 GSPO is not refused (nothing to weight)
    assert cfg(regularizer="prob_l2", beta=0.04).regularizer == "prob_l2"
    assert cfg(importance_sampling_level="sequence").regularizer == "kl_k3"
    # objective=: the spec names the regularizer; the flag follows it
    assert cfg(objective={"regularizer": {"name": "kl_k3", "coef": 0.1}}).use_bias_correction_kl \
        is False
    assert cfg(objective={"regularizer": {"name": "kl_k3_is", "coef": 0.1}},
               use_bias_correction_kl=False).use_bias_correction_kl is True


def test_coef_defaults_to_beta() -> None:
    c = cfg(beta=0.04)
    assert c.regularizer_coef == 0.04 and c.beta == 0.04 and c.needs_reference_model


def test_coef_replaces_beta_and_beta_gates_the_reference_model() -> None:
    c = cfg(regularizer="prob_l2", regularizer_coef=0.1)
    assert c.beta == 0.1 and c.needs_reference_model  # TRL loads the ref model when beta != 0
    c = cfg(regularizer="prob_l2", regularizer_coef=0.1, beta=0.1)  # equal values are fine
    assert c.beta == 0.1
    c = cfg(regularizer="rpg_ufkl", regularizer_coef=0.1, regularizer_anchor="old")
    assert c.beta == 0.0 and c.regularizer_coef == 0.1 and not c.needs_reference_model
    c = cfg(regularizer="kl_k3", regularizer_coef=0.0)
    assert c.beta == 0.0 and not c.needs_reference_model


def test_inconsistent_beta_and_coef_raise() -> None:
    with pytest.raises(ValueError, match="beta=0.04 and regularizer_coef=0.1 disagree"):
        cfg(beta=0.04, regularizer_coef=0.1)
    with pytest.raises(ValueError, match="regularizer='none' but the coefficient is 0.1"):
        cfg(regularizer="none", beta=0.1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        cfg(regularizer_coef=-1.0)


# --- names and refusals ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"regularizer": "kl9"}, UnknownNameError, "valid names: alpha, chi2, fkl, hellinger"),
        ({"clip_mode": "trust"}, ValueError, "valid: ratio, atr, divergence, rpg_dual"),
        ({"clip_mode": "divergence"}, ValueError, "needs clip_measure and clip_delta"),
        ({"clip_mode": "divergence", "clip_measure": "k1"}, ValueError, "needs clip_measure"),
        ({"clip_measure": "k1", "clip_delta": 0.2}, ValueError,
         "clip_measure, clip_delta set but clip_mode='ratio'"),
        ({"clip_mode": "divergence", "clip_measure": "js", "clip_delta": 0.2}, ValueError,
         "unknown measure 'js'"),
        ({"clip_mode": "divergence", "clip_measure": "k1", "clip_delta": 0.2,
          "clip_mirror_path": "m.json"}, ValueError, "mirror is used only"),
        ({"regularizer_anchor": "base"}, ValueError, "valid: ref, old"),
        ({"loss_type": "ppo"}, ValueError,
         "supported: grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo"),
        ({"use_bias_correction_kl": True, "importance_sampling_level": "sequence",
          "beta": 0.04}, ValueError, "weights the KL by the sequence ratio"),
        ({"loss_type": "bnpo", "gradient_accumulation_steps": 2, "steps_per_generation": 3,
          "per_device_train_batch_size": 4, "num_generations": 4}, ValueError,
         "must be a multiple of gradient_accumulation_steps"),
        ({"clip_mode": "atr"}, ValueError, "needs atr_delta"),
        ({"atr_delta": 0.02}, ValueError, "set clip_mode='atr'"),
        ({"clip_mode": "atr", "atr_delta": 0.0}, ValueError, "ATR delta must be finite and > 0"),
        ({"clip_mode": "atr", "atr_delta": 0.02, "importance_sampling_level": "sequence"},
         ValueError, "works only with clip_mode='ratio'"),
        ({"clip_mode": "rpg_dual", "delta": 2.0}, ValueError, "TRL's delta"),
        ({"rpg_variant": "urkl"}, ValueError, "only with clip_mode='rpg_dual'"),
        ({"clip_mode": "rpg_dual", "rpg_variant": "xkl"}, ValueError, "unknown variant"),
        ({"dual_clip_c": 0.5}, ValueError, "must be > 1"),
        ({"mirror_path": "m.json"}, ValueError, "mirror_path is used only"),
        ({"regularizer": "neural_mirror", "mirror_path": "/nonexistent/m.json"},
         FileNotFoundError, "/nonexistent/m.json"),
        ({"regularizer": "prob_l2", "regularizer_clamp": 10.0}, ValueError, "takes no clamp"),
        ({"sync_ref_model": True}, ValueError, "no reference model is used"),
        ({"compile_generation": True}, ValueError, "needs a static cache .* got None"),
        ({"compile_generation": True, "cache_implementation": "static",
          "generation_kwargs": {"cache_implementation": "dynamic"}}, ValueError,
         "got 'dynamic'"),
        ({"compile_generation": True, "cache_implementation": "static", "use_vllm": True},
         ValueError, "use_vllm=True generates with vLLM"),
    ],
)
def test_refusals(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        cfg(**kwargs)


def test_objective_mapping() -> None:
    o = build_objective(cfg(loss_type="dr_grpo", epsilon=0.1, epsilon_high=0.3, delta=1.5,
                            dual_clip_c=4.0, max_completion_length=64))
    assert o.spec.surrogate.name == "clip" and o.aggregation == "dr_grpo"
    assert (o.surrogate.eps_low, o.surrogate.eps_high) == (0.1, 0.3)
    assert (o.surrogate.ratio_cap, o.surrogate.dual_clip_c) == (1.5, 4.0)
    o = build_objective(cfg(importance_sampling_level="sequence", loss_type="grpo"))
    assert o.spec.surrogate.name == "gspo" and o.aggregation == "grpo"
    o = build_objective(cfg(clip_mode="atr", atr_delta=0.02))
    assert o.spec.surrogate.name == "atr" and o.surrogate.bounds == atr_bounds(0.02)
    o = build_objective(cfg(clip_mode="rpg_dual"))
    assert o.spec.surrogate.name == "rpg_clip" and o.surrogate.c == 3.0
    o = build_objective(cfg(clip_mode="divergence", clip_measure="k1", clip_delta=0.2,
                            clip_delta_high=0.3, dual_clip_c=3.0))
    assert o.spec.surrogate.name == "divergence_clip" and o.surrogate.measure == "k1"
    assert o.surrogate.bounds == (math.exp(-0.2), math.exp(0.3)) and o.surrogate.dual_clip_c == 3
    o = build_objective(cfg(clip_mode="divergence", clip_measure="k3", clip_delta=0.02))
    assert o.surrogate.bounds == atr_bounds(0.02)
    o = build_objective(cfg(loss_type="luspo", regularizer="rpg_rkl", regularizer_clamp=10.0))
    assert o.aggregation == "seq_mean_token_sum" and o.terms[0].regularizer.params["clamp"] == 10.0
    o = build_objective(cfg(regularizer="neural_mirror", regularizer_coef=1e-4))
    assert o.terms[0].regularizer.name == "neural_mirror" and o.terms[0].coef == 1e-4


def test_dapo_normalizer() -> None:
    # 96 tokens in the generation batch over 2 processes, 4 accumulation steps, 2 per generation
    z = dapo_normalizer(96, num_processes=2, accumulation_steps=4, steps_per_generation=2,
                        training=True)
    assert float(z) == 96 / 2 * 4 / 2
    assert float(dapo_normalizer(0, num_processes=1, accumulation_steps=1,
                                 steps_per_generation=1, training=False)) == 1.0


def test_trainer_needs_a_gbmpo_config(tiny_model_dir: str, tiny_dataset: Any,
                                      reward_fn: Any) -> None:
    with pytest.raises(TypeError, match="GBMPOTrainer needs a GBMPOConfig, got GRPOConfig"):
        GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=GRPOConfig(**BASE),
                     train_dataset=tiny_dataset)


@pytest.mark.parametrize("compile_generation", [False, True])
def test_compile_generation_clears_trls_disable_compile(
    compile_generation: bool, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TRL builds its generation config with disable_compile=True; compile_generation clears it,
    and transformers' compile decision in generate sees the flag cleared and a static cache (it
    then compiles on CUDA; here, on the CPU, it does not). A static cache named in
    generation_kwargs is taken as well."""
    from transformers.generation.utils import GenerationMixin

    decided = GenerationMixin._valid_auto_compile_criteria
    seen: list[tuple[bool, str, bool]] = []

    def spy(self: Any, model_kwargs: dict[str, Any], generation_config: Any) -> bool:
        compiles = decided(self, model_kwargs, generation_config)
        cache = type(model_kwargs.get("past_key_values")).__name__
        seen.append((generation_config.disable_compile, cache, compiles))
        return compiles

    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", spy)
    args = GBMPOConfig(output_dir=str(tmp_path), compile_generation=compile_generation,
                       generation_kwargs={"cache_implementation": "static"}, max_steps=1,
                       max_completion_length=8, **cpu_args)  # fmt: skip
    trainer = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                           train_dataset=tiny_dataset)  # fmt: skip
    assert trainer.generation_config.cache_implementation == "static"
    assert trainer.generation_config.disable_compile is not compile_generation
    trainer.train()
    assert seen and set(seen) == {(not compile_generation, "StaticCache", False)}


@pytest.mark.parametrize("lora", [False, True])
def test_the_compiled_decode_step_compiles_once_over_steps(
    lora: bool, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any], tmp_path: Any,
) -> None:
    """compile_generation over several TRL steps with activation checkpointing (TRL toggles it
    around every generation) and LoRA or full fine-tuning: transformers' compiled decode step
    is traced once, never recompiled, when the cache length is fixed (generation_kwargs
    max_cache_len, as the engine sets it). transformers compiles only on CUDA, so the test
    asks it to compile on every device (CompileConfig's private _compile_all_devices) with
    dynamo's eager backend: the same tracing and guards, no code generation."""
    import torch
    from peft import LoraConfig
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    args = GBMPOConfig(output_dir=str(tmp_path), compile_generation=True,
                       cache_implementation="static", generation_kwargs={"max_cache_len": 64},
                       max_steps=3, max_completion_length=8,
                       **{**cpu_args, "gradient_checkpointing": True})  # fmt: skip
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM") if lora else None  # fmt: skip
    trainer = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                           train_dataset=tiny_dataset, peft_config=peft)  # fmt: skip
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True
    trainer.generation_config.compile_config = compile_config
    torch._dynamo.reset()
    counters.clear()
    trainer.train()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]


def test_one_input_gradient_hook_over_steps(tiny_model_dir: str, tiny_dataset: Any,
                                             reward_fn: Any, cpu_args: dict[str, Any],
                                             tmp_path: Any) -> None:
    """TRL re-enables activation checkpointing after every generation and no-grad pass, and
    transformers 5 adds an input-gradient hook on the embeddings each time: without
    compile_generation too, GBMPOTrainer keeps one (otherwise two more per step)."""
    args = GBMPOConfig(output_dir=str(tmp_path), max_steps=3, max_completion_length=8,
                       **{**cpu_args, "gradient_checkpointing": True})  # fmt: skip
    trainer = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                           train_dataset=tiny_dataset)  # fmt: skip
    trainer.train()
    assert len(trainer.model.get_input_embeddings()._forward_hooks) == 1


@pytest.mark.parametrize("lora", [False, True])
def test_static_cache_greedy_tokens_are_the_dynamic_caches(lora: bool) -> None:
    """transformers' static KV cache (decode_step static on TRL) gives the same greedy tokens as
    the dynamic one in float32 on the embedded tiny model (varied completions, unlike the
    random fixture's), with a LoRA adapter (peft) too: the logits agree up to float
    rounding (the static cache's unused slots are masked, weight exactly 0, and change only
    the summation order), and greedy picks differ only if two top logits lie within that
    rounding, which fixed weights and prompts make a deterministic outcome, not a flicker."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from gbmpo.models import resolve_model_path

    path = resolve_model_path("tiny")
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: an adapter that changes the logits
                torch.nn.init.normal_(p, std=0.2)
    enc = tok([f"What is {a} + {a * 7}?" + " 1" * a for a in range(4)], return_tensors="pt",
              padding=True)  # left-padded, rows of different lengths

    def greedy(cache: str | None) -> Any:
        config = GenerationConfig(max_new_tokens=24, do_sample=False, disable_compile=True,
                                  pad_token_id=tok.pad_token_id, cache_implementation=cache)
        with torch.no_grad():
            return model.eval().generate(**enc, generation_config=config)

    assert torch.equal(greedy("static"), greedy(None))


def test_hf_argument_parser_round_trip() -> None:
    from transformers import HfArgumentParser

    (c,) = HfArgumentParser(GBMPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "x", "--use_cpu", "--bf16", "False", "--report_to", "none",
         "--regularizer", "prob_l2", "--regularizer_coef", "0.1", "--clip_mode", "atr",
         "--atr_delta", "0.03"]
    )
    assert (c.regularizer, c.regularizer_coef, c.beta, c.clip_mode, c.atr_delta) == (
        "prob_l2", 0.1, 0.1, "atr", 0.03)


# --- lazy import -----------------------------------------------------------------------------


def test_import_gbmpo_does_not_import_trl() -> None:
    code = (
        "import sys, gbmpo, gbmpo.integrations\n"
        "bad = [m for m in ('trl', 'accelerate', 'peft') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- TRL internals we hook -------------------------------------------------------------------


def test_trl_internals_present() -> None:
    check_trl_internals(strict=True)


def _fake_trainer(**override: Any) -> type:
    """A class with GRPOTrainer's hooked methods, some replaced (None: removed)."""
    attrs = {name: inspect.getattr_static(GRPOTrainer, name) for name in _HOOKED_METHODS}
    attrs.update(override)
    return type("MovedGRPOTrainer", (), {k: v for k, v in attrs.items() if v is not None})


def test_internals_check_names_a_removed_method() -> None:
    match = r"MovedGRPOTrainer\._compute_loss no longer exists"
    with pytest.raises(TRLInternalsError, match=match):
        check_trl_internals(_fake_trainer(_compute_loss=None))


def test_internals_check_names_a_renamed_parameter() -> None:
    def moved(self: Any, model: Any, input_ids: Any, attention_mask: Any, n_keep: int) -> None:
        """A signature without logits_to_keep / compute_entropy."""

    with pytest.raises(TRLInternalsError,
                       match=r"_get_per_token_logps_and_entropies no longer takes logits_to_keep"):
        check_trl_internals(_fake_trainer(_get_per_token_logps_and_entropies=moved))


def test_internals_check_names_a_changed_source_fact() -> None:
    def compute_loss(self: Any, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        return self.fused_loss(model, inputs)

    fake = _fake_trainer(compute_loss=compute_loss)
    check_trl_internals(fake)  # signatures still fine
    with pytest.raises(TRLInternalsError, match=r"compute_loss no longer contains"):
        check_trl_internals(fake, strict=True)


def test_internals_check_names_a_removed_config_field() -> None:
    fields = [(f.name, f.type, f) for f in dataclasses.fields(GRPOConfig) if f.name != "beta"]
    fake_cfg = dataclasses.make_dataclass("MovedConfig", [(n, t) for n, t, _ in fields])
    with pytest.raises(TRLInternalsError, match=r"MovedConfig has no field 'beta'"):
        check_trl_internals(GRPOTrainer, fake_cfg)


def test_missing_trl_gives_a_clear_import_error() -> None:
    code = (
        "import sys\n"
        "sys.modules['trl'] = None  # simulate the extra not being installed\n"
        "try:\n"
        "    import gbmpo.integrations.trl\n"
        "except ImportError as e:\n"
        "    assert \"pip install 'gbmpo[trl]'\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
