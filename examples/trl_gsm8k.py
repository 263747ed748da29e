"""GBMPO with TRL on GSM8K: a Qwen3 model, the ProbL2 regularizer, vLLM colocated generation.

The drop-in keeps TRL's whole training stack (vLLM generation, accelerate / DeepSpeed, PEFT,
logging) and swaps only the loss for gbmpo's: here Dr. GRPO aggregation with the ratio clip and
lambda * (p - p_ref)^2 on the sampled token's probability (GBMPO ProbL2, arXiv 2602.04380).

Needs a GPU, the model weights and ``pip install 'gbmpo[trl]' vllm``. One GPU:

    python examples/trl_gsm8k.py --model Qwen/Qwen3-1.7B --output-dir runs/gsm8k-probl2

Several GPUs (data parallel, vLLM colocated on each):

    accelerate launch --num_processes 8 examples/trl_gsm8k.py --model Qwen/Qwen3-1.7B

Other geometries: ``--regularizer neural_mirror --mirror-path es_best.json
--regularizer-coef 1e-4`` (NM-GRPO / NM-GRPO-ES), ``--regularizer kl_k3 --regularizer-coef 0.04``
(the KL baseline), ``--clip-mode atr --atr-delta 0.02`` (ATR-GRPO). ``--dry-run`` builds the
config and the dataset and stops before loading the model.

GSM8K is read from ``--data-dir`` (a directory with ``train.jsonl``), else from
``$GBMPO_DATA_DIR/gsm8k``, the copy inside the installed package, or the hub (``openai/gsm8k``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a Qwen3 model on GSM8K with TRL + gbmpo (GBMPOTrainer).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="Qwen/Qwen3-1.7B", help="hub id or local model directory")
    p.add_argument("--data-dir", default=None, help="directory holding GSM8K train.jsonl")
    p.add_argument("--output-dir", default="runs/trl-gsm8k-probl2")
    p.add_argument("--limit", type=int, default=None, help="use the first N training problems")
    # gbmpo objective
    p.add_argument("--regularizer", default="prob_l2", help="gbmpo REGULARIZERS name")
    p.add_argument("--regularizer-coef", type=float, default=0.1)
    p.add_argument("--regularizer-anchor", choices=("ref", "old"), default="ref")
    p.add_argument("--mirror-path", default=None, help="mirror map file for neural_mirror")
    p.add_argument("--clip-mode", choices=("ratio", "atr", "rpg_dual"), default="ratio")
    p.add_argument("--atr-delta", type=float, default=None)
    p.add_argument("--loss-type", default="dr_grpo", help="grpo, dr_grpo, bnpo, dapo or luspo")
    p.add_argument("--scale-rewards", choices=("group", "batch", "none"), default="none")
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--epsilon-high", type=float, default=None)
    # sampling and batches
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--per-device-batch", type=int, default=16, help="completions per device")
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    # optimisation
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    # generation backend
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                   help="generate with vLLM colocated on the training GPUs")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--report-to", default="none", help="wandb, tensorboard, trackio or none")
    p.add_argument("--dry-run", action="store_true",
                   help="build the config and the dataset, print them and exit")
    return p


def build_config(args: argparse.Namespace) -> Any:
    from gbmpo.integrations.trl import GBMPOConfig

    return GBMPOConfig(
        output_dir=args.output_dir,
        # gbmpo
        regularizer=args.regularizer,
        regularizer_coef=args.regularizer_coef,
        regularizer_anchor=args.regularizer_anchor,
        mirror_path=args.mirror_path,
        clip_mode=args.clip_mode,
        atr_delta=args.atr_delta,
        loss_type=args.loss_type,
        scale_rewards=args.scale_rewards,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        # sampling
        num_generations=args.num_generations,
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        chat_template_kwargs={"enable_thinking": False},  # Qwen3: answer without <think>
        # optimisation
        learning_rate=args.learning_rate,
        max_steps=args.max_steps,
        max_grad_norm=1.0,
        warmup_steps=0.1,  # a float in [0, 1) is a ratio of max_steps
        lr_scheduler_type="cosine",
        bf16=args.bf16,
        seed=args.seed,
        # vLLM
        use_vllm=args.vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        # logging
        logging_steps=10,
        save_steps=200,
        report_to=args.report_to,
        log_completions=False,
    )


def build_dataset(data_dir: str | None, limit: int | None) -> Any:
    """GSM8K train split as TRL conversational prompts; ``answer`` goes to the reward."""
    from datasets import Dataset

    from gbmpo.tasks.gsm8k import CHAT_SYSTEM, GSM8KTask

    rows = GSM8KTask(path=data_dir).split("train")
    if limit is not None:
        rows = rows[:limit]
    return Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": CHAT_SYSTEM},
                    {"role": "user", "content": r["question"]},
                ],
                "answer": r["answer"],
            }
            for r in rows
        ]
    )


def main(argv: Sequence[str] | None = None) -> Any:
    args = build_parser().parse_args(argv)
    config = build_config(args)
    dataset = build_dataset(args.data_dir, args.limit)
    if args.dry_run:
        print(f"{len(dataset)} training problems; first: {dataset[0]['prompt'][1]['content']!r}")
        print(f"regularizer={config.regularizer} coef={config.regularizer_coef} "
              f"anchor={config.regularizer_anchor} clip_mode={config.clip_mode} "
              f"loss_type={config.loss_type} beta(TRL)={config.beta} use_vllm={config.use_vllm}")
        return None

    from gbmpo.integrations.trl import GBMPOTrainer
    from gbmpo.rewards.math import math_reward_fn

    peft_config = None
    if args.lora_r > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_r,
            lora_dropout=0.05,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                            "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
    trainer = GBMPOTrainer(
        model=args.model,
        reward_funcs=[math_reward_fn],
        args=config,
        train_dataset=dataset,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
