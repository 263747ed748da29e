"""Write GSM8K as verl's parquet files (``train.parquet``, ``test.parquet``) from gbmpo's copy.

The rows follow verl's own GSM8K preprocessing (``data_source="openai/gsm8k"``, so verl's default
reward router scores them with ``verl.utils.reward_score.gsm8k``: the number after ``####``)::

    python examples/verl/prepare_gsm8k.py --out ~/data/gsm8k [--source DIR]

The source is gbmpo's packaged GSM8K (``gbmpo/data/gsm8k/{train,test}.jsonl.gz``, written by
``scripts/pack_data.py``) or ``--source`` holding ``train.jsonl(.gz)`` / ``test.jsonl(.gz)`` with
``question`` / ``answer`` fields. Runs in the verl environment (pandas and pyarrow come with verl).
"""

from __future__ import annotations

import argparse
import gzip
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

#: verl's GSM8K instruction (examples/data_preprocess/gsm8k.py)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gold_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``, commas removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' line: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def verl_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One row in verl's GSM8K layout."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gold_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def _read(source: Path | None, split: str) -> list[dict[str, Any]]:
    if source is None:
        path = files("gbmpo") / "data" / "gsm8k" / f"{split}.jsonl.gz"
        if not path.is_file():
            raise SystemExit(
                f"{path} is missing: gbmpo was installed without its packed GSM8K "
                "(scripts/pack_data.py); pass --source DIR with train.jsonl / test.jsonl"
            )
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    else:
        plain, gz = source / f"{split}.jsonl", source / f"{split}.jsonl.gz"
        text = gzip.decompress(gz.read_bytes()).decode() if gz.exists() else plain.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--source", type=Path, default=None, help="directory of GSM8K jsonl files")
    args = ap.parse_args(argv)

    import pandas as pd

    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = [
            verl_row(r["question"], r["answer"], split, i)
            for i, r in enumerate(_read(args.source, split))
        ]
        pd.DataFrame(rows).to_parquet(args.out / f"{split}.parquet")
        print(f"{args.out / f'{split}.parquet'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
