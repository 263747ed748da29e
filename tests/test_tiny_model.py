"""The embedded tiny Qwen3 model: loads, generates, tokenizes as documented, is reproducible."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from gbmpo.models import TINY_MODEL_PATH, load_model_and_tokenizer, resolve_model_path
from gbmpo.tasks.arithmetic import ArithmeticTask, arithmetic_reward

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def builder() -> ModuleType:
    """``scripts/build_tiny_model.py`` imported as a module."""
    path = REPO / "scripts" / "build_tiny_model.py"
    spec = importlib.util.spec_from_file_location("build_tiny_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def info() -> dict[str, Any]:
    return json.loads((TINY_MODEL_PATH / "build_info.json").read_text())


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return load_model_and_tokenizer()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as in the build (and much faster on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_asset_is_complete_and_small() -> None:
    names = {p.name for p in TINY_MODEL_PATH.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json", "build_info.json"} <= names
    assert sum(p.stat().st_size for p in TINY_MODEL_PATH.iterdir()) < 20 * 2**20


def test_build_info_records_the_build(info: dict[str, Any], builder: ModuleType) -> None:
    cfg = info["config"]
    # the script's defaults are the shipped build's settings (a plain run reproduces the asset)
    defaults = builder.BuildConfig()
    assert cfg["size"] == defaults.size == "2M" and cfg["threads"] == defaults.threads == 1
    assert cfg["seed"] == defaults.seed and cfg["eval_every"] == defaults.eval_every
    assert info["heldout_accuracy"] >= cfg["target_acc"] == 0.45
    assert info["heldout_problems"] == 200
    assert info["steps"] == info["evals"][-1]["step"] and info["steps"] % cfg["eval_every"] == 0
    assert all(e["heldout_accuracy"] < cfg["target_acc"] for e in info["evals"][:-1])
    assert info["wall_seconds"] > 0
    assert info["command"].startswith("python scripts/build_tiny_model.py")
    assert info["torch"] and info["transformers"]


def test_tiny_model_architecture(tiny: tuple[Any, Any], info: dict[str, Any]) -> None:
    from transformers import Qwen3ForCausalLM

    model, tok = tiny
    assert isinstance(model, Qwen3ForCausalLM) and not model.training
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.max_position_embeddings) == (192, 4, 4, 2, 48, 576,
                                                                            512)
    assert c.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == info["num_parameters"] == 1_857_408  # "1.86M" (documented as ~1.9M)
    assert c.vocab_size == len(tok) == info["vocab_size"] == 447
    assert (c.eos_token_id, c.pad_token_id) == (2, 0)


def test_tiny_alias_and_dtype() -> None:
    assert resolve_model_path("tiny") == resolve_model_path(None) == str(TINY_MODEL_PATH)
    model, _ = load_model_and_tokenizer("tiny", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_tokenizer_round_trip_and_digits(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    assert tok.padding_side == "left"
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == (
        "<|endoftext|>", 0, "<|im_end|>", 2)
    assert tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2, 3, 4]
    examples = ArithmeticTask(num_train=1).split("test")
    for ex in examples:
        text = ex["prompt"] + ex["solution"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        pieces = [tok.decode([i]) for i in ids]
        digits_in_pieces = "".join(c for p in pieces for c in p if c.isdigit())
        assert digits_in_pieces == "".join(c for c in text if c.isdigit())
        assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))
    for d in "0123456789":
        assert len(tok(d, add_special_tokens=False)["input_ids"]) == 1
    assert len(tok("1234567890", add_special_tokens=False)["input_ids"]) == 10
    # bytes outside the training corpus still round-trip (byte-level alphabet)
    odd = "Zoë ⅞ 🙂 \t{x}"
    assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_heldout_accuracy_matches_build_info(
    tiny: tuple[Any, Any], info: dict[str, Any], builder: ModuleType
) -> None:
    model, tok = tiny
    heldout = ArithmeticTask(num_train=1).split("test")
    acc = builder.greedy_accuracy(model, tok, heldout, max_new_tokens=40, batch_size=100)
    # same function, batches and threads as the build: equal up to rare float ties
    assert abs(acc - info["heldout_accuracy"]) <= 0.015


def test_generate_left_padded_batch_equals_single(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    heldout = ArithmeticTask(num_train=1).split("test")[:4]
    prompts = [ex["prompt"] for ex in heldout]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc["attention_mask"][:, 0] == 0).any()  # prompts of different lengths
    out = model.generate(**enc, do_sample=False, max_new_tokens=40)
    batch_texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    for prompt, text in zip(prompts, batch_texts, strict=True):
        one = tok(prompt, return_tensors="pt")
        single = model.generate(**one, do_sample=False, max_new_tokens=40)
        assert tok.decode(single[0, one["input_ids"].shape[1]:], skip_special_tokens=True) == text
    assert all("####" in t for t in batch_texts)
    rewards = arithmetic_reward(batch_texts, [ex["answer"] for ex in heldout])
    assert set(rewards) <= {0.0, 1.0}
    # sampling works and ends with EOS or the token budget
    torch.manual_seed(0)
    sampled = model.generate(**enc, do_sample=True, top_k=0, temperature=1.0, max_new_tokens=40,
                             num_return_sequences=2)
    assert sampled.shape[0] == 2 * len(prompts)


def test_tokenizer_rebuild_matches_shipped(
    builder: ModuleType, info: dict[str, Any], tmp_path: Path
) -> None:
    cfg = info["config"]
    examples, _ = builder.sft_data(cfg["seed"])
    tok = builder.build_tokenizer(builder.tokenizer_corpus(examples, cfg["tokenizer_corpus"]),
                                  cfg["vocab_size"])
    tok.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (TINY_MODEL_PATH / name).read_bytes(), name


def test_sft_steps_are_bit_reproducible(
    builder: ModuleType, tiny: tuple[Any, Any]
) -> None:
    _, tok = tiny
    examples, heldout = builder.sft_data(0)
    data = builder.encode_sft(examples[:48], tok)
    cfg = builder.BuildConfig(batch_size=16, max_steps=3, eval_every=10**6, warmup_steps=2)

    def run(seed: int) -> dict[str, torch.Tensor]:
        model = builder.build_model(tok, "2M", seed)
        steps, acc, hist = builder.sft(model, tok, data, heldout, cfg, log=lambda *_: None)
        assert (steps, acc, hist) == (3, None, [])
        return {k: v.clone() for k, v in model.state_dict().items()}

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    init = builder.build_model(tok, "2M", 0).state_dict()
    assert not torch.equal(init["model.layers.0.mlp.up_proj.weight"],
                           a["model.layers.0.mlp.up_proj.weight"])  # the steps did train


def test_sft_calls_on_eval_with_every_candidate_stop_point(
    builder: ModuleType, tiny: tuple[Any, Any]
) -> None:
    _, tok = tiny
    examples, heldout = builder.sft_data(0)
    data = builder.encode_sft(examples[:32], tok)
    cfg = builder.BuildConfig(batch_size=16, max_steps=4, eval_every=2, warmup_steps=2,
                              target_acc=2.0)
    seen: list[tuple[int, float, int]] = []
    model = builder.build_model(tok, "2M", 0)
    steps, acc, hist = builder.sft(
        model, tok, data, heldout[:4], cfg, log=lambda *_: None,
        on_eval=lambda step, a, m: seen.append((step, a, id(m))),
    )
    assert steps == 4 and [s for s, _, _ in seen] == [2, 4] == [h["step"] for h in hist]
    assert [a for _, a, _ in seen] == [h["heldout_accuracy"] for h in hist]
    assert {i for _, _, i in seen} == {id(model)}


def test_build_keeps_every_eval_as_a_loadable_candidate(
    builder: ModuleType, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    # 4 new tokens per held-out answer: the evaluations' numbers are only compared with what
    # each saved candidate recorded (40 tokens, the build's, cost most of the test)
    cfg = builder.BuildConfig(batch_size=8, max_steps=2, eval_every=1, warmup_steps=1,
                              target_acc=2.0, tokenizer_corpus=500, eval_batch_size=200,
                              max_new_tokens=4)  # fmt: skip
    info = builder.build(cfg, tmp_path / "final", require_target=False,
                         log=lambda *_: None, keep_evals=tmp_path / "evals")
    assert sorted(p.name for p in (tmp_path / "evals").iterdir()) == ["step1", "step2"]
    for e in info["evals"]:
        d = tmp_path / "evals" / f"step{e['step']}"
        assert json.loads((d / "heldout.json").read_text()) == {
            "step": e["step"], "heldout_accuracy": e["heldout_accuracy"]}
        assert (d / "tokenizer.json").is_file()
    last = AutoModelForCausalLM.from_pretrained(tmp_path / "evals" / "step2")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert all(torch.equal(a, b) for a, b in zip(last.state_dict().values(),
                                                 final.state_dict().values(), strict=True))


def test_compare_assets_detects_differences(builder: ModuleType, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(TINY_MODEL_PATH, copy)
    assert builder.compare_assets(copy, TINY_MODEL_PATH) == []
    tensors = load_file(str(copy / "model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 1e-3
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    problems = builder.compare_assets(copy, TINY_MODEL_PATH)
    assert f"{key}: values differ" in problems
    assert any(p.startswith("largest weight difference 0.001") for p in problems)


# ------------------------------------------------------------------------------ loader errors


@pytest.mark.parametrize("bad", ["/nonexistent/gbmpo-model", "./no-such-model-dir",
                                 "../no/such/model", "~/no-such-model", "C:\\models\\x", ""])
def test_missing_local_path_raises(bad: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist|empty") as err:
        load_model_and_tokenizer(bad)
    if bad:
        assert repr(bad) in str(err.value)


def test_missing_path_object_and_bad_dirs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_and_tokenizer(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model_and_tokenizer(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file"):
        load_model_and_tokenizer(str(f))


def test_hub_id_is_passed_through_and_offline_failure_is_clear(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """More hub-id cases (local cache, unreachable Hub) are in tests/test_models.py."""
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert resolve_model_path("gbmpo-test/no-such-model") == "gbmpo-test/no-such-model"
    assert resolve_model_path("gpt2") == "gpt2"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="not a local directory, .* Hugging Face Hub"):
        load_model_and_tokenizer("gbmpo-test/no-such-model")


def test_local_copy_loads_and_pad_falls_back_to_eos(tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(TINY_MODEL_PATH, copy)
    model, tok = load_model_and_tokenizer(str(copy))
    assert tok.pad_token_id == 0 and tok.padding_side == "left"
    cfg_path = copy / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["pad_token"]
    cfg["padding_side"] = "right"
    cfg_path.write_text(json.dumps(cfg))
    model, tok = load_model_and_tokenizer(str(copy))
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert tok.padding_side == "left"
