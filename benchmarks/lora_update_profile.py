"""Where the own engine's LoRA update spends its time: one RL step of the GBMPO paper config
(LoRA r 64 on all seven projections, dropout 0.1, micro-batches of 2 rows) under
``torch.profiler``, on a random Qwen3 with Qwen3-1.7B's layer count (28) and a narrow width,
so that per-op overhead, what bounds small kernels on a GPU, is what the CPU measures too.

Per phase (the scale rehearsal's: ``old policy``, ``reference``, ``policy fwd+bwd``,
``optimizer``) it records the seconds, the number of ATen ops (on CUDA, each is about one kernel
launch), and splits ``policy fwd+bwd`` into forward and backward (the autograd engine's
functions) and by kind: dropout, LoRA factor products, dtype casts, other matmuls. It also says
whether gradient checkpointing is on and whether an input-grad hook was added.

    python benchmarks/lora_update_profile.py                      # the paper setting
    python benchmarks/lora_update_profile.py --lora-dropout 0.0   # dropout off
    python benchmarks/lora_update_profile.py --no-lora            # full fine-tuning
    python benchmarks/lora_update_profile.py --micro-batch null   # one micro-batch of 8 rows

Prints the table and one summary line; writes ``--out`` (JSON) when given. CPU figures: they say
how many ops a phase launches and their share of host time, not a GPU's seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: narrow, 28 layers deep: Qwen3-1.7B's depth and layer structure (GQA 2:1, q/k norms, tied head)
SHAPE = dict(hidden_size=128, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=384, tie_word_embeddings=True,
             max_position_embeddings=1024)  # fmt: skip

#: op kinds in the policy pass (first match wins; names of ATen ops)
KINDS = (("dropout", ("dropout", "bernoulli")),
         ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
         ("attention", ("attention",)),
         ("cast", ("aten::to", "aten::_to_copy", "aten::copy_")),
         ("view", ("view", "aten::t", "aten::transpose", "aten::reshape", "aten::expand",
                   "aten::as_strided", "aten::unsqueeze", "aten::slice", "aten::select")),
         ("elementwise", ("aten::mul", "aten::add", "aten::div", "aten::sub")))  # fmt: skip


def build(directory: Path, lora: bool, dropout: float, new_tokens: int,
          micro: str | None = None, layers: int = 28) -> Any:  # fmt: skip
    """A Trainer of the paper config on a random model of :data:`SHAPE`, on the CPU."""
    import torch
    from scale_rehearsal import PAPER_CONFIG
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from gbmpo.config import load_config
    from gbmpo.models import resolve_model_path
    from gbmpo.train import Trainer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    config = Qwen3Config(**{**SHAPE, "num_hidden_layers": layers}, vocab_size=len(tok),
                         bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    tok.save_pretrained(directory)
    cfg = load_config(PAPER_CONFIG, overrides=[
        ("engine", "gbmpo"), ("model.path", str(directory)), ("model.device", "cpu"),
        ("task.name", "arithmetic"), ("rollout.max_new_tokens", str(new_tokens)),
        ("lora.enabled", str(lora).lower()), ("lora.dropout", str(dropout)),
        ("eval.before", "false"), ("eval.after", "false"), ("eval.every", "0"),
        ("eval.drift", "false"), ("run.checkpoint_every", "0"), ("run.progress", "false"),
        ("run.output_dir", str(directory / "run")), ("run.num_threads", "1"),
        *([("optim.micro_batch_size", micro)] if micro else []),
    ])  # fmt: skip
    return Trainer(cfg)


def _kind(name: str) -> str:
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def _analyse(events: list[Any], seconds: float, policy: bool) -> dict[str, Any]:
    """Dispatched ATen ops (those not called by another ATen op: what Python and the autograd
    engine call; on CUDA about one launch each, views aside) of one phase's profile, their
    count and CPU time (children included); for the policy pass, forward against backward
    (ops run by the autograd engine's functions) and by kind."""
    ops = [e for e in events if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    row: dict[str, Any] = {"seconds_profiled": seconds, "ops": len(ops),
                           "op_ms": sum(o.cpu_time_total for o in ops) / 1e3}
    if not policy:
        return row

    def side(op: Any) -> str:
        parent = op.cpu_parent
        while parent is not None:
            if parent.name.startswith("autograd::engine::evaluate_function"):
                return "backward"
            parent = parent.cpu_parent
        return "forward"

    split: dict[str, Counter] = defaultdict(Counter)
    top: Counter = Counter()
    calls: Counter = Counter()
    for op in ops:
        where = side(op)
        for key in (where, f"{where} {_kind(op.name)}"):
            split[key]["ops"] += 1
            split[key]["us"] += op.cpu_time_total
        top[op.name] += op.cpu_time_total
        calls[op.name] += 1
    row["split"] = {k: {"ops": v["ops"], "ms": v["us"] / 1e3} for k, v in split.items()}
    row["top_ops"] = [{"op": n, "ms": us / 1e3, "calls": calls[n]}
                      for n, us in top.most_common(14)]  # fmt: skip
    return row


#: the phases profiled (the rollout's are not: their events would fill the memory)
PROFILED = ("old policy", "reference", "policy fwd+bwd", "optimizer")


def profile_step(tr: Any) -> dict[str, Any]:
    """One phased step (the scale rehearsal's), the update's phases each under the profiler
    (every micro-batch's forward and backward together)."""
    import scale_rehearsal
    from torch.profiler import ProfilerActivity, profile

    timed = scale_rehearsal._timed
    events: dict[str, list[Any]] = defaultdict(list)

    @contextlib.contextmanager
    def profiled(times: dict[str, float], name: str, device: str) -> Any:
        if name not in PROFILED:
            with timed(times, name, device):
                yield
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof, timed(times, name, device):
            yield
        events[name].extend(prof.events())

    scale_rehearsal._timed = profiled
    try:
        times, batch = scale_rehearsal.phased_step(tr)
    finally:
        scale_rehearsal._timed = timed
    phases = {name: _analyse(events[name], times[name], name == "policy fwd+bwd")
              for name in PROFILED if name in events}  # fmt: skip
    return {"phases": phases, "micro_batches": -(-len(batch) // tr.micro_batch)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--lora-dropout", type=float, default=0.1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", default=None,
                    help="optim.micro_batch_size (default: the paper config's, 2; 'null': the "
                         "whole batch of 8 on the CPU)")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                    help="decoder layers (default: Qwen3-1.7B's 28)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tr = build(Path(tmp), not args.no_lora, args.lora_dropout, args.new_tokens,
                   args.micro_batch, args.layers)
        model = tr.model
        checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
        embed = model.get_input_embeddings()
        hooks = len(getattr(embed, "_forward_hooks", {}))
        import scale_rehearsal

        scale_rehearsal.phased_step(tr)  # warm-up
        plain, _ = scale_rehearsal.phased_step(tr)  # timed without the profiler
        t0 = time.perf_counter()
        result = profile_step(tr)
        for name, row in result["phases"].items():
            row["seconds"] = plain[name]
        result.update(wall_seconds=time.perf_counter() - t0, lora=not args.no_lora,
                      lora_dropout=args.lora_dropout, new_tokens=args.new_tokens,
                      micro_batch=tr.micro_batch, layers=args.layers, shape=SHAPE,
                      gradient_checkpointing=checkpointing, embedding_forward_hooks=hooks,
                      torch=torch.__version__)  # fmt: skip
    print("| phase | s | s profiled | ATen ops | op ms |")
    print("|---|---|---|---|---|")
    for name, p in result["phases"].items():
        print(f"| {name} | {p['seconds']:.3f} | {p['seconds_profiled']:.3f} | {p['ops']} | "
              f"{p['op_ms']:.0f} |")
    pol = result["phases"]["policy fwd+bwd"]
    print("\n| policy fwd+bwd part | ATen ops | op ms |\n|---|---|---|")
    for k, v in sorted(pol["split"].items()):
        print(f"| {k} | {v['ops']} | {v['ms']:.0f} |")
    print("\n| op | ms | calls |\n|---|---|---|")
    for t in pol["top_ops"]:
        print(f"| {t['op']} | {t['ms']:.0f} | {t['calls']} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    old = result["phases"]["old policy"]
    print(f"lora_update_profile (lora {'off' if args.no_lora else 'r 64'}, dropout "
          f"{args.lora_dropout}, checkpointing {checkpointing}, embedding hooks {hooks}): "
          f"policy fwd+bwd {pol['ops']} ops in {pol['seconds']:.2f} s over "
          f"{result['micro_batches']} micro-batches; old policy {old['ops']} ops in "
          f"{old['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
