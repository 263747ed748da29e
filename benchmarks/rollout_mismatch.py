"""How far the own engine's sampler is from its trainer: the mismatch the rollout correction sees.

For each sampler (``rollout.generator`` ``gbmpo`` / ``hf``), weights dtype and truncation (top-p,
top-k), the embedded tiny model samples ``--prompts`` arithmetic prompts x ``--generations``
completions of at most ``--max-new-tokens`` tokens (temperature 1, a fixed seed) with the
sampler's log-probs (``generate(..., return_logprobs=True)``), the trainer computes its log-probs
of the same tokens (``completion_logprobs``, eval mode, the same weights), and the script reports
over the valid tokens: the mean and the largest |log pi_old - log mu|, the mean log-ratio, and
the statistics of the weights of three corrections (``gbmpo.objectives.rollout_correction``):
token ``tis`` with high 2, sequence ``tis`` with high 2, token ``icepop`` with [0.5, 5] (its
masked fraction).

The own sampler's decode step is a column too (``decode``): ``lean`` (the lean decoder, the
CPU's default for a plain model), ``static`` (the static-shape step, CUDA's default), and with
LoRA (``lora`` > 0: rank-8 adapters on every projection, random ``B``, ``--lora-seed``): ``peft``
(peft's unmerged forward per token: what a LoRA run sampled with before the static step),
``merge`` (the static step on merged weights :math:`W+sBA`, LoRA's default now) and ``inline``
(the static step with the adapters' two products in the step). The trainer's log-probs of a
LoRA model always come from peft's unmerged forward.

    python benchmarks/rollout_mismatch.py [--out results/rollout_mismatch.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def measure(generator: str, dtype: torch.dtype, top_p: float, top_k: int, args: Any,
            model: Any, tok: Any, prompts: list[str], decode: str = "lean",
            lora: int = 0) -> dict[str, Any]:  # fmt: skip
    from gbmpo.objectives.rollout_correction import correction_weights, weight_stats
    from gbmpo.rollout import StaticDecoder, generate
    from gbmpo.rollout.logprobs import completion_logprobs

    if decode in ("merge", "inline"):
        StaticDecoder.for_model(model, lora=decode)  # kept for the model: generate takes it
    batch = generate(model, tok, prompts, num_return_sequences=args.generations,
                     max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=top_p,
                     top_k=top_k, generator_seed=args.seed, generator=generator,
                     decode_step="lean" if decode in ("lean", "peft") else "static",
                     return_logprobs=True)  # fmt: skip
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask,
                                         batch.completion_ids, batch.completion_mask)  # fmt: skip
    mask = batch.completion_mask
    assert batch.sampling_logp is not None
    diff = (trainer.float() - batch.sampling_logp)[mask.bool()]
    row: dict[str, Any] = {
        "generator": generator, "decode": decode if generator == "gbmpo" else "-", "lora": lora,
        "dtype": str(dtype).removeprefix("torch."), "top_p": top_p,
        "top_k": top_k, "tokens": int(mask.sum()),
        "abs_log_ratio_mean": float(diff.abs().mean()),
        "abs_log_ratio_max": float(diff.abs().max()),
        "log_ratio_mean": float(diff.mean()),
    }  # fmt: skip
    for name, mode, level, low, high in (("tis_token", "tis", "token", None, 2.0),
                                         ("tis_sequence", "tis", "sequence", None, 2.0),
                                         ("icepop", "icepop", "token", 0.5, 5.0)):
        w = correction_weights(mode, trainer.float(), batch.sampling_logp, mask, level=level,
                               low=low, high=high)  # fmt: skip
        stats = weight_stats(w, mask)
        row.update({f"{name}_{k}": v for k, v in stats.items()})
    return row


def with_lora(model: Any, rank: int, seed: int) -> Any:
    """``model`` with peft LoRA adapters of ``rank`` on every projection, ``B`` drawn from
    N(0, 0.02^2) (peft starts it at 0, where the adapters change nothing), in eval mode."""
    import warnings

    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=rank, lora_alpha=rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from gbmpo.models import load_model_and_tokenizer
    from gbmpo.tasks import TASKS

    task = TASKS.build("arithmetic")
    prompts = [ex["prompt"] for ex in task.split(task.train_split)[: args.prompts]]
    rows = []
    start = time.time()
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = load_model_and_tokenizer("tiny", dtype=dtype)
        model.eval()
        for generator in ("gbmpo", "hf"):
            for top_p, top_k in ((1.0, 0), (0.9, 0), (0.7, 0), (1.0, 20)):
                rows.append(measure(generator, dtype, top_p, top_k, args, model, tok, prompts))
        for top_p in (1.0, 0.95):
            rows.append(measure("gbmpo", dtype, top_p, 0, args, model, tok, prompts, "static"))
        model = with_lora(model, 8, args.lora_seed)
        for top_p in (1.0, 0.95):
            for decode in ("peft", "merge", "inline"):
                rows.append(measure("gbmpo", dtype, top_p, 0, args, model, tok, prompts, decode,
                                    lora=8))  # fmt: skip
    result = {"rows": rows, "seconds": time.time() - start, "argv": sys.argv[1:],
              "torch": torch.__version__}  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    cols = ("generator", "decode", "lora", "dtype", "top_p", "top_k", "abs_log_ratio_mean",
            "abs_log_ratio_max",
            "tis_token_weight_mean", "tis_sequence_weight_min", "icepop_masked_frac")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
