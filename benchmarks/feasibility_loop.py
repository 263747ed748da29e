"""The feasibility study's hand-written RL loop, run on any model of the ``arithmetic`` task.

A reference point for the trainer's embedded default that does not use gbmpo's trainer: each
step takes 8 training prompts, samples 8 completions each with transformers' ``generate``
(temperature 1, no top-k/top-p, at most 40 new tokens), uses advantage = reward - group mean (no
std scaling, no regularizer), loss = -sum A * log pi(token) / (64 * 40) (Dr. GRPO's constant
divisor), and takes one AdamW step (betas 0.9/0.99, grad-norm clip 1). Greedy held-out accuracy
on the 200 ``test`` problems every 60 s of RL (evaluation outside the budget). One torch thread.

    .venv/bin/python benchmarks/feasibility_loop.py [SEED] [LR] [SECONDS] [MODEL_DIR]

Defaults: seed 0, LR 5e-5, 180 s, the shipped tiny model.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gbmpo.models import TINY_MODEL_PATH
from gbmpo.tasks.arithmetic import ArithmeticTask, arithmetic_reward

PROMPTS, G, MAX_NEW = 8, 8, 40


def main(argv: list[str]) -> None:
    seed = int(argv[0]) if len(argv) > 0 else 0
    lr = float(argv[1]) if len(argv) > 1 else 5e-5
    budget = float(argv[2]) if len(argv) > 2 else 180.0
    path = argv[3] if len(argv) > 3 else str(TINY_MODEL_PATH)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    task = ArithmeticTask()
    test, train = task.split("test"), task.split("train")
    eos, pad = tok.eos_token_id, tok.pad_token_id

    def encode(examples: list[dict[str, Any]]) -> Any:
        return tok([e["prompt"] for e in examples], return_tensors="pt", padding=True,
                   add_special_tokens=False)

    @torch.no_grad()
    def accuracy() -> float:
        model.eval()
        texts: list[str] = []
        for i in range(0, len(test), 100):
            enc = encode(test[i:i + 100])
            out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW,
                                 eos_token_id=eos, pad_token_id=pad)
            texts += tok.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                      skip_special_tokens=True)
        model.train()
        r = arithmetic_reward(texts, [e["answer"] for e in test])
        return sum(r) / len(r)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    print(f"start acc={accuracy():.3f}", flush=True)
    spent, step, next_eval = 0.0, 0, 60.0
    while spent < budget:
        t0 = time.perf_counter()
        batch = [train[rng.randrange(len(train))] for _ in range(PROMPTS)]
        enc = encode(batch)
        ids = enc["input_ids"].repeat_interleave(G, 0)
        mask = enc["attention_mask"].repeat_interleave(G, 0)
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAX_NEW,
                                 eos_token_id=eos, pad_token_id=pad)
        model.train()
        p = ids.shape[1]
        comp = out[:, p:]
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        answers = [e["answer"] for e in batch for _ in range(G)]
        r = torch.tensor(arithmetic_reward(texts, answers)).view(PROMPTS, G)
        adv = (r - r.mean(1, keepdim=True)).view(-1)
        is_eos = comp == eos
        cmask = ((is_eos.cumsum(1) - is_eos.long()) == 0).float()  # up to and with the EOS
        keep = adv != 0  # without a regularizer, zero-advantage rows have zero gradient
        if keep.any():
            am = torch.cat([mask[keep], cmask[keep].long()], 1)
            logits = model(input_ids=out[keep], attention_mask=am).logits[:, p - 1:-1]
            lp = torch.log_softmax(logits.float(), -1).gather(
                -1, comp[keep].unsqueeze(-1)).squeeze(-1)
            loss = -(adv[keep].unsqueeze(1) * lp * cmask[keep]).sum() / (PROMPTS * G * MAX_NEW)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        step += 1
        spent += time.perf_counter() - t0
        if spent >= next_eval:
            print(f"t={spent:.0f}s step={step} reward={r.mean():.3f} acc={accuracy():.3f}",
                  flush=True)
            next_eval += 60.0
    print(f"end step={step} acc={accuracy():.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
