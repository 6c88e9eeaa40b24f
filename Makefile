# The two commands: `make train` and `make test`. Each bootstraps .venv on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NP      ?= 4
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
MPIEXEC := $(BIN)/mpiexec
TEST_TIMEOUT ?= 300

.PHONY: train test test-unit test-mpi bench clean-venv

# (re)install when the venv is missing or older than setup.cfg
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[mpich,test]'
	touch $(STAMP)

train: $(STAMP)
	$(MPIEXEC) -n $(NP) $(BIN)/hpengine train configs/default.toml --set train.out_dir=runs/default-$$(date +%Y%m%d-%H%M%S)

test: test-unit test-mpi

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/unit

# the same MPI suite at every world size; tests read the size and skip together what does not fit
test-mpi: $(STAMP)
	for n in 1 2 4 8; do \
	  echo "== tests/mpi under mpiexec -n $$n"; \
	  $(MPIEXEC) -n $$n $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/mpi || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

clean-venv:
	rm -rf $(VENV)
