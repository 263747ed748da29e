"""Pack the offline copies of GSM8K and MBPP into the package as gzip files (install time only).

    python scripts/pack_data.py [--source DIR] [--dest src/gbmpo/data] [--check]

The data sets are not kept in git: ``scripts/install.sh`` runs this script on a checkout that
has the offline copies in ``shared/data`` next to the checkout (whose ``SOURCE.md`` files give each
file's origin and sha256), and the files it writes (``src/gbmpo/data/<name>/<file>.gz``) are package
data, so an installed gbmpo (and a wheel built from this tree) carries them and never reads
that folder at run time. Every source file is checked against the sha256 in its ``SOURCE.md``
before it is packed; the gzip stream is written with mtime 0, so packing is byte-reproducible.
The licences (``LICENSE`` / ``NOTICE`` beside the packed files) are kept in git.

Exit codes: 0 packed (or nothing to pack: no source directory); 1 a checksum mismatch.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: data set -> files packed from ``<source>/<data set>/``
FILES = {
    "gsm8k": ["train.jsonl", "test.jsonl"],
    "mbpp": ["mbpp.jsonl", "sanitized-mbpp.json"],
}


def expected_sha256(source_md: Path) -> dict[str, str]:
    """``file name -> sha256`` from the table rows of a ``SOURCE.md``."""
    out: dict[str, str] = {}
    for line in source_md.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*([\w.-]+)\s*\|.*\|\s*([0-9a-f]{64})\s*\|\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def pack(source: Path, dest: Path, check_only: bool = False) -> list[str]:
    """Pack every file of :data:`FILES` found under ``source``; returns the problems found."""
    problems: list[str] = []
    for name, files in FILES.items():
        src_dir = source / name
        sums = expected_sha256(src_dir / "SOURCE.md") if (src_dir / "SOURCE.md").is_file() else {}
        for fname in files:
            src = src_dir / fname
            if not src.is_file():
                problems.append(f"{src}: missing")
                continue
            raw = src.read_bytes()
            digest = hashlib.sha256(raw).hexdigest()
            if fname not in sums:
                problems.append(f"{src}: no sha256 for it in {src_dir / 'SOURCE.md'}")
                continue
            if digest != sums[fname]:
                problems.append(f"{src}: sha256 {digest} != {sums[fname]} (SOURCE.md)")
                continue
            out = dest / name / (fname + ".gz")
            if check_only:
                if not out.is_file() or gzip.decompress(out.read_bytes()) != raw:
                    problems.append(f"{out}: missing or not equal to {src}")
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".gz.tmp")
            with open(tmp, "wb") as fh, gzip.GzipFile(
                filename="", mode="wb", fileobj=fh, compresslevel=9, mtime=0
            ) as gz:
                gz.write(raw)
            tmp.replace(out)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--dest", type=Path, default=REPO / "src" / "gbmpo" / "data")
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    if not args.source.is_dir():
        print("pack_data: no offline GSM8K/MBPP copies to pack (normal for a clone); "
              "--task gsm8k / mbpp will download them from the Hugging Face hub on first use, "
              "or read them from $GBMPO_DATA_DIR", file=sys.stderr)
        return 0
    problems = pack(args.source, args.dest, check_only=args.check)
    for p in problems:
        print(f"pack_data: {p}", file=sys.stderr)
    bad = [p for p in problems if not p.endswith(": missing")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
