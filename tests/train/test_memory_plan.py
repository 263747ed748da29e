"""The memory plan (``gbmpo train --dry-run`` on every engine): the activation estimate against
the memory a training forward really keeps, measured on CPU; every paper config gets a plan;
how the engines divide and reserve memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gbmpo.config import load_config
from gbmpo.engines.checks import DryRunReport, memory_check
from gbmpo.train.memory import activation_bytes, memory_plan, model_shape, plan_line

ROOT = Path(__file__).resolve().parents[2]

#: measured / estimated activation memory must lie within this factor of 1 (measured: 0.89 to
#: 1.03 on the unfused shapes below, 0.98 on the fused one, 2 CPU cores, torch 2.13)
TOLERANCE = 0.25

_MEASURE = r"""
import gc, json, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from gbmpo.rollout.logprobs import completion_logprobs
from gbmpo.train.memory import activation_bytes
torch.set_num_threads(1)
rows, P, C, lean, fused = (int(a) for a in sys.argv[1:6])
if fused:  # the LM head dominates: a large vocabulary over a small body
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=128,
                      vocab_size=65536, tie_word_embeddings=True)
else:
    cfg = Qwen3Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=768,
                      vocab_size=8192, tie_word_embeddings=True)
torch.manual_seed(0)
model = Qwen3ForCausalLM(cfg).train()
ids = lambda n: torch.randint(0, cfg.vocab_size, (rows, n))
pid, cid = ids(P), ids(C)
pm, cm = torch.ones_like(pid), torch.ones_like(cid)
lp, _ = completion_logprobs(model, pid[:1, :8], pm[:1, :8], cid[:1, :8], cm[:1, :8],
                            lean=bool(lean), fused_head=bool(fused))
lp.sum().backward()  # warm-up: the gradients exist before the measurement
gc.collect()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
def hwm():  # the resident peak since the last reset (VmHWM, kB)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = rss()
# reset the resident peak to the current size, so that the peak is this forward and backward's
# and not the imports' (ru_maxrss cannot be reset; importing transformers can peak higher)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
lp, _ = completion_logprobs(model, pid, pm, cid, cm, lean=bool(lean), fused_head=bool(fused))
kept = rss() - base
lp.sum().backward()
peak = hwm() - base
estimate = activation_bytes(cfg, rows, P + C, C, 4, fused_head=bool(fused))
unfused = activation_bytes(cfg, rows, P + C, C, 4)
print(json.dumps({"kept": kept, "peak": peak, "estimate": estimate, "unfused": unfused}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.parametrize(("rows", "prompt", "completion", "lean", "fused"),
                         [(8, 128, 128, 1, 0), (8, 128, 128, 0, 0), (16, 256, 128, 1, 0),
                          (4, 16, 512, 1, 1)])
def test_activation_estimate_matches_the_measured_memory_on_cpu(
    rows: int, prompt: int, completion: int, lean: int, fused: int
) -> None:
    """A fresh process: the resident memory a training forward adds (what autograd keeps) and
    the peak through its backward, against :func:`activation_bytes` (float32 on CPU, the own
    engine's log-prob forward, lean and transformers'; the full logits, and the LM head fused
    into chunks on a shape whose vocabulary dominates: its peak is the chunk's, a quarter of
    what the whole logits would take)."""
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(rows), str(prompt),
                          str(completion), str(lean), str(fused)], env=env,
                         capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
    m = json.loads(out.stdout.strip().splitlines()[-1])
    if fused:  # what autograd keeps is small here: only the peak is compared
        assert abs(m["peak"] / m["estimate"] - 1) <= TOLERANCE, m
        assert m["peak"] < 0.5 * m["unfused"], m  # the whole logits: 2048 x 65536 floats
        return
    for what in ("kept", "peak"):
        ratio = m[what] / m["estimate"]
        assert abs(ratio - 1) <= TOLERANCE, (what, ratio, m)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "paper").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_paper_config_gets_a_memory_plan(path: Path) -> None:
    cfg = load_config(path)
    report = DryRunReport(cfg.engine)
    memory_check(cfg, report)
    check = {c.name: c for c in report.checks}["memory"]
    assert check.status == "ok" and check.detail.startswith(f"memory plan ({cfg.engine}, per GPU")
    plan = report.info["memory_plan"]
    parts = ("weights", "gradients", "optimizer", "reference", "activations")
    static = sum(plan[k] or 0 for k in parts)
    assert plan["peak"] >= static > 0
    verdict = "fits:" if plan["peak"] <= 80 * 2**30 else "does NOT fit:"
    assert plan["fits"] == (verdict == "fits:") and verdict in check.detail


def test_engines_divide_and_reserve_memory_as_they_do() -> None:
    shape = model_shape("Qwen/Qwen3-1.7B")
    assert shape is not None and model_shape("Qwen3-1.7B") is not None
    base = [("model.dtype", "bfloat16"), ("rollout.max_new_tokens", "256"),
            ("rollout.prompts_per_step", "8"), ("rollout.num_generations", "8")]

    def plan(*extra: tuple[str, str]) -> dict:
        cfg = load_config(overrides=[*base, *extra])
        return memory_plan(cfg, shape, 128, needs_ref=True, device_bytes=80 * 2**30)

    own, trl = plan(), plan(("engine", "trl"))
    verl1 = plan(("engine", "verl"), ("run.num_processes", "1"))
    verl8 = plan(("engine", "verl"), ("run.num_processes", "8"))
    n = own["weights"] // 2  # bf16 weights
    assert 1.6e9 < n < 1.8e9  # Qwen3-1.7B: 1.72 B parameters with its tied embeddings
    assert own["optimizer"] == 12 * n  # bf16 + fp32 master, moments
    assert trl["weights"] == 4 * n and trl["optimizer"] == 8 * n  # fp32 weights under autocast
    assert verl8["weights"] == verl1["weights"] // 8  # FSDP shards
    assert verl1["vllm_reserve"] == 40 * 2**30 and own["vllm_reserve"] is None  # 0.5 x 80 GiB
    assert own["peak"] == sum(own[k] for k in ("weights", "gradients", "optimizer", "reference")) \
        + max(own["activations"], own["kv_cache"])  # fmt: skip
    # gradient checkpointing (TRL's and verl's default) keeps far less than the own engine
    assert trl["activations"] < own["activations"]
    assert activation_bytes(shape, 1, 384, 256, 2, checkpointing=True) < activation_bytes(
        shape, 1, 384, 256, 2)


def _rehearsal_cfg(*extra: tuple[str, str]):
    return load_config(overrides=[("model.dtype", "bfloat16"), ("rollout.max_new_tokens", "256"),
                                  ("rollout.prompts_per_step", "8"),
                                  ("rollout.num_generations", "8"),
                                  ("optim.mini_batch_size", "null"), *extra])


def test_the_plan_chooses_the_largest_micro_batch_that_fits_with_its_margin() -> None:
    """``optim.micro_batch_size: null`` on the own engine with a device size: the largest
    divisor of the mini-batch (64) whose planned peak fits in (1 - PLAN_MARGIN) of the device;
    a set micro-batch is kept; the no-grad passes take at least as many rows."""
    from gbmpo.train.memory import PLAN_MARGIN

    shape = model_shape("Qwen/Qwen3-1.7B")
    peaks = {m: memory_plan(_rehearsal_cfg(("optim.micro_batch_size", str(m))), shape, 128,
                            needs_ref=True)["peak"] for m in (1, 2, 4, 8, 16, 32, 64)}
    assert all(peaks[a] < peaks[b] for a, b in ((1, 2), (8, 16), (16, 32), (32, 64)))
    # a device on which 16 rows fit with the margin and 32 do not
    device = int((peaks[16] + peaks[32]) / 2 / (1 - PLAN_MARGIN))
    plan = memory_plan(_rehearsal_cfg(), shape, 128, needs_ref=True, device_bytes=device)
    assert plan["micro_batch_rows"] == 16 and plan["micro_batch_planned"]
    assert plan["peak"] == peaks[16] and plan["fits"]
    assert plan["inference_rows"] >= 16
    assert "micro-batch 16 (planned, 10% margin)" in plan_line(plan, "cuda")
    huge = memory_plan(_rehearsal_cfg(), shape, 128, needs_ref=True, device_bytes=2**50)
    assert huge["micro_batch_rows"] == 64 and huge["inference_rows"] == 64
    tiny = memory_plan(_rehearsal_cfg(), shape, 128, needs_ref=True, device_bytes=2**30)
    assert tiny["micro_batch_rows"] == 1 and not tiny["fits"]
    kept = memory_plan(_rehearsal_cfg(("optim.micro_batch_size", "32")), shape, 128,
                       needs_ref=True, device_bytes=device)
    assert kept["micro_batch_rows"] == 32 and not kept["micro_batch_planned"]
    unsized = memory_plan(_rehearsal_cfg(), shape, 128, needs_ref=True)
    assert unsized["micro_batch_rows"] == 64 and not unsized["micro_batch_planned"]


def _planned_trainer(micro_model_dir: Path) -> tuple[Any, Any]:
    """A micro-model trainer with a null mini-batch (2 prompts x 4 completions), no evaluation."""
    from gbmpo.train import Trainer

    cfg = load_config(overrides=[("model.path", str(micro_model_dir)),
                                 ("rollout.prompts_per_step", "2"),
                                 ("rollout.num_generations", "4"),
                                 ("optim.mini_batch_size", "null"), ("eval.before", "false"),
                                 ("eval.after", "false"), ("run.progress", "false")])
    return cfg, Trainer(cfg, reward_fn=lambda prompts, completions, **_: [0.0] * len(prompts))


def test_the_trainer_takes_the_planned_batches(micro_model_dir: Path) -> None:
    """The trainer's per-width choice (used on CUDA) is the plan's, for its own model."""
    from gbmpo.train.step import planned_batches

    cfg, trainer = _planned_trainer(micro_model_dir)
    assert (trainer.micro_batch, trainer.inference_batch) == (8, 8)
    model_cfg, sizes = trainer.model.config, trainer.batch_sizes

    def planned(device: int | None) -> tuple[int, int]:
        return planned_batches(cfg, model_cfg, 20, device, sizes, needs_ref=False)

    assert planned(None) == (8, 8)  # no device size: as configured
    for device in (2**40, 3 * 2**20):
        plan = memory_plan(cfg, model_cfg, 20, needs_ref=False, device_bytes=device)
        micro, inference = planned(device)
        assert micro == plan["micro_batch_rows"] and inference >= micro
    assert planned(2**40) == (8, 8)


def test_plan_batches_plans_once_per_64_token_width(micro_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (here: a cuda device passed, of 3 MiB) the step's
    micro-batch and no-grad rows are the plan's at the prompt width rounded up to 64, planned
    once per such width; a set micro-batch is left alone."""
    import types

    import torch

    import gbmpo.train.step as step

    cfg, trainer = _planned_trainer(micro_model_dir)
    device = 3 * 2**20
    monkeypatch.setattr(step, "device_memory_bytes", lambda name: device)
    cuda = torch.device("cuda")  # only plan_batches reads it here
    for width in (20, 50):
        trainer.micro_batch, trainer.inference_batch = step.plan_batches(
            cfg, trainer.model, types.SimpleNamespace(prompt_ids=torch.zeros(8, width)), cuda,
            trainer.batch_sizes, trainer.batch_plans, needs_ref=False,
        )  # type: ignore[arg-type]
    assert list(trainer.batch_plans) == [64]
    plan = memory_plan(cfg, trainer.model.config, 64, needs_ref=False, device_bytes=device)
    assert trainer.micro_batch == plan["micro_batch_rows"] < 8  # 8 rows do not fit
    assert trainer.inference_batch >= trainer.micro_batch


def test_the_static_decoders_slots_pool_and_merged_weights_are_planned() -> None:
    """With the static decode step (on CUDA, or with LoRA) and ``decode_buffers: keep`` the
    plan counts, through the update, the ``MAX_SLOTS`` largest slots the rollouts and the
    evaluations can key (one decoder, an LRU of four: full and last chunks, every prompt bucket
    up to the prompt's; each sized to the byte against the decoder's allocation in
    tests/rollout/test_static_decoder.py), the graphs' pool (the largest slot's step, on CUDA)
    and the merged LoRA weights; its generation term is then the prefill's keys/values."""
    from gbmpo.rollout.static_decoder import MAX_SLOTS
    from gbmpo.train.memory import (
        decode_slots,
        decode_step_bytes,
        merged_lora_bytes,
        static_decode_bytes,
        uses_static_decoder,
    )

    shape = model_shape("Qwen/Qwen3-1.7B")
    path = ROOT / "configs" / "paper" / "gbmpo-qwen3-1.7b-gsm8k-probl2.yaml"
    own = [("engine", "gbmpo"), ("rollout.decode_buffers", "keep")]
    cfg = load_config(path, overrides=own)  # cuda, 2 prompts x 4 x 256 tokens, LoRA on all 7
    assert uses_static_decoder(cfg) and cfg.lora.enabled and cfg.eval.batch_size == 32
    assert cfg.eval.limit is None and cfg.eval.auto_limit == 500 and MAX_SLOTS == 4
    slots = decode_slots(cfg, 200)
    # rollouts: one chunk of 2 prompts (8 rows) per call, in any bucket up to 256
    sampling = (True, 0.6, 0, 0.95)
    assert slots["rollout"] == ({(8, w, 256, sampling) for w in (64, 128, 256)}, 1)
    # evaluations: 500 problems at most in chunks of 32, the last of up to 31: four at once
    greedy = (False, 1.0, 0, 1.0)
    assert slots["eval"] == ({(r, w, 256, greedy) for r in (32, 31) for w in (64, 128, 256)}, 4)
    plan = memory_plan(cfg, shape, 200, needs_ref=False)
    largest = sorted((static_decode_bytes(shape, r, w, 256, 2) for r, w in
                      [(8, 64), (8, 128), (8, 256), (32, 64), (32, 128), (32, 256),
                       (31, 64), (31, 128), (31, 256)]), reverse=True)  # fmt: skip
    assert plan["decode_buffers_mode"] == "keep"
    assert plan["decode_buffers"] == sum(largest[:4])
    pools = [decode_step_bytes(shape, 8, 256 + 256, 2, do_sample=True, temperature=0.6,
                               top_p=0.95),
             decode_step_bytes(shape, 32, 256 + 256, 2, do_sample=False)]  # fmt: skip
    assert plan["decode_pool"] == max(pools)
    assert plan["merged_weights"] == merged_lora_bytes(shape, cfg.lora.target_modules, 2)
    assert plan["kv_cache"] == 2 * 28 * 8 * 128 * 2 * 200 * 2  # the 2 prompts' prefill
    kept = sum(plan[k] or 0 for k in ("weights", "reference", "gradients", "optimizer",
                                      "decode_buffers", "decode_pool", "merged_weights"))
    eval_prefill = 2 * 28 * 8 * 128 * 32 * 200 * 2  # 32 prompts of the evaluation
    assert plan["peak"] == kept + max(plan["activations"], plan["kv_cache"], eval_prefill)
    line = plan_line(plan, "cuda")
    assert "decode buffers" in line and "graph pool" in line and "merged weights" in line
    assert "decoder state kept through the update" in line
    # no evaluation during training, the CPU (no graph, no pool): the rollouts' slots only
    quiet = load_config(path, overrides=[*own, ("eval.before", "false"), ("eval.every", "0"),
                                         ("model.device", "cpu")])  # fmt: skip
    quiet_plan = memory_plan(quiet, shape, 200, needs_ref=False)
    assert quiet_plan["decode_buffers"] == sum(static_decode_bytes(shape, 8, w, 256, 2)
                                               for w in (64, 128, 256))  # fmt: skip
    assert quiet_plan["decode_pool"] is None
    # the lean decoder (plain model on the CPU, or decode_step: lean): no decoder state
    for over in ([("model.device", "cpu"), ("lora.enabled", "false")],
                 [("rollout.decode_step", "lean"), ("eval.before", "false"),
                  ("eval.every", "0")]):  # fmt: skip
        lean = memory_plan(load_config(path, overrides=[*own, *over]), shape, 200, needs_ref=False)
        assert lean["decode_buffers"] is None and lean["merged_weights"] is None
        assert lean["decode_buffers_mode"] is None and lean["decode_pool"] is None


def _atr(*overrides: tuple[str, str]) -> Any:
    """The ATR-GRPO paper config on the own engine (one process)."""
    path = ROOT / "configs" / "paper" / "atr-grpo-qwen3-1.7b-gsm8k.yaml"
    return load_config(path, overrides=[("engine", "gbmpo"), ("run.num_processes", "1"),
                                        *overrides])  # fmt: skip


def test_decode_buffers_auto_keeps_when_it_fits_and_releases_otherwise() -> None:
    """ATR-GRPO's config on the own engine (256 rollouts of 1024 tokens, micro-batch 8): with
    prompts of 64 tokens (one bucket) keeping the decoder's state fits a 141 GiB card with the
    margin but not an 80 GiB one, where ``auto`` releases it after each rollout and evaluation;
    the released plan's peak is the static parts plus the larger of the update and a generation
    phase. ``keep`` on the small card is honoured and does not fit; ``release`` is honoured on
    the large one. With 256-token prompts (three buckets of rollout slots) keeping needs more
    than 141 GiB: ``auto`` releases there too."""
    from gbmpo.train.memory import PLAN_MARGIN

    shape, gib = model_shape("Qwen/Qwen3-1.7B"), 2**30

    def plan(mode: str, device: int, prompt: int = 64) -> dict[str, Any]:
        return memory_plan(_atr(("rollout.decode_buffers", mode)), shape, prompt,
                           needs_ref=False, device_bytes=device)  # fmt: skip

    keep, release = plan("keep", 80 * gib), plan("release", 80 * gib)
    assert (1 - PLAN_MARGIN) * 80 * gib < keep["peak"] <= (1 - PLAN_MARGIN) * 141 * gib
    assert release["peak"] < keep["peak"] and release["fits"] and not keep["fits"]
    static = sum(release[k] or 0 for k in ("weights", "gradients", "optimizer", "reference"))
    rollout = (release["decode_buffers"] + release["decode_pool"] + release["kv_cache"])
    assert release["peak"] == static + max(release["activations"], rollout)
    assert keep["decode_buffers_mode"] == "keep" and "does NOT fit" in plan_line(keep, "cuda")
    small, large = plan("auto", 80 * gib), plan("auto", 141 * gib)
    assert small["decode_buffers_mode"] == "release" and small["peak"] == release["peak"]
    assert "released after each rollout and evaluation" in plan_line(small, "cuda")
    assert large["decode_buffers_mode"] == "keep" and large["peak"] == keep["peak"]
    assert plan("release", 141 * gib)["decode_buffers_mode"] == "release"
    wide = plan("auto", 141 * gib, prompt=256)
    assert wide["decode_buffers_mode"] == "release" and wide["fits"]
    assert plan("keep", 141 * gib, prompt=256)["peak"] > 141 * gib
    # no device size: a CUDA config is compared with one 80 GiB GPU; on the CPU auto keeps
    assert memory_plan(_atr(), shape, 64, needs_ref=False)["decode_buffers_mode"] == "release"
    cpu = _atr(("model.device", "cpu"), ("rollout.decode_step", "static"))
    assert memory_plan(cpu, shape, 64, needs_ref=False)["decode_buffers_mode"] == "keep"
