"""Drift from the reference (gbmpo.eval.drift): exact full-vocabulary divergences along the
policy's samples, checked against a brute-force computation on a 12-token vocabulary."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import transformers

from gbmpo.eval.drift import DRIFT_KEYS, drift_rows, measure_drift
from gbmpo.rollout import sampling
from gbmpo.tasks.base import Example, Task

F64 = torch.float64
VOCAB = 12  # ids: 0 pad, 1 eos, 2..11 the digits 0..9
PAD, EOS = 0, 1


class DigitTokenizer:
    """A character tokenizer over the ten digits (the interface ``generate`` uses)."""

    pad_token_id = PAD
    eos_token_id = EOS
    padding_side = "right"

    def __call__(self, texts: list[str], return_tensors: str = "pt",
                 padding: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
        rows = [[2 + int(c) for c in t] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(width - len(r), width) if self.padding_side == "left" else slice(0, len(r))
            ids[i, sl] = torch.tensor(r)
            mask[i, sl] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def batch_decode(self, rows: Sequence[torch.Tensor], skip_special_tokens: bool = True
                     ) -> list[str]:  # fmt: skip
        return ["".join(str(int(t) - 2) for t in r if int(t) >= 2) for r in rows]


class DigitTask(Task):
    name = "digits"
    kind = "math"

    def split(self, name: str) -> list[Example]:
        if name != "test":
            raise ValueError(name)
        return [{"prompt": p, "answer": "0"} for p in ("3", "41", "592", "6", "77", "8", "90")]

    def reward(self, prompts: Sequence[str], completions: Sequence[str],
               **columns: Any) -> list[float | None]:  # fmt: skip
        return [0.0 for _ in completions]


def tiny_qwen3(seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   intermediate_size=24, max_position_embeddings=64,
                                   tie_word_embeddings=False, eos_token_id=EOS,
                                   pad_token_id=PAD)  # fmt: skip
    model = transformers.Qwen3ForCausalLM(cfg).to(F64)
    with torch.no_grad():  # sharper distributions than the default init
        model.lm_head.weight.normal_(0.0, 1.0)
    return model.eval()


def perturbed(model: Any, scale: float, seed: int) -> Any:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out


def brute_force(policy: Any, reference: Any, rollouts: list[Any]) -> dict[str, float]:
    """Every per-token value from its definition, one sequence and one vocabulary entry at a
    time, with each model's plain transformers forward on the unpadded sequence."""
    sums = dict.fromkeys(("kl", "kl_reverse", "prob_l2", "tv", "entropy"), 0.0)
    n_tokens = n_prompts = 0
    for ro in rollouts:
        for i in range(len(ro)):
            n_prompts += 1
            prompt = ro.prompt_ids[i][ro.prompt_mask[i].bool()]
            length = int(ro.completion_mask[i].sum())
            completion = ro.completion_ids[i][:length]
            ids = torch.cat([prompt, completion]).unsqueeze(0)
            with torch.no_grad():
                lp = torch.log_softmax(policy(input_ids=ids).logits[0].double(), -1)
                lq = torch.log_softmax(reference(input_ids=ids).logits[0].double(), -1)
            for t in range(length):
                row = len(prompt) - 1 + t
                p = [math.exp(float(v)) for v in lp[row]]
                q = [math.exp(float(v)) for v in lq[row]]
                sums["kl"] += sum(pv * math.log(pv / qv) for pv, qv in zip(p, q, strict=True))
                sums["kl_reverse"] += sum(qv * math.log(qv / pv)
                                          for pv, qv in zip(p, q, strict=True))  # fmt: skip
                sums["prob_l2"] += sum((pv - qv) ** 2 for pv, qv in zip(p, q, strict=True))
                sums["tv"] += 0.5 * sum(abs(pv - qv) for pv, qv in zip(p, q, strict=True))
                sums["entropy"] -= sum(pv * math.log(pv) for pv in p)
                n_tokens += 1
    out: dict[str, float] = {k: v / n_tokens for k, v in sums.items()}
    out.update(response_length=n_tokens / n_prompts, n_prompts=n_prompts, n_tokens=n_tokens)
    return out


def spy_generate(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    real = sampling.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        ro = real(*args, **kwargs)
        seen.append(ro)
        return ro

    monkeypatch.setattr(sampling, "generate", spy)
    return seen


@pytest.mark.parametrize("lean", [True, False])
def test_measure_drift_equals_brute_force(monkeypatch: pytest.MonkeyPatch, lean: bool) -> None:
    reference = tiny_qwen3(0)
    policy = perturbed(reference, 0.3, seed=1)
    seen = spy_generate(monkeypatch)
    got = measure_drift(policy, reference, DigitTokenizer(), DigitTask(), max_new_tokens=6,
                        batch_size=3, seed=5, chunk_size=4, lean=lean)  # fmt: skip
    assert tuple(got) == DRIFT_KEYS
    assert len(seen) == 3  # 7 prompts, 3 per generate call
    want = brute_force(policy, reference, seen)
    assert got["n_prompts"] == want["n_prompts"] == 7
    assert got["n_tokens"] == want["n_tokens"] > 7
    for key in DRIFT_KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    assert got["kl"] > 0.01 and got["kl_reverse"] > 0.01 and 0 < got["tv"] < 1
    # sampled at temperature 1 with the seed: the same call gives the same numbers
    assert measure_drift(policy, reference, DigitTokenizer(), DigitTask(), max_new_tokens=6,
                         batch_size=3, seed=5, chunk_size=4, lean=lean) == got  # fmt: skip


def test_no_drift_from_itself_and_limit() -> None:
    model = tiny_qwen3(0)
    got = measure_drift(model, copy.deepcopy(model), DigitTokenizer(), DigitTask(), limit=2,
                        max_new_tokens=5, seed=0)  # fmt: skip
    assert got["n_prompts"] == 2
    for key in ("kl", "kl_reverse", "prob_l2", "tv"):
        assert got[key] == pytest.approx(0.0, abs=1e-12)
    assert got["entropy"] > 0.1


def test_lora_reference_is_the_policy_with_adapters_disabled() -> None:
    peft = pytest.importorskip("peft")
    base = tiny_qwen3(0)
    frozen = copy.deepcopy(base)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    policy = peft.get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    kw: dict[str, Any] = {"max_new_tokens": 5, "seed": 3, "batch_size": 4}
    off = measure_drift(policy, None, DigitTokenizer(), DigitTask(), **kw)
    explicit = measure_drift(policy, frozen, DigitTokenizer(), DigitTask(), **kw)
    assert off["kl"] > 1e-4
    for key in DRIFT_KEYS:
        assert off[key] == pytest.approx(explicit[key], rel=1e-9, abs=1e-12), key


def test_modes_are_restored_and_bad_inputs_refused() -> None:
    policy, reference = tiny_qwen3(0), tiny_qwen3(1)
    policy.train()
    measure_drift(policy, reference, DigitTokenizer(), DigitTask(), limit=1, max_new_tokens=2)
    assert policy.training and not reference.training
    with pytest.raises(ValueError, match="no adapters"):
        measure_drift(policy, None, DigitTokenizer(), DigitTask(), limit=1)
    other = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB + 1, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=24))  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary"):
        measure_drift(policy, other, DigitTokenizer(), DigitTask(), limit=1)
    with pytest.raises(ValueError, match="limit"):
        measure_drift(policy, reference, DigitTokenizer(), DigitTask(), limit=0)


def test_drift_rows_definitions() -> None:
    g = torch.Generator().manual_seed(0)
    x = 2.0 * torch.randn(5, VOCAB, generator=g, dtype=F64)
    y = 2.0 * torch.randn(5, VOCAB, generator=g, dtype=F64)
    x[0, 3] = float("-inf")  # a token the policy never emits: 0 log 0 = 0 everywhere
    got = drift_rows(x, y)
    p, q = torch.softmax(x, -1), torch.softmax(y, -1)
    lp, lq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    safe = torch.where(p > 0, p * (lp - lq), torch.zeros((), dtype=F64))
    torch.testing.assert_close(got["kl"], safe.sum(-1))
    torch.testing.assert_close(got["kl_reverse"][1:], (q * (lq - lp)).sum(-1)[1:])
    assert got["kl_reverse"][0] > 100  # q has mass where p has none: large and finite
    torch.testing.assert_close(got["prob_l2"], ((p - q) ** 2).sum(-1))
    torch.testing.assert_close(got["tv"], 0.5 * (p - q).abs().sum(-1))
    ent = -torch.where(p > 0, p * lp, torch.zeros((), dtype=F64)).sum(-1)
    torch.testing.assert_close(got["entropy"], ent)
    assert all(v.dtype == F64 and torch.isfinite(v).all() for v in got.values())
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        drift_rows(x[None], y[None])


def test_gbmpo_eval_reference_writes_drift(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import json

    import gbmpo.eval.evaluation as ev
    import gbmpo.models
    from gbmpo.cli import main

    models = {"policy": perturbed(tiny_qwen3(0), 0.3, seed=1), "ref": tiny_qwen3(0)}
    loaded: list[Any] = []

    def load(model_id: Any, **kw: Any) -> tuple[Any, Any]:
        loaded.append(model_id)
        if model_id == "other":
            m = tiny_qwen3(0)
            m.resize_token_embeddings(VOCAB + 2)
            return m, DigitTokenizer()
        return copy.deepcopy(models[model_id]), DigitTokenizer()

    monkeypatch.setattr(gbmpo.models, "load_model_and_tokenizer", load)
    monkeypatch.setattr(ev, "resolve_task", lambda *a, **k: DigitTask())
    out = tmp_path / "e.jsonl"
    argv = ["eval", "--model", "policy", "--reference", "ref", "--task", "digits",
            "--max-new-tokens", "6", "--batch-size", "3", "--seed", "5", "--output", str(out)]
    assert main(argv) == 0
    assert loaded == ["policy", "ref"]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["config"]["reference"] == "ref"
    want = measure_drift(models["policy"], models["ref"], DigitTokenizer(), DigitTask(),
                         max_new_tokens=6, batch_size=3, seed=5)  # fmt: skip
    assert summary["drift"] == pytest.approx(want)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("drift from ref: KL ") and "7 prompts" in last
    # a reference over another vocabulary: exit 2, one line, nothing written
    out2 = tmp_path / "f.jsonl"
    assert main([*argv[:4], "other", *argv[5:-1], str(out2)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocabulary" in err[0] and not out2.exists()


# ------------------------------------------------------------- summary.json at the end of a run


def varied_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Any
                  ) -> list[float]:  # fmt: skip
    """Rewards with spread inside every group, so that one step moves the policy."""
    return [float(sum(map(ord, c)) % 3) / 2 for c in completions]


def _run_config(out: Any, **extra: str) -> Any:
    from gbmpo.train import load_config

    overrides = {
        "rollout.prompts_per_step": "2", "rollout.num_generations": "4",
        "rollout.max_new_tokens": "8", "rollout.temperature": "3.0", "eval.before": "false",
        "eval.every": "0", "eval.limit": "3", "eval.max_new_tokens": "8",
        "run.time_budget_seconds": "null", "run.progress": "false", "run.steps": "1",
        "optim.lr": "1e-2", "optim.mini_batch_size": "null", "run.output_dir": str(out), **extra,
    }  # fmt: skip
    return load_config(None, list(overrides.items()))


@pytest.mark.parametrize(
    ("held", "extra"),
    [("frozen copy", {}),
     ("reloaded", {"objective.regularizer.name": "none",
                   "objective.monitor_regularizers": "false"}),
     ("copied at start", {"objective.regularizer.name": "none",
                          "objective.monitor_regularizers": "false"})],
)  # fmt: skip
def test_summary_drift_of_a_training_run(tmp_path: Any, held: str, extra: dict[str, str]) -> None:
    import json

    from gbmpo.models import load_model_and_tokenizer
    from gbmpo.train import Trainer

    try:
        initial, tokenizer = load_model_and_tokenizer(None)
    except FileNotFoundError as exc:
        pytest.skip(f"embedded tiny model not built: {exc}")
    cfg = _run_config(tmp_path / "run", **extra)
    if held == "copied at start":  # a model object: its initial weights cannot be reloaded
        given = copy.deepcopy(initial)
        with torch.no_grad():
            for p in given.parameters():
                p.add_(0.01)  # so that reloading model.path would give another reference
        trainer = Trainer(cfg, model=given, tokenizer=tokenizer, reward_fn=varied_reward)
        assert trainer.ref_model is None and trainer.initial_model is not None
        start = copy.deepcopy(given)
    else:
        trainer = Trainer(cfg, reward_fn=varied_reward)
        assert (trainer.ref_model is None) == (held == "reloaded")
        assert trainer.initial_model is None
        start = initial
    trainer.train()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    drift = summary["drift"]
    assert tuple(drift) == DRIFT_KEYS and drift["n_prompts"] == 3
    assert summary["drift_seconds"] > 0
    final, _ = load_model_and_tokenizer(str(tmp_path / "run" / "model"))
    want = measure_drift(final, start, tokenizer, "arithmetic", limit=3, max_new_tokens=8,
                         batch_size=cfg.eval.batch_size, seed=cfg.run.seed)  # fmt: skip
    assert drift == pytest.approx(want, rel=1e-5, abs=1e-9)
    assert drift["kl"] > 1e-6


def test_summary_drift_off(tmp_path: Any) -> None:
    import json

    from gbmpo.train import Trainer

    try:
        trainer = Trainer(_run_config(tmp_path / "a", **{"eval.drift": "false"}))
    except FileNotFoundError as exc:
        pytest.skip(f"embedded tiny model not built: {exc}")
    trainer.train()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["drift"] is None and summary["drift_seconds"] is None
    # without the final evaluation there is no drift either (and no reference is kept for it)
    Trainer(_run_config(tmp_path / "b", **{"eval.after": "false"})).train()
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["drift"] is None


def test_trl_summary_drift_is_the_same_measurement(tmp_path: Any) -> None:
    """The TRL engine writes summary.json drift with the own engine's function: the saved final
    model measured against the initial weights reloaded from model.path."""
    import json

    pytest.importorskip("trl")
    from gbmpo.cli import main
    from gbmpo.models import load_model_and_tokenizer

    try:
        initial, tokenizer = load_model_and_tokenizer(None)
    except FileNotFoundError as exc:
        pytest.skip(f"embedded tiny model not built: {exc}")
    out = tmp_path / "trl"
    argv = ["train", "--engine", "trl", "--steps", "1", "--time-budget", "null",
            "--rollout.prompts_per_step", "2", "--num-generations", "4", "--max-new-tokens", "8",
            "--optim.mini_batch_size", "8", "--eval.before", "false", "--eval.limit", "3",
            "--eval.max_new_tokens", "8", "--run.progress", "false", "--run.checkpoint_every",
            "0", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    final, _ = load_model_and_tokenizer(str(out / "model"))
    want = measure_drift(final, initial, tokenizer, "arithmetic", limit=3, max_new_tokens=8,
                         batch_size=100, seed=0)  # fmt: skip
    assert summary["drift"] == pytest.approx(want, rel=1e-5, abs=1e-9)
    assert summary["drift_seconds"] > 0
