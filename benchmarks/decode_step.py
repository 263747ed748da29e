"""The decode steps of the own sampler side by side: the static-shape step (a CUDA graph on a
GPU), the lean decoder and the model's own forward (transformers', or peft's with LoRA).

Each case (rows, LoRA rank) decodes ``--new-tokens`` tokens per row with each decode step from
the same prompts and the same uniform numbers, in one process, the steps interleaved
repeat by repeat; an EOS that never occurs keeps every row running, so every step decodes all
rows. Per step it records the median seconds of the decode (prefill included), the tokens per
second, the milliseconds per token (per decode step of all rows) and the ratio to the lean
decoder (plain model) or to the model's own forward (LoRA: the lean decoder refuses adapters);
the static step's tokens are checked against the others' (equal, or counted when float
rounding of the logits moves a draw: bfloat16). On CUDA it also records the weights-only bound:
the bytes of the weights one decode step reads (the merged copy with LoRA) over the measured
device copy bandwidth.

    python benchmarks/decode_step.py                        # CPU: the embedded tiny model
    python benchmarks/decode_step.py --shape qwen3-1.7b --device cuda --rows 8,64 \\
        --new-tokens 256 --lora 0,64 --steps static,lean     # a GPU: Qwen3-1.7B's shape, bf16

Writes ``benchmarks/results/decode_step.json`` (``--out``) and prints a table and one summary
line last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish_result, start_result  # noqa: E402

STEPS = ("static", "lean", "model")


def build(shape: str, device: str, dtype: Any, lora: int) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the embedded tiny model (``tiny``) or a random Qwen3 of
    Qwen3-1.7B's shape built on ``device``, with LoRA of rank ``lora`` on every projection
    (random ``B``, so that the adapters change the logits) when ``lora > 0``."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from gbmpo.models import load_model_and_tokenizer, resolve_model_path

    if shape == "tiny":
        model, tok = load_model_and_tokenizer("tiny", dtype=dtype, device=device)
    else:
        from scale_rehearsal import QWEN3_1_7B

        tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_1_7B)).to(dtype)
    if lora:
        import peft

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=lora, lora_alpha=lora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
    return model.eval(), tok


def copy_bandwidth(device: str) -> float | None:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), best of 5; ``None``
    off CUDA."""
    import torch

    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def decode_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads: every parameter but the LoRA factors (merged
    into a copy of their weight's size)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "lora_" not in n)  # fmt: skip


def run_case(model: Any, tok: Any, rows: int, args: argparse.Namespace, steps: list[str],
             lora: bool) -> dict[str, Any]:  # fmt: skip
    import torch

    from gbmpo.rollout.sampling import _decode
    from gbmpo.tasks import TASKS

    device = next(model.parameters()).device
    task = TASKS.build("arithmetic")
    n_prompts = max(1, rows // args.generations)
    prompts = [ex["prompt"] for ex in task.split(task.train_split)[:n_prompts]]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    repeats = rows // n_prompts
    kw = dict(repeats=repeats, max_new_tokens=args.new_tokens, do_sample=True,
              temperature=args.temperature, top_p=args.top_p, top_k=0, eos_ids=[-1],
              pad_id=int(tok.pad_token_id))  # fmt: skip
    runnable = [s for s in steps if not (s == "lean" and lora)]  # the lean decoder refuses LoRA

    def once(step: str) -> tuple[float, Any]:
        torch.manual_seed(args.seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = _decode(model, ids, mask, lean=step != "model",
                          decode_step="static" if step == "static" else "lean", **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    first = {s: once(s) for s in runnable}  # warm-up (the static step captures its graph here)
    times: dict[str, list[float]] = {s: [] for s in runnable}
    for _ in range(args.reps):
        for s in runnable:
            times[s].append(once(s)[0])
    tokens = rows * args.new_tokens
    case: dict[str, Any] = {"rows": rows, "prompts": n_prompts, "lora": args.lora_rank if lora
                            else 0, "prompt_width": int(ids.shape[1]), "steps": {}}  # fmt: skip
    for s in runnable:
        sec = statistics.median(times[s])
        case["steps"][s] = {"seconds_median": sec, "seconds_first": first[s][0],
                            "tokens_per_second": tokens / sec,
                            "ms_per_token": 1e3 * sec / args.new_tokens}  # fmt: skip
    if "static" in runnable:
        from gbmpo.rollout import StaticDecoder

        decoder = StaticDecoder.for_model(model)
        case["static_cuda_graphs"] = None if decoder is None else decoder.graphs
    base = "model" if lora else "lean"
    if "static" in runnable and base in runnable:
        case["static_speedup"] = (case["steps"][base]["seconds_median"]
                                  / case["steps"]["static"]["seconds_median"])  # fmt: skip
        a, b = first["static"][1], first[base][1]
        case["static_vs_" + base + "_tokens_differing"] = int((a != b).sum())
    return case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["tiny", "qwen3-1.7b"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--rows", default="8,64", help="comma-separated rows per decode")
    ap.add_argument("--generations", type=int, default=8, help="rows per prompt")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--lora", default="0,8", help="comma-separated LoRA ranks (0: none)")
    ap.add_argument("--steps", default="static,lean,model")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}; valid: {', '.join(STEPS)}")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    result = start_result("decode_step")
    result.update(shape=args.shape, device=args.device, dtype=str(dtype).removeprefix("torch."),
                  new_tokens=args.new_tokens, reps=args.reps, cases=[])  # fmt: skip
    bandwidth = copy_bandwidth(args.device)
    result["copy_bandwidth_bytes_per_second"] = bandwidth
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for rank in (int(r) for r in args.lora.split(",")):
        args.lora_rank = rank
        model, tok = build(args.shape, args.device, dtype, rank)
        weights = decode_bytes(model)
        for rows in (int(r) for r in args.rows.split(",")):
            case = run_case(model, tok, rows, args, steps, lora=rank > 0)
            case["weight_bytes"] = weights
            if bandwidth:
                bound = weights / bandwidth
                case["weights_only_ms_per_token"] = 1e3 * bound
                case["weights_only_tokens_per_second"] = rows / bound
            result["cases"].append(case)
        del model
    path = finish_result(result, args.out)
    print("| rows | LoRA | step | ms/token | tokens/s | vs weights-only bound |")
    print("|---|---|---|---|---|---|")
    for c in result["cases"]:
        for s, r in c["steps"].items():
            bound = c.get("weights_only_ms_per_token")
            frac = f"{bound / r['ms_per_token']:.1%}" if bound else "-"
            print(f"| {c['rows']} | {c['lora']} | {s} | {r['ms_per_token']:.3g} | "
                  f"{r['tokens_per_second']:.4g} | {frac} |")
    ratios = ", ".join(f"{c['rows']} rows LoRA {c['lora']}: x{c['static_speedup']:.2f}"
                       for c in result["cases"] if "static_speedup" in c)  # fmt: skip
    print(f"decode_step ({args.shape}, {args.device}): static step speed-up over the lean "
          f"decoder (LoRA: the model's forward) {ratios or 'n/a'}; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
