# Set-up on a fresh machine is one command, either of:
#   make run    install .venv if needed, then train the embedded default model (`gbmpo train`)
#   make test   install .venv and .venv-verl if needed, then run the whole test suite (what CI runs)
#   make verl   install .venv-verl if needed: verl, for `--engine verl` and the verl tests
#   make test-portable   the numerics and parity tests (PORTABLE_TESTS) again with torch's plain
#                        kernels (ATEN_CPU_CAPABILITY=default): a verdict that depends on the
#                        processor's vector width fails on any machine (CI runs it after `make test`)
# Extra arguments go through ARGS:  make run ARGS="--steps 20"   make test ARGS="-x tests/cli/test_cli.py"
# `make test` runs the tests on JOBS pytest-xdist workers (2: the 2-core CI machine); JOBS=0 runs
# them in one process (e.g. for --pdb or -s):  make test JOBS=0 ARGS="--pdb tests/io"
#
# .venv (scripts/install.sh) is installed when it has no stamp yet or requirements.txt,
# pyproject.toml, scripts/install.sh or scripts/pack_data.py is newer than the stamp; .venv-verl
# (scripts/install_verl_env.sh) likewise from its own stamp and inputs. Only `make test` and
# `make verl` build .venv-verl; `GBMPO_INSTALL_VERL=0 make test` skips it (the verl tests then
# skip, saying so). Otherwise every command starts at once.

SHELL := /bin/bash
VENV := .venv
STAMP := $(VENV)/.gbmpo-installed
VERL_STAMP := .venv-verl/.gbmpo-installed
INSTALL_INPUTS := requirements.txt pyproject.toml scripts/install.sh scripts/pack_data.py
VERL_INPUTS := requirements-verl.txt pyproject.toml scripts/install_verl_env.sh
TEST_NEEDS := $(STAMP)
ifneq ($(GBMPO_INSTALL_VERL),0)
TEST_NEEDS += $(VERL_STAMP)
endif
ARGS ?=
JOBS ?= 2
# the tests that compare numbers across code paths or engines: objectives, the TRL drop-in and
# engine, verl (tests/engines runs tests_verl in .venv-verl), the decoders and log-probs, and the
# trainer tests that compare the own engine with a formula or another engine
PORTABLE_TESTS := tests/objectives tests/integrations tests/engines tests/rollout \
	tests/train/test_estimator_trainer.py tests/train/test_placement_trainer.py \
	tests/train/test_objective_terms.py tests/eval/test_drift.py

.PHONY: run test test-portable install verl
.DELETE_ON_ERROR:

run: $(STAMP)
	$(VENV)/bin/gbmpo train $(ARGS)

test: $(TEST_NEEDS)
	$(VENV)/bin/python -m pytest -n $(JOBS) $(ARGS)

test-portable: $(TEST_NEEDS)
	ATEN_CPU_CAPABILITY=default $(VENV)/bin/python -m pytest -n $(JOBS) $(PORTABLE_TESTS) $(ARGS)

install: $(STAMP)

verl: $(VERL_STAMP)

$(STAMP): $(INSTALL_INPUTS)
	bash scripts/install.sh
	touch $@

$(VERL_STAMP): $(VERL_INPUTS)
	bash scripts/install_verl_env.sh
	touch $@
