#!/usr/bin/env python
"""Build the embedded tiny Qwen3 model shipped in ``src/gbmpo/assets/tiny-qwen3/``.

Steps (all offline, CPU, fp32, fixed seeds; docs/development.md, "The embedded tiny model"):

1. Train a byte-level BPE tokenizer (``tokenizers``) on 20k problems of the built-in
   ``arithmetic`` task, with digits split into single tokens; special tokens ``<|endoftext|>``
   (pad, id 0), ``<|im_start|>``, ``<|im_end|>`` (EOS), ``<think>``, ``</think>`` and a minimal
   Qwen-style chat template; wrap it in ``PreTrainedTokenizerFast``.
2. Build ``Qwen3ForCausalLM`` from a config ("2M": h192, L4, 4 heads / 2 kv, head_dim 48,
   ffn 576, tied embeddings; "0.5M": h128, L2, 4/2, hd32, ffn 384).
3. Warm-start it by SFT on the task's ``sft`` split: batch 64, AdamW (betas 0.9/0.98), linear
   warm-up over 100 steps to a constant LR (1e-3 for 2M, 2e-3 for 0.5M), grad-norm clip 1,
   cross-entropy on the completion tokens only (the solution text and EOS). Every
   ``--eval-every`` steps, greedy accuracy on the 200 held-out ``test`` problems; stop at the
   first eval >= ``--target-acc``. The warm start is deliberately stopped in the middle of its
   accuracy jump so that RL has room to improve it.
4. ``save_pretrained`` (safetensors) model + tokenizer, plus ``build_info.json``.

The shipped asset is the script's defaults (SFT seed 5, held-out evaluation every 25 steps, one
torch thread)::

    .venv/bin/python scripts/build_tiny_model.py

Measured on the 2-core project machine on 2026-11-25 (torch 2.13.0+cpu, transformers 5.23.0;
recorded in ``build_info.json``): vocabulary 447 tokens (the BPE trainer runs out of merges below
the 512 asked for), 1,857,408 parameters, asset 7.1 MB. SFT reached the 45% target at step 425
(49.0%); held-out greedy accuracy at steps 25, 50, ..., 425: 0, 1.5, 3, 2, 2.5, 6, 5.5, 8.5, 2.5,
9.5, 10, 5, 16.5, 14, 34, 44, 49%. Wall time 469 s on one core (the same build alone on a core
took 391 s; this one shared its core with evaluations for its first two minutes).

Why seed 5: how much 180 s of RL adds depends strongly on the SFT run (``benchmarks/RESULTS.md``
sections 5.1 and 5.3). Seven SFT seeds' first checkpoint at or above 45%, each RL-trained for 180 s
with the default recipe on RL seed 0: seed 0 (step 325, 46%; the asset until 2026-11-25 14:00 was
its step 350) +13.0, seed 1 (450, 48%) +8.5, seed 2 (425, 48%) +16.5, seed 3 (450, 49%, the asset
until 2026-11-25 16:15) +17.0, seed 4 (400, 47.5%) +17.5, seed 5 (425, 49%) +30.5, seed 16 (450,
60%) +20.5. RL seeds 1 and 2, which took no part in the choice, confirmed seed 5 (84.0 and 81.0%,
i.e. +35.0 and +32.0); RL seeds 3 and 4, run after it shipped, gave 72.0 and 76.5%. The earlier
assets are ``--seed 3 --eval-every 50`` (step 450) and ``--seed 0 --eval-every 50`` (step 350);
the evaluations draw no random numbers, so the interval only decides where a build stops.

Reproduce and compare with the shipped asset (rebuilds with the recorded settings in a
temporary directory; exit status 0 iff the tokenizer, every weight tensor, the step count and the
held-out accuracy are identical)::

    .venv/bin/python scripts/build_tiny_model.py --check

The shipped seed-5 asset was built by the plain command above and is bit-identical (every tensor,
the tokenizer file) to the checkpoint the screen built and RL-trained (``--seed 5 --eval-every 25
--target-acc 0.45 --max-steps 700 --output-dir DIR``). ``--check`` against it (2026-11-25
17:01-17:08, one core, a CI run on the other): "rebuild identical".

CPU training is bit-reproducible for a fixed seed, thread count and torch build; another CPU or
torch version may round differently and then differs in the last bits (``--check`` reports the
largest weight difference).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from gbmpo.models import TINY_MODEL_PATH
from gbmpo.tasks.arithmetic import ArithmeticTask, arithmetic_reward

PAD, IM_START, EOS, THINK, END_THINK = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
)
SPECIAL_TOKENS = [PAD, IM_START, EOS, THINK, END_THINK]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: model sizes tried for the embedded model: (hidden, layers, heads, kv heads, head_dim, ffn)
SIZES: dict[str, dict[str, int]] = {
    "2M": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=48, intermediate_size=576),
    "0.5M": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=384),
    # a larger model for GPU runs (not shipped): ~57M parameters
    "50M": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
                num_key_value_heads=4, head_dim=64, intermediate_size=2304),
}
DEFAULT_LR = {"2M": 1e-3, "0.5M": 2e-3, "50M": 3e-4}


@dataclass
class BuildConfig:
    size: str = "2M"
    seed: int = 5  # the shipped asset; module docstring: why 5
    threads: int = 1
    batch_size: int = 64
    lr: float | None = None  # None -> DEFAULT_LR[size]
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 25  # the shipped asset stops at step 425
    target_acc: float = 0.45
    max_steps: int = 1500
    vocab_size: int = 512  # requested; the BPE trainer runs out of merges earlier
    tokenizer_corpus: int = 20_000
    max_new_tokens: int = 40
    eval_batch_size: int = 100
    device: str = "cpu"  # the shipped asset is built on the CPU

    def resolved_lr(self) -> float:
        return DEFAULT_LR[self.size] if self.lr is None else self.lr


# ------------------------------------------------------------------------------ tokenizer


def build_tokenizer(texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE with single-digit tokens, trained on ``texts`` (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, THINK, END_THINK],
        padding_side="left",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.pad_token_id == 0, fast.pad_token_id
    return fast


# ---------------------------------------------------------------------------------- model


def build_model(tokenizer: PreTrainedTokenizerFast, size: str, seed: int) -> Qwen3ForCausalLM:
    """A freshly initialised fp32 ``Qwen3ForCausalLM`` of the named size (seeded init)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None
    )
    gc.do_sample, gc.max_new_tokens = False, 40
    return model


# -------------------------------------------------------------------------------- training


def encode_sft(
    examples: list[dict[str, Any]], tokenizer: PreTrainedTokenizerFast
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS): prompt and completion are tokenized separately,
    exactly as the model sees them at generation time."""
    prompts = tokenizer([ex["prompt"] for ex in examples], add_special_tokens=False)["input_ids"]
    sols = tokenizer([ex["solution"] for ex in examples], add_special_tokens=False)["input_ids"]
    return [(p, s + [tokenizer.eos_token_id]) for p, s in zip(prompts, sols, strict=True)]


def collate(
    batch: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 outside completions)."""
    width = max(len(p) + len(c) for p, c in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, (p, c) in enumerate(batch):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(c)
    return ids, mask, labels


@torch.no_grad()
def greedy_accuracy(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[dict[str, Any]],
    *,
    max_new_tokens: int = 40,
    batch_size: int = 100,
) -> float:
    """Fraction of ``examples`` whose greedy completion scores 1 with the task verifier."""
    was_training = model.training
    model.eval()
    texts: list[str] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        enc = tokenizer([ex["prompt"] for ex in chunk], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False).to(model.device)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                        skip_special_tokens=True)
    model.train(was_training)
    rewards = arithmetic_reward(texts, [ex["answer"] for ex in examples])
    return sum(rewards) / len(rewards)


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then constant (step counts from 0)."""
    return lr * min(1.0, (step + 1) / warmup) if warmup > 0 else lr


def sft(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    data: list[tuple[list[int], list[int]]],
    heldout: list[dict[str, Any]],
    cfg: BuildConfig,
    log: Any = print,
    on_eval: Any = None,
) -> tuple[int, float | None, list[dict[str, float]]]:
    """Run SFT until the first held-out eval >= ``cfg.target_acc`` or ``cfg.max_steps``.

    Returns (steps done, last held-out accuracy or None if never evaluated, eval history).
    Batches are consecutive slices of ``data`` (already in random order), cycling if needed.
    ``on_eval(step, accuracy, model)``, if given, is called after every held-out eval (e.g. to
    keep each candidate stop point).
    """
    lr = cfg.resolved_lr()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98),
                            weight_decay=cfg.weight_decay)
    model.train()
    history: list[dict[str, float]] = []
    acc: float | None = None
    n_batches = len(data) // cfg.batch_size
    if n_batches == 0:
        raise ValueError(f"SFT data has {len(data)} examples, fewer than one batch")
    t0 = time.perf_counter()
    step = 0
    while step < cfg.max_steps:
        j = step % n_batches
        ids, mask, labels = collate(data[j * cfg.batch_size:(j + 1) * cfg.batch_size],
                                    tokenizer.pad_token_id)
        ids, mask, labels = ids.to(cfg.device), mask.to(cfg.device), labels.to(cfg.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, cfg.warmup_steps)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
            ignore_index=-100,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        if step % cfg.eval_every == 0:
            acc = greedy_accuracy(model, tokenizer, heldout, max_new_tokens=cfg.max_new_tokens,
                                  batch_size=cfg.eval_batch_size)
            elapsed = time.perf_counter() - t0
            history.append({"step": step, "loss": round(loss.item(), 5),
                            "heldout_accuracy": acc, "seconds": round(elapsed, 1)})
            log(f"step {step:5d}  loss {loss.item():.4f}  held-out acc {acc:.3f}  "
                f"{elapsed:.0f}s")
            if on_eval is not None:
                on_eval(step, acc, model)
            if acc >= cfg.target_acc:
                break
    return step, acc, history


# ----------------------------------------------------------------------------------- build


def sft_data(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(SFT examples in the order ``seed`` gives them, held-out problems) of the canonical
    ``arithmetic`` task; ``seed`` changes the order, never the held-out set."""
    task = ArithmeticTask()
    examples = task.split("sft")
    random.Random(seed).shuffle(examples)
    return examples, task.split("test")


def tokenizer_corpus(examples: list[dict[str, Any]], n: int) -> list[str]:
    """The first ``n`` full problems (prompt + solution) as tokenizer training text."""
    return [ex["prompt"] + ex["solution"] for ex in examples[:n]]



def _save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # batched evaluation leaves a padding setting on the backend; ship the tokenizer without it
    tokenizer.backend_tokenizer.no_padding()
    tokenizer.backend_tokenizer.no_truncation()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def build(cfg: BuildConfig, out_dir: Path, *, require_target: bool = True,
          log: Any = print, keep_evals: Path | None = None) -> dict[str, Any]:
    """Build tokenizer + model, warm-start, save into ``out_dir``; return the build info."""
    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    sft_examples, heldout = sft_data(cfg.seed)
    tokenizer = build_tokenizer(tokenizer_corpus(sft_examples, cfg.tokenizer_corpus),
                                cfg.vocab_size)
    model = build_model(tokenizer, cfg.size, cfg.seed).to(cfg.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"vocab {len(tokenizer)}  params {n_params}  size {cfg.size}  threads {cfg.threads}")
    data = encode_sft(sft_examples, tokenizer)
    on_eval = None
    if keep_evals is not None:
        def on_eval(step: int, accuracy: float, m: Qwen3ForCausalLM) -> None:
            # every candidate stop point, to compare RL from each (``step<N>/``)
            _save(m, tokenizer, keep_evals / f"step{step}")
            (keep_evals / f"step{step}" / "heldout.json").write_text(
                json.dumps({"step": step, "heldout_accuracy": accuracy}) + "\n")
    steps, acc, history = sft(model, tokenizer, data, heldout, cfg, log=log, on_eval=on_eval)
    if acc is None:  # no eval happened (max_steps < eval_every): measure once at the end
        acc = greedy_accuracy(model, tokenizer, heldout, max_new_tokens=cfg.max_new_tokens,
                              batch_size=cfg.eval_batch_size)
    if require_target and acc < cfg.target_acc:
        raise SystemExit(
            f"SFT stopped at max_steps={cfg.max_steps} with held-out accuracy {acc:.3f} < "
            f"target {cfg.target_acc}; nothing saved (raise --max-steps or lower --target-acc)"
        )
    _save(model, tokenizer, out_dir)
    import transformers

    info = {
        "config": {**cfg.__dict__, "lr": cfg.resolved_lr()},
        "vocab_size": len(tokenizer),
        "num_parameters": n_params,
        "steps": steps,
        "heldout_accuracy": acc,
        "heldout_problems": len(heldout),
        "evals": history,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "command": "python scripts/build_tiny_model.py " + shlex.join(sys.argv[1:]),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def compare_assets(built: Path, shipped: Path) -> list[str]:
    """Differences between two built asset directories (empty list = identical)."""
    from safetensors.torch import load_file

    problems: list[str] = []
    if (built / "tokenizer.json").read_bytes() != (shipped / "tokenizer.json").read_bytes():
        problems.append("tokenizer.json differs")
    a = load_file(str(built / "model.safetensors"))
    b = load_file(str(shipped / "model.safetensors"))
    if a.keys() != b.keys():
        problems.append(f"tensor names differ: {sorted(a.keys() ^ b.keys())}")
    worst = 0.0
    for k in sorted(a.keys() & b.keys()):
        if a[k].shape != b[k].shape:
            problems.append(f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
        elif not torch.equal(a[k], b[k]):
            worst = max(worst, (a[k] - b[k]).abs().max().item())
            problems.append(f"{k}: values differ")
    if worst:
        problems.append(f"largest weight difference {worst:.3g}")
    ia = json.loads((built / "build_info.json").read_text())
    ib = json.loads((shipped / "build_info.json").read_text())
    for key in ("steps", "heldout_accuracy", "vocab_size", "num_parameters"):
        if ia[key] != ib[key]:
            problems.append(f"{key}: rebuilt {ia[key]} vs shipped {ib[key]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    d = BuildConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=d.size)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=None,
                    help="default: 1e-3 (2M), 2e-3 (0.5M), 3e-4 (50M)")
    ap.add_argument("--device", default=d.device,
                    help="torch device for the warm start (the shipped asset: cpu)")
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--target-acc", type=float, default=d.target_acc,
                    help="stop at the first held-out greedy accuracy >= this")
    ap.add_argument("--max-steps", type=int, default=d.max_steps)
    ap.add_argument("--output-dir", type=Path, default=TINY_MODEL_PATH)
    ap.add_argument("--keep-evals", type=Path, default=None, metavar="DIR",
                    help="also save the model at every held-out eval as DIR/step<N>/ (candidate "
                         "stop points; e.g. with --target-acc 2 --max-steps 700)")
    ap.add_argument("--allow-below-target", action="store_true",
                    help="save even if --max-steps ends below --target-acc")
    ap.add_argument("--check", action="store_true",
                    help="rebuild with the settings recorded in OUTPUT_DIR/build_info.json into a "
                         "temporary directory and compare with OUTPUT_DIR")
    args = ap.parse_args(argv)

    if args.check:
        recorded = json.loads((args.output_dir / "build_info.json").read_text())
        cfg = BuildConfig(**recorded["config"])
        with tempfile.TemporaryDirectory() as tmp:
            build(cfg, Path(tmp), require_target=False)
            problems = compare_assets(Path(tmp), args.output_dir)
        if problems:
            print("REBUILD DIFFERS from", args.output_dir, *problems, sep="\n  ")
            return 1
        print(f"rebuild identical to {args.output_dir} (tokenizer, all tensors, steps, accuracy)")
        return 0

    cfg = BuildConfig(
        size=args.size, seed=args.seed, threads=args.threads, batch_size=args.batch_size,
        lr=args.lr, warmup_steps=args.warmup_steps, eval_every=args.eval_every,
        target_acc=args.target_acc, max_steps=args.max_steps, device=args.device,
    )
    info = build(cfg, args.output_dir, require_target=not args.allow_below_target,
                 keep_evals=args.keep_evals)
    size_mb = sum(f.stat().st_size for f in args.output_dir.iterdir()) / 2**20
    print(f"saved {args.output_dir} ({size_mb:.1f} MB): {info['steps']} steps, held-out accuracy "
          f"{info['heldout_accuracy']:.3f}, {info['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
