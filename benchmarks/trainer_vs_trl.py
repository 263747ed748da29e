"""gbmpo's Trainer against TRL's GRPOTrainer: steps/s and generated tokens/s on the same work.

Both sides train the same random Qwen3 (built from a config, with the shipped 447-token
tokenizer, saved to a temporary directory) on the built-in ``arithmetic`` prompts with the same
settings: 8 prompts x 8 completions per step, at most 40 new tokens, temperature 1, top-p 1,
top-k off, importance-weighted k3 KL penalty (beta = coef = 0.04; TRL 1.16's default
``use_bias_correction_kl=True`` multiplies k3 by the ratio, which is gbmpo's ``kl_k3_is``)
toward a frozen reference, PPO clip 0.2, Dr. GRPO advantages (no std scaling) and aggregation,
one AdamW step on the whole batch (betas 0.9/0.999, lr 1e-6, grad-norm clip 1) per generation
batch, fp32 on CPU, no gradient checkpointing, no evaluation, no checkpoints. A random model
almost never emits EOS, so nearly every completion has 40 tokens on both sides (the generated
token counts are measured and reported).

Timing: each side runs in a fresh process; the time between consecutive step ends is recorded
(so everything each trainer does per step counts: generation, rewards, reference and policy
forwards, backward, optimizer, logging), the first ``--warmup`` steps are dropped, and the
median is reported. The two sides alternate for ``--rounds`` rounds to spread machine-load drift
over both.

Loss check ("same loss at step 0"): two independent generators cannot produce the same
completions, so one process builds one batch (prompts of equal token length, so no padding,
completions sampled once), injects the same tensors, advantages, old and reference log-probs
into both implementations and reports both losses: gbmpo's
``gbmpo.train.step.accumulate_gradients`` and TRL's ``GRPOTrainer._compute_loss``.

CPU time per step (``time.process_time``) is reported next to wall time: with one torch thread
it measures the work done and is much less sensitive to other jobs on a shared machine.
``--baseline`` adds a third side, "gbmpo-hf": gbmpo's trainer with ``rollout.generator=hf``
(transformers' ``generate``) and ``rollout.share_prompts=false`` (one log-prob forward per
row), i.e. the trainer before its prompt-sharing rollout, for a before/after in the same run.
``--no-lean`` adds "gbmpo-nolean": the default trainer with ``rollout.lean_decoder=false`` (the
decode forwards through transformers' model call instead of ``gbmpo.rollout.LeanDecoder``).
``--no-lean-forward`` adds "gbmpo-noleanfwd": the default trainer with
``rollout.lean_forward=false`` (the policy/reference log-prob passes and the backward through
transformers' forward instead of ``gbmpo.rollout.LeanForward``). ``--no-keep-freed-memory``
adds "gbmpo-mallocdefault": the default trainer with ``run.keep_freed_memory=false`` (glibc's
default malloc thresholds: every freed activation goes back to the OS and the next one
page-faults). ``--trl-keep-freed-memory`` adds "trl-keepfreed": TRL in a process where
``gbmpo.train.allocator.keep_freed_memory()`` was called first, i.e. what the same allocator
setting (or ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` in the environment) gives TRL.
"gbmpo-hf" turns all three off. ``--gbmpo-src DIR`` adds "gbmpo-before": the default trainer
with the ``gbmpo`` package imported from ``DIR`` (``PYTHONPATH``; e.g. an earlier commit's
``src`` exported with ``git archive <rev> src | tar -x -C /tmp/before``), for a before/after of
code changes in the same run (the package each child imported is recorded as
``gbmpo_module``).

Model FLOPs utilisation (MFU). Every child first measures this machine's float32 matmul peak at
the benchmark's thread count (best of ``--peak-repeats`` ``torch.matmul`` of two 2048 x 2048
matrices, 2 * 2048^3 FLOPs each); the run's peak is the best over all children. Each step's
model FLOPs are counted from the tokens that side actually processed, with the same formula for
both sides (the work the task defines, whatever an implementation skips):

    F_token(n) = 2 * N_matmul + 4 * L * (H * d) * n_ctx     (forward, per token)
    model FLOPs/step = 5 * sum over rows of [ (p + c) * 2 * N_matmul + 2 * L * (H * d) * (p + c)^2 ]

with ``N_matmul`` the parameters of every matrix multiply (attention and MLP projections and the
LM head; the tied embedding counted once, as the head), ``L`` layers, ``H * d`` the query width,
``p``/``c`` the real prompt/completion tokens of a row (measured per step on each side, prompt
padding excluded) and the causal attention's two products (``QK^T`` and ``AV``) summed over the
row's positions. The factor 5 is 1 (sampling forward) + 1 (reference forward, no grad) + 3
(policy forward + backward, backward = 2 forwards). MFU = model FLOPs per second / peak, from
wall time and from CPU time (one thread: the work done). gbmpo forwards each prompt once per
group of G rows, so its executed FLOPs are lower than its model FLOPs: ``hfu`` (hardware FLOPs
utilisation) counts the prompt part once per distinct prompt in all three passes for gbmpo
(and per row for TRL and "gbmpo-hf").

    python benchmarks/trainer_vs_trl.py --gbmpo-src /tmp/before/src  # + an earlier gbmpo
    python benchmarks/trainer_vs_trl.py --no-lean-forward     # both sizes, + lean forward off
    python benchmarks/trainer_vs_trl.py --baseline --no-lean  # both sizes (about 15 minutes)
    python benchmarks/trainer_vs_trl.py --baseline            # both sizes (about 10 minutes)
    python benchmarks/trainer_vs_trl.py --sizes 0.2M --steps 8 --rounds 2
    python benchmarks/trainer_vs_trl.py --sizes 0.2M --rounds 1 --profile-dir /tmp/prof
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    finish_result,
    load_average,
    median,
    peak_rss_bytes,
    run_child,
    run_child_logged,
    serve_child,
    start_result,
)

#: model configs (vocabulary: the shipped tokenizer, 447 tokens; tied embeddings)
SIZES: dict[str, dict[str, int]] = {
    "0.2M": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=256),
    "10M": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2, head_dim=64, intermediate_size=1024),
    # a toy size for the smoke test
    "toy": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, intermediate_size=32),
}
#: speed targets, gbmpo/TRL steps/s, met only when every round meets it too
GOALS = {"0.2M": 3.0, "10M": 2.0}

# the shared settings of both trainers
BETA = 0.04
EPSILON = 0.2
LR = 1e-6
BETAS = (0.9, 0.999)
GRAD_CLIP = 1.0


def build_model(size: str, out_dir: str, seed: int = 0) -> dict[str, int]:
    """A random Qwen3 of ``size`` with the shipped tokenizer, saved to ``out_dir``; returns its
    ``parameters``, ``matmul_parameters`` (see :func:`model_flops`), ``layers`` and
    ``attention_width`` (query heads x head dim)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gbmpo.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(None)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        # the LM head is an nn.Linear (its weight tied to the embedding, counted here once)
        "matmul_parameters": linear,
        "layers": cfg.num_hidden_layers,
        "attention_width": cfg.num_attention_heads * cfg.head_dim,
    }


def model_flops(dims: dict[str, int], prompt_tokens: float, completion_tokens: float,
                rows: int, passes: float = 5.0) -> float:
    """Model FLOPs of one step (module docstring): ``passes`` forwards (1 sampling + 1 reference
    + 3 for the policy forward and backward) over ``rows`` rows holding ``prompt_tokens`` and
    ``completion_tokens`` real tokens in total; the attention term uses the mean row length."""
    tokens = prompt_tokens + completion_tokens
    per_row = tokens / max(rows, 1)
    attention = 2 * dims["layers"] * dims["attention_width"] * per_row * per_row * rows
    return passes * (2 * dims["matmul_parameters"] * tokens + attention)


def matmul_peak_gflops(threads: int, repeats: int, size: int = 2048) -> float:
    """This machine's float32 matmul rate at ``threads`` torch threads: the best of ``repeats``
    ``size x size`` products, in GFLOP/s."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)  # warm-up (allocation, library initialisation)
    best = float("inf")
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def _task(num_train: int) -> Any:
    from gbmpo.tasks import get_task

    return get_task("arithmetic", num_train=num_train, num_test=16, num_sft=1)


# --------------------------------------------------------------------------------- our trainer


def _our_config(model_dir: str, out_dir: str, steps: int, a: argparse.Namespace,
                role: str = "ours") -> Any:
    """gbmpo's trainer settings for ``role``: "ours" (the defaults), "baseline" (transformers'
    ``generate``, one log-prob forward per row, neither lean path, glibc's malloc defaults),
    "nolean" (the defaults without the lean decode step), "noleanfwd" (the defaults without
    the lean log-prob forward) or "mallocdefault" (the defaults with glibc's malloc
    defaults)."""
    from gbmpo.config import config_from_dict

    baseline = role == "baseline"

    return config_from_dict(
        {
            "model": {"path": model_dir},
            "task": {"name": "arithmetic", "params": {"num_train": a.num_train, "num_test": 16,
                                                       "num_sft": 1}},
            "rollout": {"prompts_per_step": a.prompts, "num_generations": a.generations,
                        "max_new_tokens": a.max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                        "top_k": 0, "generator": "hf" if baseline else "gbmpo",
                        "share_prompts": not baseline,
                        "lean_decoder": role not in ("baseline", "nolean"),
                        "lean_forward": role not in ("baseline", "noleanfwd")},
            "objective": {
                "advantage": "dr_grpo",
                "surrogate": {"name": "clip", "params": {"eps_low": EPSILON,
                                                         "eps_high": EPSILON}},
                "regularizer": {"name": "kl_k3_is", "coef": BETA, "anchor": "ref"},
                "aggregation": "dr_grpo",
                "monitor_regularizers": False,
            },
            # one AdamW step on the whole batch per generation, as TRL with
            # steps_per_generation = num_iterations = 1 (set explicitly: gbmpo's defaults differ)
            "optim": {"lr": LR, "betas": list(BETAS), "grad_clip": GRAD_CLIP, "mu": 1,
                      "mini_batch_size": None, "micro_batch_size": None, "warmup_steps": 0,
                      "schedule": "constant", "weight_decay": 0.0},
            "eval": {"every": 0, "before": False, "after": False},
            "run": {"steps": steps, "time_budget_seconds": None, "seed": 0,
                    "output_dir": out_dir, "checkpoint_every": 0, "num_threads": a.threads,
                    "keep_freed_memory": role not in ("baseline", "mallocdefault"),
                    "progress": False},
        }
    )


def child_ours(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    import gbmpo
    import gbmpo.train.step as step_module
    from gbmpo.train.trainer import Trainer

    peak = matmul_peak_gflops(a.threads, a.peak_repeats)
    torch.set_num_threads(a.threads)
    out = tempfile.mkdtemp(prefix="gbmpo-bench-ours-")
    cfg = _our_config(a.model_dir, os.path.join(out, "run"), a.steps, a, role=a.child)
    ends: list[float] = []
    cpu_ends: list[float] = []
    tokens: list[float] = []
    prompts: list[tuple[float, float]] = []  # (real prompt tokens over rows, distinct prompts')
    generate = step_module.generate

    def counted_generate(*args: Any, **kwargs: Any) -> Any:
        batch = generate(*args, **kwargs)
        per_row = batch.prompt_mask.sum(dim=1).float()
        g = kwargs.get("num_return_sequences", 1)
        prompts.append((float(per_row.sum()), float(per_row.sum()) / g))
        return batch

    step_module.generate = counted_generate

    class Timed(Trainer):
        def train_step(self) -> dict[str, Any]:
            record = super().train_step()
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            tokens.append(record["response_length_mean"] * a.prompts * a.generations)
            return record

    t0 = time.perf_counter()
    trainer = Timed(cfg)
    t_setup = time.perf_counter() - t0
    with _profiled(a.profile):
        starts, cpu_starts = time.perf_counter(), time.process_time()
        trainer.train()
    side = SIDE_OF_ROLE[a.child]
    stats = _step_stats(side, [starts, *ends], [cpu_starts, *cpu_ends], tokens, a.warmup,
                        t_setup)
    kept = prompts[a.warmup : len(ends)]
    stats["prompt_tokens_per_step_mean"] = sum(p for p, _ in kept) / max(len(kept), 1)
    # executed: gbmpo's default engine and log-prob passes forward each prompt once per group
    shared = a.child != "baseline"
    stats["executed_prompt_tokens_per_step_mean"] = (
        sum(u if shared else p for p, u in kept) / max(len(kept), 1)
    )
    stats["matmul_peak_gflops"] = peak
    stats["gbmpo_module"] = str(Path(gbmpo.__file__).resolve().parent)
    return stats


# --------------------------------------------------------------------------------- TRL


def _trl_config(out_dir: str, steps: int, a: argparse.Namespace) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=a.prompts * a.generations,
        gradient_accumulation_steps=1,
        num_generations=a.generations,
        max_completion_length=a.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_steps=steps,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        weight_decay=0.0,
        max_grad_norm=GRAD_CLIP,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=BETA,
        epsilon=EPSILON,
        loss_type="dr_grpo",
        scale_rewards="none",
        num_iterations=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )


def _trl_dataset(task: Any) -> Any:
    from datasets import Dataset

    rows = [{"prompt": ex["prompt"], "answer": ex["answer"]} for ex in task.split("train")]
    return Dataset.from_list(rows)


def _trl_reward(task: Any) -> Any:
    def reward(prompts: list[str], completions: list[str], answer: list[Any], **_: Any) -> Any:
        return task.reward(prompts, completions, answer=answer)

    reward.__name__ = "arithmetic"
    return reward


def child_trl(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    if a.child == "trlkeepfreed":
        from gbmpo.train.allocator import keep_freed_memory

        keep_freed_memory()
    peak = matmul_peak_gflops(a.threads, a.peak_repeats)
    torch.set_num_threads(a.threads)
    task = _task(a.num_train)
    out = tempfile.mkdtemp(prefix="gbmpo-bench-trl-")
    ends: list[float] = []
    cpu_ends: list[float] = []
    prompts: list[float] = []  # real prompt tokens over the rows of each step

    class CountingGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            output = super()._generate_and_score_completions(inputs)
            prompts.append(float(output["prompt_mask"].sum()))
            return output

    class StepTimer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    trainer = CountingGRPOTrainer(
        model=a.model_dir,
        reward_funcs=_trl_reward(task),
        args=_trl_config(out, a.steps, a),
        train_dataset=_trl_dataset(task),
        processing_class=tok,
        callbacks=[StepTimer()],
    )
    t_setup = time.perf_counter() - t0
    with _profiled(a.profile):
        starts, cpu_starts = time.perf_counter(), time.process_time()
        trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = [h["completions/mean_length"] * a.prompts * a.generations for h in logs]
    stats = _step_stats(SIDE_OF_ROLE[a.child], [starts, *ends], [cpu_starts, *cpu_ends], tokens,
                        a.warmup, t_setup)
    kept = prompts[a.warmup : len(ends)]
    stats["prompt_tokens_per_step_mean"] = sum(kept) / max(len(kept), 1)
    stats["executed_prompt_tokens_per_step_mean"] = stats["prompt_tokens_per_step_mean"]
    stats["matmul_peak_gflops"] = peak
    return stats


@contextmanager
def _profiled(path: str | None) -> Iterator[None]:
    """Profile the block with pyinstrument and write the profile to ``path`` (see
    :func:`_write_profile`); no profiler when ``path`` is empty."""
    if not path:
        yield
        return
    from pyinstrument import Profiler

    prof = Profiler(interval=0.005)
    prof.start()
    yield
    prof.stop()
    _write_profile(prof, path)


def _write_profile(prof: Any, path: str) -> None:
    """The call tree (library frames shown, nodes under 1% of the time dropped) and a flat list
    of self times."""
    tree = prof.output_text(unicode=False, color=False, show_all=True,
                            processor_options={"filter_threshold": 0.01})
    flat = prof.output_text(unicode=False, color=False, flat=True)
    Path(path).write_text(tree + "\n\n===== flat (self time) =====\n" + flat)


def _step_stats(
    side: str,
    marks: list[float],
    cpu_marks: list[float],
    tokens: list[float],
    warmup: int,
    t_setup: float,
) -> dict[str, Any]:
    deltas = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    cpu = [b - a for a, b in zip(cpu_marks, cpu_marks[1:], strict=False)][warmup:]
    if len(deltas) <= warmup:
        raise RuntimeError(f"{side}: only {len(deltas)} steps timed, need more than {warmup}")
    kept = deltas[warmup:]
    toks = tokens[warmup : len(deltas)]
    per_step_tps = [t / d for t, d in zip(toks, kept, strict=False)]
    return {
        "side": side,
        "setup_seconds": t_setup,
        "step_seconds_all": deltas,
        "step_seconds_median": median(kept),
        "steps_per_second": 1.0 / median(kept),
        "cpu_seconds_per_step_median": median(cpu),
        "tokens_per_step_mean": sum(toks) / max(len(toks), 1),
        "tokens_per_second": median(per_step_tps) if per_step_tps else None,
        "peak_rss_gb": peak_rss_bytes() / 1e9,
        "loadavg_end": load_average(),
    }


# --------------------------------------------------------------------------------- loss check


def child_loss(a: argparse.Namespace) -> dict[str, Any]:
    """Both implementations' loss on one identical injected batch."""
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from gbmpo.rollout.logprobs import completion_logprobs
    from gbmpo.rollout.sampling import Rollout, generate
    from gbmpo.train.step import accumulate_gradients
    from gbmpo.train.trainer import Trainer

    torch.set_num_threads(a.threads)
    task = _task(a.num_train)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    # prompts of one token length -> no left padding in the injected batch (TRL's training
    # forward passes no position ids, gbmpo's passes mask-based ones; with RoPE a constant shift
    # does not change the result, measured equal on padded rows too, but this keeps the check
    # independent of that)
    by_len: dict[int, list[str]] = {}
    for ex in task.split("train"):
        by_len.setdefault(len(tok(ex["prompt"])["input_ids"]), []).append(ex["prompt"])
    length, prompts = max(by_len.items(), key=lambda kv: len(kv[1]))
    prompts = prompts[: a.prompts]
    if len(prompts) < a.prompts:
        raise RuntimeError(f"only {len(prompts)} prompts of {length} tokens")

    out = tempfile.mkdtemp(prefix="gbmpo-bench-loss-")
    ours = Trainer(_our_config(a.model_dir, os.path.join(out, "ours"), 1, a))
    trl = GRPOTrainer(
        model=a.model_dir,
        reward_funcs=_trl_reward(task),
        args=_trl_config(os.path.join(out, "trl"), 1, a),
        train_dataset=_trl_dataset(task),
        processing_class=tok,
    )
    # identical weights on both sides (both loaded from the same directory)
    for (n1, p1), (_, p2) in zip(
        ours.model.named_parameters(), trl.model.named_parameters(), strict=True
    ):
        if not torch.equal(p1, p2):
            raise RuntimeError(f"weights differ at {n1}")

    batch = generate(ours.model, ours.tokenizer, prompts, num_return_sequences=a.generations,
                     max_new_tokens=a.max_new_tokens, generator_seed=123)
    n, c = batch.completion_ids.shape
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        logp, _ = completion_logprobs(ours.model, batch.prompt_ids, batch.prompt_mask,
                                      batch.completion_ids, batch.completion_mask)
    # off-policy old log-probs (so the clip acts) and a perturbed reference (so k3 != 0)
    old = logp + 0.3 * torch.randn(n, c, generator=g)
    ref = logp + 0.5 * torch.randn(n, c, generator=g)
    adv = torch.randn(n, generator=g)
    mask = batch.completion_mask

    ours.model.train()
    ours.optimizer.zero_grad(set_to_none=True)
    stats = accumulate_gradients(ours.models, ours.objective, ours.config, ours.micro_batch,
                                 batch, torch.arange(n), adv, old, ref)
    loss_ours = float(stats.loss)

    trl.model.train()
    trl.current_gradient_accumulation_steps = 1
    inputs = {
        "prompt_ids": batch.prompt_ids,
        "prompt_mask": batch.prompt_mask,
        "completion_ids": batch.completion_ids,
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss_trl = float(trl._compute_loss(trl.model, inputs).detach())
    assert isinstance(batch, Rollout)
    return {
        "loss_gbmpo": loss_ours,
        "loss_trl": loss_trl,
        "abs_diff": abs(loss_ours - loss_trl),
        "batch": {"sequences": n, "completion_width": c, "prompt_tokens": length,
                  "valid_tokens": int(mask.sum())},
    }


# --------------------------------------------------------------------------------- driver


def _child_args(a: argparse.Namespace, role: str, model_dir: str, steps: int) -> list[str]:
    args = [__file__, "--child", role, "--model-dir", model_dir, "--steps", str(steps),
            "--warmup", str(a.warmup), "--threads", str(a.threads), "--prompts", str(a.prompts),
            "--generations", str(a.generations), "--max-new-tokens", str(a.max_new_tokens),
            "--num-train", str(a.num_train), "--peak-repeats", str(a.peak_repeats)]
    if a.profile_dir:
        args += ["--profile", str(Path(a.profile_dir) / f"{role}-{Path(model_dir).name}.txt")]
    return args


SIDE_OF_ROLE = {"ours": "gbmpo", "trl": "trl", "baseline": "gbmpo-hf", "before": "gbmpo-before",
                "nolean": "gbmpo-nolean", "noleanfwd": "gbmpo-noleanfwd",
                "mallocdefault": "gbmpo-mallocdefault", "trlkeepfreed": "trl-keepfreed"}


def _summarise_side(runs: list[dict[str, Any]], dims: dict[str, int], rows: int,
                    peak_gflops: float) -> dict[str, Any]:
    out = {
        "step_seconds_median": median([x["step_seconds_median"] for x in runs]),
        "step_seconds_rounds": [x["step_seconds_median"] for x in runs],
        "tokens_per_second": median([x["tokens_per_second"] for x in runs]),
        "tokens_per_step": median([x["tokens_per_step_mean"] for x in runs]),
        "prompt_tokens_per_step": median([x["prompt_tokens_per_step_mean"] for x in runs]),
        "executed_prompt_tokens_per_step": median(
            [x["executed_prompt_tokens_per_step_mean"] for x in runs]
        ),
        "peak_rss_gb": max(x["peak_rss_gb"] for x in runs),
        "cpu_seconds_per_step": median([x["cpu_seconds_per_step_median"] for x in runs]),
    }
    out["steps_per_second"] = 1.0 / out["step_seconds_median"]
    flops = model_flops(dims, out["prompt_tokens_per_step"], out["tokens_per_step"], rows)
    # executed: the prompt tokens each implementation actually forwards (the attention term
    # kept at the model value: the completion tokens still attend to the whole prompt)
    executed = flops - 5 * 2 * dims["matmul_parameters"] * (
        out["prompt_tokens_per_step"] - out["executed_prompt_tokens_per_step"])
    peak = peak_gflops * 1e9
    out["model_flops_per_step"] = flops
    out["executed_flops_per_step"] = executed
    out["achieved_gflops"] = flops / out["step_seconds_median"] / 1e9
    out["mfu"] = flops / out["step_seconds_median"] / peak
    out["mfu_cpu_time"] = flops / out["cpu_seconds_per_step"] / peak
    out["hfu"] = executed / out["step_seconds_median"] / peak
    return out


def _ratios(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, float]:
    return {
        "speedup_steps": ours["steps_per_second"] / trl["steps_per_second"],
        "speedup_tokens": ours["tokens_per_second"] / trl["tokens_per_second"],
        # CPU time per step: with one torch thread it is the work done, much less sensitive to
        # other processes than wall time on a shared machine
        "speedup_cpu_time": trl["cpu_seconds_per_step"] / ours["cpu_seconds_per_step"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="0.2M,10M", help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--steps", type=int, default=0,
                   help="steps per run (0: 10 for sizes below 1M parameters, else 5)")
    p.add_argument("--warmup", type=int, default=1, help="leading steps not timed")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs per side")
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--num-train", type=int, default=512, help="training prompts in the task")
    p.add_argument("--baseline", action="store_true",
                   help="also time gbmpo with rollout.generator=hf and share_prompts=false")
    p.add_argument("--no-lean", action="store_true",
                   help="also time gbmpo with rollout.lean_decoder=false")
    p.add_argument("--no-lean-forward", action="store_true",
                   help="also time gbmpo with rollout.lean_forward=false")
    p.add_argument("--no-keep-freed-memory", action="store_true",
                   help="also time gbmpo with run.keep_freed_memory=false")
    p.add_argument("--trl-keep-freed-memory", action="store_true",
                   help="also time TRL with gbmpo's allocator setting applied first")
    p.add_argument("--gbmpo-src", default=None, metavar="DIR",
                   help="also time the default trainer with gbmpo imported from DIR (e.g. an "
                        "earlier commit's src: git archive REV src | tar -x -C /tmp/before)")
    p.add_argument("--peak-repeats", type=int, default=10,
                   help="2048x2048 matmuls per child for the machine's peak (best counts)")
    p.add_argument("--profile-dir", default=None, help="write pyinstrument profiles here")
    p.add_argument("--no-loss-check", action="store_true")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/)")
    p.add_argument("--child", choices=["ours", "trl", "loss", "baseline", "before", "nolean",
                                       "noleanfwd", "mallocdefault", "trlkeepfreed"],
                   help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    a = p.parse_args()

    if serve_child(a, {"ours": child_ours, "baseline": child_ours, "before": child_ours,
                       "nolean": child_ours,
                       "noleanfwd": child_ours, "mallocdefault": child_ours,
                       "trl": child_trl, "trlkeepfreed": child_trl, "loss": child_loss}):
        return

    if a.profile_dir:
        Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        **start_result("trainer_vs_trl"),
        "settings": {
            "prompts_per_step": a.prompts, "num_generations": a.generations,
            "max_new_tokens": a.max_new_tokens, "beta": BETA, "epsilon": EPSILON,
            "kl": "k3 x ratio (TRL use_bias_correction_kl=True; gbmpo kl_k3_is)",
            "loss_type": "dr_grpo", "scale_rewards": "none", "lr": LR, "threads": a.threads,
            "warmup_steps_dropped": a.warmup, "rounds": a.rounds, "gbmpo_src": a.gbmpo_src,
        },
        "sizes": {},
    }
    if a.gbmpo_src and not (Path(a.gbmpo_src) / "gbmpo" / "__init__.py").is_file():
        raise SystemExit(f"--gbmpo-src {a.gbmpo_src}: no gbmpo/__init__.py in it")
    extra_roles = ((["before"] if a.gbmpo_src else [])
                   + (["baseline"] if a.baseline else []) + (["nolean"] if a.no_lean else [])
                   + (["noleanfwd"] if a.no_lean_forward else [])
                   + (["mallocdefault"] if a.no_keep_freed_memory else [])
                   + (["trlkeepfreed"] if a.trl_keep_freed_memory else []))
    roles = ["ours", "trl", *extra_roles]
    summary = []
    with tempfile.TemporaryDirectory(prefix="gbmpo-bench-models-") as tmp:
        for size in [s.strip() for s in a.sizes.split(",") if s.strip()]:
            if size not in SIZES:
                raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
            model_dir = os.path.join(tmp, size)
            dims = build_model(size, model_dir)
            n_params = dims["parameters"]
            steps = a.steps or (10 if n_params < 1_000_000 else 5)
            entry: dict[str, Any] = {"parameters": n_params, "model_dims": dims,
                                     "steps_per_run": steps,
                                     "runs": {SIDE_OF_ROLE[r]: [] for r in roles}}
            for r in range(a.rounds):
                for role in (roles if r % 2 == 0 else roles[::-1]):
                    env = None
                    if role == "before":  # the earlier package first on the import path
                        src = str(Path(a.gbmpo_src).resolve())
                        env = {"PYTHONPATH": os.pathsep.join(
                            [src, *filter(None, [os.environ.get("PYTHONPATH")])])}
                    res = run_child_logged(_child_args(a, role, model_dir, steps), env)
                    entry["runs"][SIDE_OF_ROLE[role]].append(res)
                    print(f"[{size}] {SIDE_OF_ROLE[role]}: {res['step_seconds_median']:.3f} "
                          f"s/step (CPU {res['cpu_seconds_per_step_median']:.3f} s), "
                          f"{res['tokens_per_second']:.0f} tok/s "
                          f"(load {res['loadavg_start'][0]} -> {res['loadavg_end'][0]})"
                          + (f" [gbmpo from {res['gbmpo_module']}]" if role == "before" else ""),
                          flush=True)
            peak = max(x["matmul_peak_gflops"] for runs in entry["runs"].values() for x in runs)
            entry["matmul_peak_gflops"] = peak
            rows = a.prompts * a.generations
            for side, runs in entry["runs"].items():
                entry[side] = _summarise_side(runs, dims, rows, peak)
            entry.update(_ratios(entry["gbmpo"], entry["trl"]))
            entry["speedup_steps_rounds"] = [
                t / o for o, t in zip(entry["gbmpo"]["step_seconds_rounds"],
                                      entry["trl"]["step_seconds_rounds"], strict=True)
            ]
            entry["goal"] = GOALS.get(size)
            entry["goal_met"] = None if size not in GOALS else (
                entry["speedup_steps"] >= GOALS[size]
                and all(r >= GOALS[size] for r in entry["speedup_steps_rounds"])
            )
            rounds = ", ".join(f"{r:.2f}x" for r in entry["speedup_steps_rounds"])
            line = (f"[{size}] {n_params / 1e6:.2f}M params: gbmpo/TRL "
                    f"{entry['speedup_steps']:.2f}x steps/s (rounds {rounds}), "
                    f"{entry['speedup_tokens']:.2f}x tokens/s, {entry['speedup_cpu_time']:.2f}x "
                    f"CPU time/step; matmul peak {peak:.1f} GFLOP/s, MFU/HFU "
                    + ", ".join(f"{side} {entry[side]['mfu']:.1%}/{entry[side]['hfu']:.1%}"
                                for side in entry["runs"]))
            for role in extra_roles:
                side = SIDE_OF_ROLE[role]
                entry[role] = _ratios(entry[side], entry["trl"])
                line += (f"; {side}/TRL {entry[role]['speedup_steps']:.2f}x steps/s,"
                         f" {entry[role]['speedup_cpu_time']:.2f}x CPU time")
            if not a.no_loss_check:
                lc = entry["loss_check"] = run_child(_child_args(a, "loss", model_dir, 1))
                line += f"; step-0 loss gbmpo {lc['loss_gbmpo']:.6g} trl {lc['loss_trl']:.6g}"
            result["sizes"][size] = entry
            print(line, flush=True)
            summary.append(f"{size}: {entry['speedup_steps']:.2f}x"
                           + (f" (goal {GOALS[size]}x)" if size in GOALS else "")
                           + "".join(f", {SIDE_OF_ROLE[r]} {entry[r]['speedup_steps']:.2f}x"
                                     for r in extra_roles))
    path = finish_result(result, a.out)
    print(f"trainer_vs_trl: gbmpo/TRL steps/s {'; '.join(summary)} -> {path}")


if __name__ == "__main__":
    main()
