"""Scale rehearsal: a randomly initialised model of Qwen3-1.7B's shape, 3 RL steps on the own
engine and on ``--engine trl``, on the device: throughput, peak memory against the dry run's
memory plan, and MFU. No download: the architecture is written below, the tokenizer is the
embedded model's (its ids index the first rows of the 151,936-row embedding; generated ids past
its vocabulary decode to nothing, which only lowers the reward of a random model).

    python benchmarks/scale_rehearsal.py                   # Qwen3-1.7B's shape, on cuda
    python benchmarks/scale_rehearsal.py --size tiny       # a tiny shape on CPU (the test suite)

The setting (``--size full``): 8 prompts x 8 completions, 256 new tokens, bf16 weights with
fp32 master weights (own engine; TRL: fp32 weights under bf16 autocast), the frozen reference on
the device (KL k3 anchored to it), micro-batches of 8 sequences. Per engine it records:

* ``generation_tokens_per_second``: completion tokens / generation seconds (own engine:
  ``time/generate_seconds``; TRL does not report its generation time: ``null``);
* ``training_tokens_per_second``: (prompt + completion) tokens / update seconds (own engine:
  ``time/update_seconds`` + ``time/logprob_seconds``; TRL: the RL step's seconds, generation
  included);
* ``peak_memory_gib`` (``summary.json``, CUDA only; on CPU ``null`` and the process's peak RSS
  instead) against ``plan_peak_gib`` (:func:`gbmpo.train.memory.memory_plan`);
* ``mfu``: model FLOPs per second (6 N per trained token, 2 N per token of each extra forward
  and each generated token; N the parameters) over the device's dense bf16 peak
  (:data:`PEAK_FLOPS`, by device name; ``null`` on CPU and unknown devices).

Steps 2 and 3 are averaged (step 1 pays for warm-up). Writes
``benchmarks/results/scale_rehearsal.json`` (``--out``) and prints one summary line last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish_result, measure, start_result  # noqa: E402

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

SETTINGS = {
    "full": {"prompts": 8, "generations": 8, "new_tokens": 256, "micro": 8, "dtype": "bfloat16"},
    "tiny": {"prompts": 2, "generations": 4, "new_tokens": 8, "micro": 4, "dtype": "bfloat16"},
}


def build_model(directory: Path, size: str, device: str = "cpu") -> Any:
    """Save a randomly initialised Qwen3 of the size's shape and the embedded tokenizer (the
    initialisation runs on ``device``: seconds on a GPU for 1.7B parameters, not a minute)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from gbmpo.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    shape = dict(QWEN3_1_7B if size == "full" else {**TINY, "vocab_size": len(tokenizer)})
    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return config, n


#: ``--decoder``: the own engine's sampler (config overrides); ``auto``: the config's default
DECODERS = {"auto": [], "static": [("rollout.decode_step", "static")],
            "lean": [("rollout.decode_step", "lean")], "hf": [("rollout.generator", "hf")]}


def engine_config(model_dir: Path, out: Path, engine: str, size: str, device: str,
                  decoder: str = "auto") -> Any:  # fmt: skip
    from gbmpo.config import load_config

    s = SETTINGS[size]
    return load_config(overrides=DECODERS[decoder] + [
        ("engine", engine), ("model.path", str(model_dir)), ("model.device", device),
        ("model.dtype", s["dtype"]), ("task.name", "arithmetic"),
        ("rollout.prompts_per_step", str(s["prompts"])),
        ("rollout.num_generations", str(s["generations"])),
        ("rollout.max_new_tokens", str(s["new_tokens"])),
        ("optim.mini_batch_size", "null"), ("optim.micro_batch_size", str(s["micro"])),
        ("objective.regularizer.name", "kl_k3"), ("objective.regularizer.anchor", "ref"),
        ("eval.before", "false"), ("eval.after", "false"), ("eval.every", "0"),
        ("eval.drift", "false"), ("run.steps", "3"), ("run.time_budget_seconds", "null"),
        ("run.checkpoint_every", "0"), ("run.progress", "false"), ("run.output_dir", str(out)),
    ])  # fmt: skip


def peak_flops(device: str) -> float | None:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def run_engine(engine: str, cfg: Any, n_params: int, model_config: Any) -> dict[str, Any]:
    import torch

    from gbmpo.lifecycle.logging import read_metrics
    from gbmpo.train.device import device_memory_bytes
    from gbmpo.train.memory import memory_plan

    device = cfg.model.device
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with measure() as m:
        from gbmpo import engines

        summary = engines.run(cfg)
    rows = [r for r in read_metrics(cfg.run.output_dir) if "loss" in r]
    timed = rows[1:] or rows  # step 1 pays for warm-up
    ro = cfg.rollout
    completions = ro.prompts_per_step * ro.num_generations
    gen_tokens = sum(r["response_length_mean"] * completions for r in timed)
    prompt_tokens = 0
    from gbmpo.train.setup import build_task, load_splits, load_tokenizer

    task = build_task(cfg, load_tokenizer(cfg))
    train, _, _ = load_splits(cfg, task)
    tok = load_tokenizer(cfg)
    longest = max(len(tok(ex["prompt"])["input_ids"]) for ex in train[:1000])
    prompt_tokens = longest * completions * len(timed)
    train_tokens = gen_tokens + prompt_tokens
    if engine == "gbmpo":
        gen_s = sum(r["time/generate_seconds"] for r in timed)
        upd_s = sum(r["time/update_seconds"] + r["time/logprob_seconds"] for r in timed)
    else:
        gen_s, upd_s = None, sum(r["step_seconds"] for r in timed)
    step_s = sum(r["step_seconds"] for r in timed)
    # 6 N per trained token (forward + backward), 2 N for the reference's and the old policy's
    # forwards (the ref; old log-probs come from the same forward when mu = 1), 2 N per
    # generated token
    flops = n_params * (6 * train_tokens + 2 * train_tokens + 2 * gen_tokens)
    peak = peak_flops(device)
    plan = memory_plan(cfg, model_config, longest, needs_ref=True,
                       device_bytes=device_memory_bytes(device) if device != "cpu" else None)
    return {
        "steps_timed": len(timed),
        "step_seconds_mean": step_s / len(timed),
        "generation_tokens_per_second": gen_tokens / gen_s if gen_s else None,
        "training_tokens_per_second": train_tokens / upd_s if upd_s else None,
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "process_peak_rss_extra_gb": m.record()["extra_peak_gb"],
        "plan_peak_gib": plan["peak"] / 2**30,
        "plan": {k: v for k, v in plan.items() if k != "notes"},
        "model_flops_per_second": flops / step_s,
        "mfu": flops / step_s / peak if peak else None,
        "wall_seconds": m.seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--device", default=None, help="default: cuda for full, cpu for tiny")
    ap.add_argument("--engines", default="gbmpo,trl")
    ap.add_argument("--decoder", choices=sorted(DECODERS), default="auto",
                    help="the own engine's decode step (auto: static on CUDA, lean on CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if args.size == "full" else "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("scale_rehearsal: no CUDA device here; --size tiny runs on CPU",
                  file=sys.stderr)  # fmt: skip
            return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    result = start_result("scale_rehearsal")
    result.update(size=args.size, device=device, setting=SETTINGS[args.size], engines={},
                  decoder=args.decoder)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_config, n = build_model(model_dir, args.size, device)
        result["parameters"] = n
        for engine in args.engines.split(","):
            cfg = engine_config(model_dir, Path(tmp) / engine, engine, args.size, device,
                                args.decoder)  # fmt: skip
            result["engines"][engine] = run_engine(engine, cfg, n, model_config)
    path = finish_result(result, args.out)
    parts = []
    for engine, r in result["engines"].items():
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = ("n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}")
        parts.append(f"{engine}: {r['step_seconds_mean']:.2f} s/step, peak {mem} GiB "
                     f"(plan {r['plan_peak_gib']:.3g}), MFU {mfu}")  # fmt: skip
    print(f"scale_rehearsal ({args.size}, {device}, {n / 1e6:.1f}M parameters): "
          + "; ".join(parts) + f" -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
