"""Scale rehearsal: a randomly initialised model of Qwen3-1.7B's shape, RL steps on the own
engine and on ``--engine trl`` in one run, at two settings, with the time of each phase against
what the device allows. No download: the architecture is written below, the tokenizer is the
embedded model's (its ids index the first rows of the 151,936-row embedding; generated ids past
its vocabulary decode to nothing, which only lowers the reward of a random model).

    python benchmarks/scale_rehearsal.py                       # both settings, on cuda
    python benchmarks/scale_rehearsal.py --new-tokens 512      # 512 new tokens instead of 256
    python benchmarks/scale_rehearsal.py --size tiny           # a tiny shape on CPU (the tests)

The settings (``--settings``):

* ``rehearsal``: 8 prompts x 8 completions, 256 new tokens, full fine-tuning, bf16 weights with
  fp32 master weights (own engine; TRL: fp32 weights under bf16 autocast), the frozen reference
  on the device (KL k3 anchored to it); the own engine twice, with micro-batches of 8 sequences
  (``micro 8``) and with ``optim.micro_batch_size: null`` (``micro planned``: the memory plan
  chooses, :func:`gbmpo.train.memory.planned_micro_batch`);
* ``paper``: the GBMPO paper config ``configs/paper/gbmpo-qwen3-1.7b-gsm8k-probl2.yaml`` as it
  is (2 prompts x 4 completions x 256 tokens, LoRA r 64 on every linear layer, top_p 0.95,
  ProbL2 to the adapters-off reference), with the random model and ``task.name: arithmetic``.

TRL generates with ``rollout.decode_step`` ``auto`` (transformers' static KV cache and compiled
decode step on CUDA, its dynamic cache on the CPU); ``--trl-decoders auto,lean`` adds a TRL run
with the dynamic cache, uncompiled (``trl (lean)``; ``--trl-extra-steps``: its steps), for the
before/after ratio in one process.

Per engine: seconds per step (steps after the first, which pays for warm-up, averaged; the own
engine's without the phases' extra one-token generate and an old-policy pass the step does not
need) and peak memory against the plan. The own engine's step is split into its phases, each
timed between two device synchronizes (which the plain step does not have: a few ms per phase
on a GPU):
``prefill`` (a generate call of one new token on the same prompts: the prompt's forward and one
sampled token), ``decode`` (the generate call's time minus that), ``reward``, ``old policy``
and ``reference`` (the no-grad log-prob passes; the old policy's runs even where the step does
not need it, ``used`` says), ``policy fwd+bwd`` (every micro-batch's forward and backward) and
``optimizer`` (clipping and AdamW). TRL reports no phases: its seconds per step only.

What the phases are compared with, on the device of the run:

* **decode against the weights-only bound**: a decode step reads every weight once (``N_lin``
  linear-layer parameters at their dtype's bytes, LoRA adapters at 4 bytes), so at the measured
  copy bandwidth ``BW`` (a 1 GiB device-to-device copy: bytes read + written over its time) it
  takes at least ``weights / BW`` and ``rows`` tokens come out of it: bound tokens/s
  ``= rows * BW / weights``;
* **MFU**: FLOPs counted as follows, over the measured bf16 matmul peak (an 8192^3 bf16 product)
  and over the data sheet's dense bf16 peak (:data:`PEAK_FLOPS`). A forward over ``t`` tokens
  costs ``2 N_lin t`` (every linear layer and the LM head; the embedding lookup is no product)
  plus ``4 L q a`` for attention (``L`` layers, ``q`` query width, ``a`` the (query, key) pairs
  attended: causal, each distinct prompt's once when prompts are shared) plus ``2 N_lora t``
  for LoRA adapters. The training pass: the forward, the input gradients (the same again) and
  the weight gradients (the linear layers' ``2 N_lin t`` with full fine-tuning, the adapters'
  ``2 N_lora t`` with LoRA), attention's backward twice its forward. Decode and prefill: one
  forward of their tokens. The tokens are the ones computed: padded rows, each distinct prompt
  once.

Writes ``benchmarks/results/scale_rehearsal.json`` (``--out``), prints the per-phase table and
one summary line last.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish_result, measure, start_result  # noqa: E402

#: Qwen3-1.7B's architecture (its config.json on the Hugging Face hub)
QWEN3_1_7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                  vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                  max_position_embeddings=40960, rms_norm_eps=1e-6)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, intermediate_size=128, tie_word_embeddings=True,
            max_position_embeddings=512)  # fmt: skip

#: dense bf16 peak FLOP/s by device name (vendor data sheets; no sparsity)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}

PAPER_CONFIG = ROOT / "configs" / "paper" / "gbmpo-qwen3-1.7b-gsm8k-probl2.yaml"

#: per size: the rehearsal's batch and the new tokens of both settings
SIZES = {
    "full": {"prompts": 8, "generations": 8, "new_tokens": 256, "micro": 8, "dtype": "bfloat16",
             "steps": 3},
    "tiny": {"prompts": 2, "generations": 4, "new_tokens": 8, "micro": 4, "dtype": "bfloat16",
             "steps": 2},
}
SETTINGS = ("rehearsal", "paper")


def build_model(directory: Path, size: str, device: str = "cpu") -> Any:
    """Save a randomly initialised Qwen3 of the size's shape and the embedded tokenizer (the
    initialisation runs on ``device``: seconds on a GPU for 1.7B parameters, not a minute);
    an existing ``directory`` holding one is reused. Returns ``(config, parameters)``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from gbmpo.models import resolve_model_path

    if (directory / "config.json").exists():
        config = AutoConfig.from_pretrained(directory)
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
        shape = dict(QWEN3_1_7B if size == "full" else {**TINY, "vocab_size": len(tokenizer)})
        config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        del model
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    return config, n


#: ``--decoder``: the own engine's sampler (config overrides); ``auto``: the config's default
DECODERS = {"auto": [], "static": [("rollout.decode_step", "static")],
            "lean": [("rollout.decode_step", "lean")], "hf": [("rollout.generator", "hf")]}


def engine_config(model_dir: Path, out: Path, engine: str, size: str, device: str,
                  setting: str, new_tokens: int, micro: str | None,
                  decoder: str = "auto", trl_decoder: str = "auto",
                  steps: int | None = None) -> Any:  # fmt: skip
    """The config of one run: the rehearsal's (``micro``: a number or ``planned``) or the paper
    config with the random model, the arithmetic task and no evaluation; ``decoder`` is the own
    engine's, ``trl_decoder`` TRL's ``rollout.decode_step``; ``steps`` (default the size's)."""
    from gbmpo.config import load_config

    s = SIZES[size]
    common = [
        ("engine", engine), ("model.path", str(model_dir)), ("model.device", device),
        ("task.name", "arithmetic"), ("rollout.max_new_tokens", str(new_tokens)),
        ("eval.before", "false"), ("eval.after", "false"), ("eval.every", "0"),
        ("eval.drift", "false"), ("run.steps", str(steps or s["steps"])),
        ("run.time_budget_seconds", "null"), ("run.checkpoint_every", "0"),
        ("run.progress", "false"), ("run.output_dir", str(out)),
        *(DECODERS[decoder] if engine == "gbmpo" else [("rollout.decode_step", trl_decoder)]),
    ]  # fmt: skip
    if setting == "paper":
        return load_config(PAPER_CONFIG, overrides=common)
    return load_config(overrides=[
        *common, ("model.dtype", s["dtype"]),
        ("rollout.prompts_per_step", str(s["prompts"])),
        ("rollout.num_generations", str(s["generations"])),
        ("optim.mini_batch_size", "null"),
        ("optim.micro_batch_size", "null" if micro == "planned" else str(micro or s["micro"])),
        ("objective.regularizer.name", "kl_k3"), ("objective.regularizer.anchor", "ref"),
    ])  # fmt: skip


# ----------------------------------------------------------------------- the device's limits


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + written), best of 5 (1 GiB on a GPU,
    64 MiB elsewhere)."""
    import torch

    n = (2**30 if device.startswith("cuda") else 2**26) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2 * n / best


def matmul_peak(device: str) -> float:
    """FLOP/s of a square bf16 matrix product, best of 5 (8192 on a GPU, 512 elsewhere)."""
    import torch

    n = 8192 if device.startswith("cuda") else 512
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    best = math.inf
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def datasheet_peak(device: str) -> float | None:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


# --------------------------------------------------------------------------------- FLOPs


def linear_parameters(config: Any) -> int:
    """N_lin: the parameters of every linear layer and of the LM head (no embedding, norms)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    k = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * k + q * h + 3 * h * config.intermediate_size
    return layers * per_layer + config.vocab_size * h


def forward_flops(config: Any, tokens: int, pairs: float, lora: int) -> float:
    """``2 N_lin t + 4 L q a + 2 N_lora t`` (see the module docstring)."""
    q = config.num_attention_heads * config.head_dim
    return (2 * linear_parameters(config) * tokens + 4 * config.num_hidden_layers * q * pairs
            + 2 * lora * tokens)  # fmt: skip


def training_flops(config: Any, tokens: int, pairs: float, lora: int) -> float:
    """Forward, input gradients and weight gradients (see the module docstring)."""
    q = config.num_attention_heads * config.head_dim
    linear = 2 * linear_parameters(config) * tokens
    attention = 4 * config.num_hidden_layers * q * pairs
    adapters = 2 * lora * tokens
    if lora:  # frozen base weights: no weight gradients but the adapters'
        return 2 * linear + 3 * attention + 3 * adapters
    return 3 * linear + 3 * attention


def _shape_of(batch: Any, shared: bool) -> dict[str, float]:
    """Tokens and attended pairs of a log-prob pass over ``batch`` (padded), and of its parts."""
    rows, p = batch.prompt_ids.shape
    c = batch.completion_ids.shape[1]
    distinct = len({tuple(r) for r in batch.prompt_ids.tolist()}) if shared else rows
    return {
        "rows": rows, "prompt": p, "completion": c, "distinct_prompts": distinct,
        "prompt_tokens": distinct * p, "prompt_pairs": distinct * p * (p + 1) / 2,
        "completion_tokens": rows * c, "completion_pairs": rows * (c * p + c * (c + 1) / 2),
    }  # fmt: skip


# ---------------------------------------------------------------------- the own engine's phases


@contextlib.contextmanager
def _timed(times: dict[str, float], name: str, device: str) -> Any:
    _sync(device)
    t0 = time.perf_counter()
    yield
    _sync(device)
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def phased_step(tr: Any) -> tuple[dict[str, float], Any]:
    """One RL step of the Trainer ``tr`` (as :meth:`gbmpo.train.Trainer.train_step`), each phase
    timed (see the module docstring); returns the seconds by phase and the rollout."""
    import torch

    from gbmpo.train import step as S
    from gbmpo.train.correction import sampler_weights
    from gbmpo.train.precision import MasterWeightOptimizer

    device, cfg = str(tr.device), tr.config
    times: dict[str, float] = {}
    examples = [tr.train_data[i] for i in tr.sampler.take(cfg.rollout.prompts_per_step)]
    prompts = [ex["prompt"] for ex in examples]
    new_tokens = cfg.rollout.max_new_tokens
    with _timed(times, "prefill", device):
        cfg.rollout.max_new_tokens = 1
        try:
            S.sample_completions(tr.model, tr.tokenizer, prompts, cfg, tr.step, tr.device)
        finally:
            cfg.rollout.max_new_tokens = new_tokens
    with _timed(times, "generate", device):
        batch = S.sample_completions(tr.model, tr.tokenizer, prompts, cfg, tr.step, tr.device)
    times["decode"] = max(0.0, times.pop("generate") - times["prefill"])
    tr.micro_batch, tr.inference_batch = S.plan_batches(
        cfg, tr.model, batch, tr.device, tr.batch_sizes, tr.batch_plans,
        needs_ref=tr.ref_model is not None,
    )
    with _timed(times, "reward", device):
        rewards, _ = S.score(tr.reward_fn, tr.task, examples, batch,
                             cfg.rollout.num_generations, tr.device)
    with _timed(times, "old policy", device):
        old_logp = S.no_grad_logprobs(tr.models, batch, tr.inference_batch, reference=False)
    ref_logp = None
    if tr.needs_ref:
        with _timed(times, "reference", device):
            ref_logp = S.no_grad_logprobs(tr.models, batch, tr.inference_batch, reference=True)
    old = old_logp if tr.needs_old else None
    mask = batch.completion_mask.float()
    correction = sampler_weights(cfg.objective.rollout_correction, batch, old, mask)
    advantages, _, _ = S.shaped_advantages(tr.objective, tr.models, tr.batch_sizes, rewards,
                                           batch, old, ref_logp, cfg.rollout.num_generations)
    tr.model.train()
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else math.inf
    for epoch in range(cfg.optim.mu):
        order = S.row_order(len(batch), tr.mini_batch, cfg.run.seed, tr.step, epoch, tr.device)
        for rows in order.split(tr.mini_batch):
            tr.optimizer.zero_grad(set_to_none=True)
            with _timed(times, "policy fwd+bwd", device):
                S.accumulate_gradients(tr.models, tr.objective, cfg, tr.micro_batch, batch,
                                       rows, advantages, old, ref_logp,
                                       with_entropy=epoch == 0, correction=correction)
            with _timed(times, "optimizer", device):
                if isinstance(tr.optimizer, MasterWeightOptimizer):
                    tr.optimizer.grads_to_masters()
                torch.nn.utils.clip_grad_norm_(tr.clip_params, max_norm)
                tr.optimizer.step()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.step += 1
    return times, batch


def phase_table(tr: Any, times: dict[str, float], batch: Any, limits: dict[str, Any]
                ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Seconds, tokens, tokens/s, FLOPs and MFU by phase; decode against its bound."""
    cfg = tr.config
    config = tr.model.config
    lora = sum(p.numel() for n, p in tr.model.named_parameters() if "lora_" in n)
    shape = _shape_of(batch, cfg.rollout.share_prompts)
    rows, c = shape["rows"], shape["completion"]
    pass_tokens = shape["prompt_tokens"] + shape["completion_tokens"]
    pass_pairs = shape["prompt_pairs"] + shape["completion_pairs"]
    counted = {
        "prefill": (shape["prompt_tokens"],
                    forward_flops(config, shape["prompt_tokens"], shape["prompt_pairs"], lora)),
        "decode": (shape["completion_tokens"],
                   forward_flops(config, shape["completion_tokens"], shape["completion_pairs"],
                                 lora)),
        "reward": (rows, None),
        "old policy": (pass_tokens, forward_flops(config, pass_tokens, pass_pairs, lora)),
        "reference": (pass_tokens, forward_flops(config, pass_tokens, pass_pairs, 0)),
        "policy fwd+bwd": (pass_tokens * cfg.optim.mu,
                           cfg.optim.mu * training_flops(config, pass_tokens, pass_pairs, lora)),
        "optimizer": (None, None),
    }  # fmt: skip
    table: dict[str, dict[str, Any]] = {}
    for name, (tokens, flops) in counted.items():
        if name not in times:
            continue
        s = times[name]
        row: dict[str, Any] = {"seconds": s, "tokens": tokens,
                               "tokens_per_second": tokens / s if tokens and s else None,
                               "flops": flops}  # fmt: skip
        for key, peak in (("mfu_measured", limits["matmul_flops"]),
                          ("mfu_datasheet", limits["datasheet_flops"])):
            row[key] = flops / s / peak if flops and s and peak else None
        table[name] = row
    table["old policy"]["used"] = bool(tr.needs_old)
    weights = linear_parameters(config) * _bytes(cfg.model.dtype) + 4 * lora
    bound = rows * limits["copy_bytes_per_second"] / weights
    dec = table["decode"]
    dec["ms_per_token_step"] = 1e3 * dec["seconds"] / max(c, 1)
    dec["bound_tokens_per_second"] = bound
    dec["of_bound"] = dec["tokens_per_second"] / bound if dec["tokens_per_second"] else None
    return table


def _bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def run_own(cfg: Any, limits: dict[str, Any]) -> dict[str, Any]:
    """The own engine's Trainer, ``run.steps`` phased steps; the first is not timed."""
    import torch

    from gbmpo.train import Trainer

    device = cfg.model.device
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with measure() as m:
        tr = Trainer(cfg)
        steps = []
        for _ in range(cfg.run.steps):
            t0 = time.perf_counter()
            times, batch = phased_step(tr)
            # the step's own time: without the extra one-token generate (the prefill's
            # measure) and the old policy's pass where the step does not need it
            extra = times["prefill"] + (0.0 if tr.needs_old else times["old policy"])
            steps.append((time.perf_counter() - t0 - extra, times, batch))
    timed = steps[1:] or steps
    mean = {k: sum(t[1][k] for t in timed) / len(timed) for k in timed[-1][1]}
    phases = phase_table(tr, mean, timed[-1][2], limits)
    peak = (torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None)
    plan = _plan(cfg, tr.model.config, int(timed[-1][2].prompt_ids.shape[1]))
    update = sum(phases[k]["seconds"] for k in ("policy fwd+bwd", "optimizer"))
    result = {
        "steps_timed": len(timed),
        "step_seconds_mean": sum(t[0] for t in timed) / len(timed),
        "phases": phases,
        "update_seconds": update,
        "micro_batch": tr.micro_batch,
        "inference_batch": tr.inference_batch,
        "generation_tokens_per_second": phases["decode"]["tokens"] / (
            phases["decode"]["seconds"] + phases["prefill"]["seconds"]),
        "peak_memory_gib": peak,
        "process_peak_rss_extra_gb": m.record()["extra_peak_gb"],
        "plan_peak_gib": plan["peak"] / 2**30,
        "plan": plan,
        "wall_seconds": m.seconds,
    }
    del tr
    return result


def _plan(cfg: Any, model_config: Any, prompt_tokens: int) -> dict[str, Any]:
    from gbmpo.train.device import device_memory_bytes
    from gbmpo.train.memory import memory_plan
    from gbmpo.train.setup import build_objectives

    device = cfg.model.device
    needs_ref = build_objectives(cfg).needs_ref
    plan = memory_plan(cfg, model_config, prompt_tokens, needs_ref=needs_ref,
                       device_bytes=device_memory_bytes(device) if device != "cpu" else None)
    return {k: v for k, v in plan.items() if k != "notes"}


def _longest_prompt(cfg: Any) -> int:
    """Tokens of the longest of the task's first 1,000 training prompts (the plan's width)."""
    from gbmpo.train.setup import build_task, load_splits, load_tokenizer

    tok = load_tokenizer(cfg)
    train, _, _ = load_splits(cfg, build_task(cfg, tok))
    return max(len(tok(ex["prompt"])["input_ids"]) for ex in train[:1000])


def run_trl(cfg: Any, model_config: Any) -> dict[str, Any]:
    """``--engine trl`` (TRL's GRPOTrainer, transformers' generate, no vLLM): seconds per step
    from its metrics (no phases)."""
    import torch

    from gbmpo import engines
    from gbmpo.lifecycle.logging import read_metrics

    device = cfg.model.device
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with measure() as m:
        summary = engines.run(cfg)
    rows = [r for r in read_metrics(cfg.run.output_dir) if "loss" in r]
    timed = rows[1:] or rows
    step_s = sum(r["step_seconds"] for r in timed) / len(timed)
    completions = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    generated = sum(r["response_length_mean"] * completions for r in timed) / len(timed)
    plan = _plan(cfg, model_config, _longest_prompt(cfg))
    return {
        "steps_timed": len(timed),
        "step_seconds_mean": step_s,
        "phases": None,
        "generated_tokens_per_step": generated,
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "process_peak_rss_extra_gb": m.record()["extra_peak_gb"],
        "plan_peak_gib": plan["peak"] / 2**30,
        "plan": plan,
        "wall_seconds": m.seconds,
    }


# ------------------------------------------------------------------------------- output


def _fmt(x: Any, scale: float = 1.0, digits: str = ".3g", pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x * scale:{digits}}"


def print_tables(result: dict[str, Any]) -> None:
    """The per-phase table of each own-engine run and every run's seconds per step."""
    for setting, runs in result["settings"].items():
        for run, r in runs.items():
            plan = r.get("plan") or {}
            kept = sum(plan.get(k) or 0 for k in ("decode_buffers", "decode_pool",
                                                  "merged_weights")) / 2**30  # fmt: skip
            of_which = f", of which static decoder {kept:.3g}" if kept else ""
            print(f"\n{setting}, {run}: {r['step_seconds_mean']:.3f} s/step, peak "
                  f"{_fmt(r['peak_memory_gib'])} GiB (plan {r['plan_peak_gib']:.3g}{of_which})")
            if not r.get("phases"):
                continue
            print("| phase | s | tokens | tokens/s | MFU (measured peak) | MFU (data sheet) |")
            print("|---|---|---|---|---|---|")
            for name, p in r["phases"].items():
                print(f"| {name} | {p['seconds']:.4f} | {_fmt(p['tokens'])} | "
                      f"{_fmt(p['tokens_per_second'])} | {_fmt(p['mfu_measured'], pct=True)} | "
                      f"{_fmt(p['mfu_datasheet'], pct=True)} |")
            d = r["phases"]["decode"]
            print(f"decode: {d['ms_per_token_step']:.2f} ms per token step; "
                  f"{_fmt(d['tokens_per_second'])} tokens/s of a weights-only bound of "
                  f"{_fmt(d['bound_tokens_per_second'])} ({_fmt(d['of_bound'], pct=True)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default=None, help="default: cuda for full, cpu for tiny")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--engines", default="gbmpo,trl")
    ap.add_argument("--micro", default=None,
                    help="the rehearsal's own-engine micro-batches, comma-separated numbers or "
                         "'planned' (default: the size's, and planned)")
    ap.add_argument("--decoder", choices=sorted(DECODERS), default="auto",
                    help="the own engine's decode step (auto: static on CUDA, lean on CPU)")
    ap.add_argument("--trl-decoders", default="auto",
                    help="TRL's rollout.decode_step per TRL run, comma-separated (auto: static "
                         "and compiled on CUDA; lean: the dynamic cache); the first is 'trl', "
                         "the others 'trl (<step>)'")
    ap.add_argument("--trl-extra-steps", type=int, default=None,
                    help="RL steps of each TRL run after the first (default: the size's)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="new tokens per completion in both settings (default: 256; tiny: 8)")
    ap.add_argument("--model-dir", default=None,
                    help="where the random model is saved, and reused when there already")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if args.size == "full" else "cpu")
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        ap.error(f"unknown settings {unknown}; valid: {', '.join(SETTINGS)}")
    trl_decoders = [d for d in args.trl_decoders.split(",") if d]
    unknown = sorted(set(trl_decoders) - {"auto", "static", "lean"})
    if unknown or not trl_decoders:
        ap.error(f"unknown --trl-decoders {unknown}; valid: auto, static, lean")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("scale_rehearsal: no CUDA device here; --size tiny runs on CPU",
                  file=sys.stderr)  # fmt: skip
            return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = SIZES[args.size]
    new_tokens = args.new_tokens or size["new_tokens"]
    micros = (args.micro or f"{size['micro']},planned").split(",")
    result = start_result("scale_rehearsal")
    limits = {"copy_bytes_per_second": copy_bandwidth(device),
              "matmul_flops": matmul_peak(device), "datasheet_flops": datasheet_peak(device)}
    result.update(size=args.size, device=device, new_tokens=new_tokens, size_setting=size,
                  limits=limits, settings={}, decoder=args.decoder,
                  trl_decoders=trl_decoders)  # fmt: skip
    if device.startswith("cuda"):
        import torch

        result["device_name"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "model"
        model_config, n = build_model(model_dir, args.size, device)
        result["parameters"] = n
        result["linear_parameters"] = linear_parameters(model_config)
        for setting in settings:
            runs: dict[str, Any] = {}
            for engine in args.engines.split(","):
                own = engine == "gbmpo"
                variants = ([(m, "auto") for m in micros] if own and setting == "rehearsal"
                            else [(None, "auto")] if own else [(None, d) for d in trl_decoders])
                for micro, trl_decoder in variants:
                    extra = not own and trl_decoder != trl_decoders[0]
                    name = (f"{engine} (micro {micro})" if micro is not None
                            else f"{engine} ({trl_decoder})" if extra else engine)
                    out = Path(tmp) / f"{setting}-{engine}-{micro}-{trl_decoder}"
                    cfg = engine_config(model_dir, out, engine, args.size, device, setting,
                                        new_tokens, micro, args.decoder, trl_decoder,
                                        args.trl_extra_steps if extra else None)  # fmt: skip
                    runs[name] = (run_own(cfg, limits) if engine == "gbmpo"
                                  else run_trl(cfg, model_config))  # fmt: skip
                    result["settings"][setting] = runs
                    finish_result(result, args.out)  # each run's figures kept at once
                    print(f"{setting}, {name}: {runs[name]['step_seconds_mean']:.3f} s/step",
                          flush=True)  # fmt: skip
    path = finish_result(result, args.out)
    print_tables(result)
    parts = []
    for setting, runs in result["settings"].items():
        own = {k: v for k, v in runs.items() if k.startswith("gbmpo")}
        trl = runs.get("trl")
        for name, r in own.items():
            ratio = (f", TRL/own {trl['step_seconds_mean'] / r['step_seconds_mean']:.2f}x"
                     if trl else "")
            parts.append(f"{setting} {name}: {r['step_seconds_mean']:.2f} s/step{ratio}")
        if trl and not own:
            parts.append(f"{setting} trl: {trl['step_seconds_mean']:.2f} s/step")
        for name, r in runs.items():
            if name.startswith("trl (") and trl:
                parts.append(f"{setting} {name}: {r['step_seconds_mean']:.2f} s/step, "
                             f"{name}/trl {r['step_seconds_mean'] / trl['step_seconds_mean']:.2f}x")
    print(f"scale_rehearsal ({args.size}, {device}, {n / 1e6:.1f}M parameters, {new_tokens} new "
          f"tokens): " + "; ".join(parts) + f" -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
