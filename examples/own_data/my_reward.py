"""A reward function of your own, in TRL's convention: ``fn(prompts, completions, **columns)``.

``columns`` holds every other column of the data rows, one value per completion; with
``answer_column: final`` the ``final`` column arrives as ``answer``. Return one float per
completion (``None`` to abstain on one).

    gbmpo train --task jsonl --task.params.path examples/own_data/word_problems.jsonl \\
        --task.params.reward examples/own_data/my_reward.py:final_number ...
"""

from __future__ import annotations

import re


def final_number(prompts, completions, answer, **columns):
    """1.0 when the number after the last ``####`` equals the answer, 0.1 when a ``####`` line
    is there but wrong (the format is right), else 0.0."""
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        if "####" not in completion:
            out.append(0.0)
            continue
        m = re.search(r"-?\d+", completion.rsplit("####", 1)[1])
        out.append(1.0 if m and int(m.group()) == int(gold) else 0.1)
    return out
