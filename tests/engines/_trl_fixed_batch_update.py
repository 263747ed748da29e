"""One TRL optimizer step (GBMPOTrainer, SGD) on a fixed batch; rank 0 saves the parameter update.

Run on one process (``python this.py OUT [AGGREGATION [MICRO]]``) or several (``accelerate
launch --multi_gpu --num_processes 2 this.py OUT ...``): each process takes its equal share of the
same 16 rows, so the saved updates must agree whatever the process count and the micro-batch
size (the loss normalisers and the data-parallel gradient average are exact; bnpo divides by the
optimizer step's tokens over every process). AGGREGATION may name several, separated by commas:
each is trained in turn in the same processes (from the same seed, model and batch; one launch
instead of one per aggregation), and OUT holds ``{aggregation: {"delta", "world"}}``. Used by
test_trl_engine.py.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gbmpo.config import load_config
from gbmpo.engines.trl.args import grpo_args, train_dataset
from gbmpo.integrations.trl import GBMPOTrainer
from gbmpo.models import load_model_and_tokenizer
from gbmpo.tasks import get_task

N, G, T = 16, 4, 12  # rows, completions per prompt, completion length


def fixed_batch(tokenizer: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
    """4 prompts x 4 completions of random tokens with ragged lengths and fixed advantages."""
    gen = torch.Generator().manual_seed(0)
    enc = tokenizer([p for p in prompts for _ in range(G)], return_tensors="pt", padding=True,
                    padding_side="left")  # fmt: skip
    completion_ids = torch.randint(5, len(tokenizer) - 1, (N, T), generator=gen)
    lengths = torch.randint(3, T + 1, (N,), generator=gen)
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    rewards = torch.randint(0, 2, (N,), generator=gen).float()
    advantages = (rewards.view(-1, G) - rewards.view(-1, G).mean(1, keepdim=True)).view(-1)
    return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": advantages}  # fmt: skip


class FixedBatchTrainer(GBMPOTrainer):
    """Uses this process's share of :data:`BATCH` instead of generating (TRL's ``_prepare_inputs``
    then shuffles and splits it into micro-batches, as a generated batch)."""

    batch: dict[str, torch.Tensor]

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows = slice(rank * N // world, (rank + 1) * N // world)
        out: dict[str, Any] = {k: v[rows].to(self.accelerator.device) for k, v in
                               self.batch.items()}  # fmt: skip
        with torch.no_grad():  # first update: the reference is the policy itself
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
            ref, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, out["completion_ids"].size(1))
        out["ref_per_token_logps"] = ref
        out["num_items_in_batch"] = self.batch["completion_mask"].sum()
        return out


def update(aggregation: str, micro: int | None) -> dict[str, Any] | None:
    """``{"delta": the parameter update, "world": the process count}`` of one SGD step on the
    fixed batch, on the main process (``None`` on the others)."""
    torch.manual_seed(0)
    cfg = load_config(None, [("objective.aggregation", aggregation),
                             ("optim.micro_batch_size", micro),
                             ("rollout.prompts_per_step", 4), ("rollout.num_generations", G),
                             ("rollout.max_new_tokens", T), ("optim.mini_batch_size", None),
                             ("optim.lr", 1e-2), ("optim.schedule", "constant"),
                             ("optim.grad_clip", None), ("run.steps", 1),
                             ("objective.regularizer.coef", 0.5),
                             ("objective.monitor_regularizers", False)])  # fmt: skip
    model, tok = load_model_and_tokenizer("tiny", dtype=torch.float32, device="cpu")
    task = get_task("arithmetic")
    examples = task.split(task.train_split)[:4]
    with tempfile.TemporaryDirectory() as tmp:
        import accelerate

        world = accelerate.PartialState(cpu=True).num_processes
        args = grpo_args(cfg, tmp, world=world)
        args.optim = "sgd"  # the update is -lr * gradient: sensitive to every normaliser
        args.save_strategy = "no"
        FixedBatchTrainer.batch = fixed_batch(tok, [ex["prompt"] for ex in examples])
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        trainer = FixedBatchTrainer(model=model, reward_funcs=[lambda prompts, completions,
                                    **kw: [0.0] * len(prompts)], args=args,
                                    train_dataset=train_dataset(examples),
                                    processing_class=tok)  # fmt: skip
        trainer.train()
        policy = trainer.accelerator.unwrap_model(trainer.model)
        after = torch.cat([p.detach().flatten() for p in policy.parameters()])
        if not trainer.accelerator.is_main_process:
            return None
        return {"delta": after - before, "world": world}


def main(out: str, aggregation: str = "dr_grpo", micro: int | None = None) -> None:
    names = aggregation.split(",")
    results = {name: update(name, micro) for name in names}
    if results[names[0]] is not None:  # the main process
        torch.save(results[names[0]] if len(names) == 1 else results, Path(out))


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3], *(int(m) for m in sys.argv[3:4]))
