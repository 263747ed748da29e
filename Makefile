# Set-up on a fresh machine is one command, either of:
#   make run    install what is missing, then train the embedded default model (`gbmpo train`)
#   make test   install what is missing, then run the whole test suite (what CI runs)
# Extra arguments go through ARGS:  make run ARGS="--steps 20"   make test ARGS="-x tests/test_cli.py"
#
# "Install" is scripts/install.sh (.venv, plus .venv-verl unless GBMPO_INSTALL_VERL=0). It runs
# only when .venv has no stamp yet, or a requirement file, pyproject.toml or an install script is
# newer than the stamp, or .venv-verl is missing; otherwise both commands start at once.

SHELL := /bin/bash
VENV := .venv
STAMP := $(VENV)/.gbmpo-installed
INSTALL_INPUTS := requirements.txt requirements-verl.txt pyproject.toml \
                  scripts/install.sh scripts/install_verl_env.sh scripts/pack_data.py
ifneq ($(GBMPO_INSTALL_VERL),0)
VERL_PYTHON := .venv-verl/bin/python
endif
ARGS ?=

.PHONY: run test install
.DELETE_ON_ERROR:

run: $(STAMP)
	$(VENV)/bin/gbmpo train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(ARGS)

install: $(STAMP)

$(STAMP): $(INSTALL_INPUTS) $(VERL_PYTHON)
	bash scripts/install.sh
	touch $@

ifdef VERL_PYTHON
# a missing verl environment makes the stamp out of date (install.sh builds it)
$(VERL_PYTHON): ;
endif
