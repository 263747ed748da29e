"""Fixtures shared by the whole suite.

``micro_model_dir`` / ``micro_model``: a micro Qwen3 (random weights, ~0.1M parameters) with a
small byte-level BPE tokenizer trained on arithmetic problems, saved like a real checkpoint
(trainer, rollout and CLI tests). ``sandbox``: one fully protected code sandbox per test session
(sandbox and code-reward tests). ``verl_check_memo``: verl's validation of a composed config
(``gbmpo train --engine verl --dry-run``) run once per distinct input in a worker.

``data_mode`` runs a test twice: with the data sets as this checkout has them (``packed``:
GSM8K/MBPP packed into the package at install, where the install found them) and as a user's
own clone has them (``hidden``: no package data, no ``GBMPO_DATA_DIR``, no hub), so CI, which
has the data, still proves what a user without it gets.

Parallel runs (``make test`` runs ``pytest -n 2``, pytest-xdist): ``pytest_xdist_make_scheduler``
hands the tests out in the units and order of ``tests/xdist_schedule.py``: the tests of a file
with a module- or class-scoped fixture (one training run its tests only read) go to one worker,
which builds that fixture once; all tests marked ``ray`` go to one worker (one local Ray
instance at a time); the longest units start first; the tests marked ``exclusive`` come last.
Locks keep the rules whatever the order: a test marked ``ray`` waits until no other worker runs
one; a test marked ``exclusive`` runs while no other worker runs any test (a timing window or a
whole-machine measurement). Without ``-n`` none of this applies.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from gbmpo.sandbox import Sandbox


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n N`` (``--dist load``): the units and their order of ``xdist_schedule`` (a file with
    a shared fixture on one worker, all ``ray`` tests on one worker, the longest units first,
    the ``exclusive`` tests last); a worker is handed the next unit when it is nearly out of
    work."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    import xdist_schedule

    def read(path: str) -> str | None:
        try:
            return (config.rootpath / path).read_text(encoding="utf-8")
        except OSError:
            return None

    class UnitScheduling(LoadScopeScheduling):
        """LoadScopeScheduling (pytest-xdist 3.8) with ``xdist_schedule``'s units and order:
        ``schedule`` is the base class's with the work queue built from those."""

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:  # the initial distribution happened
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            units = xdist_schedule.group(self.collection, read)
            self._unit = {nodeid: unit for unit, ids in units.items() for nodeid in ids}
            for unit in xdist_schedule.order_units(units):
                self.workqueue[unit] = {nodeid: False for nodeid in units[unit]}
            for _ in range(len(self.nodes) - len(self.workqueue)):  # more workers than units
                unused, _work = self.assigned_work.popitem()
                unused.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

        def _split_scope(self, nodeid: str) -> str:
            return self._unit[nodeid]

    return UnitScheduling(config, log)


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _machine_turn(shared_dir: Path, *, exclusive: bool, ray: bool) -> Iterator[None]:
    """Locks over one xdist run's workers (``fcntl.flock`` on files in the directory their
    temporary directories share). ``turn``, a readers-writer lock: every test holds it shared,
    an ``exclusive`` test alone; an exclusive test waiting for it holds ``gate``, so the other
    worker's next tests wait behind it instead of starving it. ``ray``: one Ray test at a time.
    Always taken in this order (turn, then ray), so no two workers wait for each other."""
    import fcntl

    with contextlib.ExitStack() as held:
        with _flock(shared_dir / "gbmpo-gate.lock", fcntl.LOCK_EX):
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            held.enter_context(_flock(shared_dir / "gbmpo-turn.lock", mode))
        if ray:
            held.enter_context(_flock(shared_dir / "gbmpo-ray.lock", fcntl.LOCK_EX))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Under xdist, a test (its set-up, call and tear-down, module fixtures included) runs
    while it holds its turn (``_machine_turn``)."""
    basetemp = item.config.option.basetemp  # xdist gives each worker <the run's basetemp>/gwN
    if "PYTEST_XDIST_WORKER" not in os.environ or not basetemp:
        return (yield)
    with _machine_turn(Path(basetemp).parent,
                       exclusive=item.get_closest_marker("exclusive") is not None,
                       ray=item.get_closest_marker("ray") is not None):  # fmt: skip
        return (yield)


@pytest.fixture(params=["packed", "hidden"])
def data_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
              tmp_path: Path) -> str:  # fmt: skip
    """``packed``: this checkout's data; ``hidden``: a user's clone (no data anywhere)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if request.param == "hidden":
        from gbmpo.tasks import _common

        monkeypatch.delenv(_common.DATA_DIR_ENV, raising=False)
        monkeypatch.setenv(_common.HUB_ENV, "0")
        monkeypatch.setattr(_common, "package_data_dir", lambda: tmp_path / "no-package-data")
    return str(request.param)


def build_micro_model(directory: Path, *, seed: int = 0, hidden: int = 32, layers: int = 1) -> Path:
    """Save a randomly initialised micro Qwen3 and its tokenizer into ``directory``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from gbmpo.tasks.arithmetic import generate_problems

    texts = [ex["prompt"] + ex["solution"] for ex in generate_problems(300, "micro-tokenizer")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=160,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.padding_side = "left"
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro") / "model")


@pytest.fixture(scope="session")
def micro_model(micro_model_dir: Path):  # noqa: ANN201 - (model, tokenizer)
    from gbmpo.models import load_model_and_tokenizer

    return load_model_and_tokenizer(str(micro_model_dir))


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    """A strict 2-worker sandbox; skips when this machine lacks a protection layer."""
    from gbmpo.sandbox import Sandbox, SandboxError, SandboxUnavailableError

    try:
        box = Sandbox(workers=2, strict=True, timeout_s=5.0)
    except SandboxUnavailableError as exc:
        pytest.skip(f"full sandbox unavailable here: {exc}")
    except SandboxError as exc:  # e.g. no /usr/bin/python3
        pytest.skip(f"sandbox cannot start here: {exc}")
    yield box
    box.close()


#: verl's validations of composed configs in this worker, by their input (``verl_check_memo``)
_VERL_CHECKS: dict[tuple[object, ...], subprocess.CompletedProcess[str]] = {}


@pytest.fixture(scope="module")
def verl_check_memo() -> Iterator[dict[tuple[object, ...], subprocess.CompletedProcess[str]]]:
    """For a module's tests, ``gbmpo train --engine verl --dry-run`` runs verl's validation (the
    subprocess in verl's environment that composes ``ppo_trainer.yaml`` with the overrides:
    several seconds, most of them importing verl) once per distinct input in this worker: a dry
    run whose interpreter, overrides, plugins and platform an earlier one had gets that one's
    result (exit status and output; the validation is a function of these and reads no data set,
    so ``data_mode`` does not change it). Everything on gbmpo's side of the dry run still runs
    each time. Yields the memo (input -> result). A test file that uses it
    through a module-scoped fixture of its own stays on one xdist worker (``xdist_schedule``),
    so its dry runs share the memo."""
    from gbmpo.engines.verl import runner as verl_runner

    real = verl_runner._verl_check

    def once(python: str, ov: list[str], tmp: Path, plugins: list[str] | None = None, *,
             cpu: bool = False) -> subprocess.CompletedProcess[str]:  # fmt: skip
        key = (python, tuple(ov), tuple(plugins or ()), cpu)
        if key not in _VERL_CHECKS:
            _VERL_CHECKS[key] = real(python, ov, tmp, plugins, cpu=cpu)
        return _VERL_CHECKS[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verl_runner, "_verl_check", once)
        yield _VERL_CHECKS
