#!/usr/bin/env bash
# Install gbmpo, TRL and everything the tests need into ./.venv, from scratch (`make run` and
# `make test` call it; verl goes into ./.venv-verl, scripts/install_verl_env.sh, `make verl`).
#   bash scripts/install.sh
# System packages (Debian, only when run as root): bubblewrap and python3-seccomp harden the code
# sandbox (gbmpo.rewards.run_program); without them the sandbox reports which protections are
# missing. Not root: nothing outside this directory is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! command -v bwrap >/dev/null 2>&1 || ! /usr/bin/python3 -c 'import seccomp' >/dev/null 2>&1; then
    echo "install.sh: root: apt-get install bubblewrap python3-seccomp (for the code sandbox)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3-seccomp >/dev/null
  fi
fi
PY=${PYTHON:-python3}
"$PY" -m venv .venv
# torch first, pinned to the CPU build (any other torch pin pulls a multi-GB CUDA build)
.venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
# GSM8K/MBPP as package data (gzip, checked against the sha256 in the offline data's SOURCE.md);
# nothing is packed where that folder is absent, and tasks then use GBMPO_DATA_DIR or the hub
.venv/bin/python scripts/pack_data.py
.venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
echo "install.sh: .venv ready (gbmpo, python: .venv/bin; source .venv/bin/activate)"
