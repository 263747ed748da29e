"""A reward file named by path and resolved from several threads at once (verl's reward workers
score in a thread pool): every thread gets the function, none a half-executed module."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gbmpo.rewards.resolve import resolve_reward

#: the body takes a while to run, so the threads overlap while the module is being executed
SLOW_REWARD = """
import time
time.sleep(0.3)


def digits(prompts, completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]
"""


def test_threads_resolving_one_reward_file_all_get_the_function(tmp_path: Path) -> None:
    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_REWARD)
    spec = f"{path}:digits"
    with ThreadPoolExecutor(max_workers=8) as pool:
        fns = list(pool.map(lambda _: resolve_reward(spec), range(8)))
    assert len({id(fn) for fn in fns}) == 1  # one module, executed once
    assert fns[0](["p"], ["a1b22"]) == [3.0]
