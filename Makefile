# The torch of the tests and CI is pinned here (and only here): an unpinned torch pulls a CUDA build with gigabytes
# of NVIDIA libraries. The pin names the version the project's machines serve as a CPU wheel; elsewhere, point it at
# PyTorch's CPU index: make install TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu".
# The package itself accepts any recent torch.
PYTHON ?= python3
TORCH_CPU ?= torch==2.13.0

.PHONY: install lint test test-fast demo bench

install:
	$(PYTHON) -m pip install -q $(TORCH_CPU)
	$(PYTHON) -m pip install -q -e ".[dev]"

lint:
	$(PYTHON) -m ruff check .

# CI runs `make test`, so the lint runs there too, before the suite.
test: lint
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup --durations=15 tests

# The edit-test loop: everything but the tests marked slow (child processes, distributed runs, Triton's interpreter,
# real training steps and a few other long ones), which `make test` and CI still run.
test-fast: lint
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup -m "not slow" tests

demo:
	$(PYTHON) -m rotarium train

bench:
	$(PYTHON) benchmarks/ops.py
