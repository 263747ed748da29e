#!/usr/bin/env bash
# Build ./.venv-verl: verl (requirements-verl.txt) plus gbmpo (editable, no deps), for
# gbmpo.integrations.verl and its tests (tests_verl/). Separate from ./.venv because verl 0.9.x
# needs transformers<5.11 and tensordict<=0.10.
#   bash scripts/install_verl_env.sh     (`make verl`, and `make test` unless GBMPO_INSTALL_VERL=0)
# torch goes in first, pinned to the CPU build, and is pinned again in the verl install so that
# no verl dependency can replace it (any other torch pulls a multi-GB CUDA build); the script
# fails if torch changed anyway. Measured on the project machine (2 shared cores, warm pip cache):
# 2-4 min wall (2m05s and 3m38s); 2.1 GB (du -sh .venv-verl). With verl's trainer imports
# (cachetools, fastapi, uvicorn) in a fresh clone at load about 9: 9m06s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m venv .venv-verl
PIP=(.venv-verl/bin/pip install -q --disable-pip-version-check)
TORCH=$(grep -E '^torch==' requirements-verl.txt)
"${PIP[@]}" "$TORCH"
"${PIP[@]}" -r requirements-verl.txt
"${PIP[@]}" --no-deps -e .
.venv-verl/bin/python - "$TORCH" <<'PY'
import sys

import torch

want = sys.argv[1].split("==")[1]
if torch.__version__.split("+")[0] != want or torch.version.cuda is not None:
    sys.exit(f".venv-verl: torch {torch.__version__} (cuda {torch.version.cuda}) replaced {want}")
PY
echo "install_verl_env.sh: .venv-verl ready"
