# Developer and CI entry points. `make test` is all CI runs (.ci/run).
#   make venv    .venv with torch (CPU, from /opt/wheels) and the project, editable
#   make test    venv, a redis-server (scripts/ensure_redis.sh), prometheus/promtool when
#                apt-get can install them (scripts/ensure_prometheus.sh), then pytest $(PYTEST_ARGS),
#                then `make chaos-short`
#   make chaos   the reliability and security probes (reliability/run.py) for CHAOS_MINUTES
#                (20) minutes; prints the table and writes docs/reliability.md
#   make chaos-short  the same probes for about two minutes (part of `make test`, so of CI)
#   make run     the daemon in the foreground (`statetier serve $(RUN_ARGS)`)
#   make bench   benchmarks/seal.py
#   make clean   caches and build output; `make distclean` also drops .venv

VENV        ?= .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
TORCH       := torch==2.13.0
WHEELS      := /opt/wheels
PYTEST_ARGS ?=
RUN_ARGS    ?=
CHAOS_MINUTES ?= 20

# Where the CPU wheel lies on disk, pip must look there first; an index alone would
# offer a CUDA build of the same version.
FIND_LINKS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS))

.PHONY: venv test chaos chaos-short run bench clean distclean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) '$(TORCH)'
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[test,bench]'
	touch $@

test: $(STAMP)
	VENV=$(VENV) bash scripts/ensure_redis.sh
	-bash scripts/ensure_prometheus.sh
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory chaos-short

chaos: $(STAMP)
	VENV=$(VENV) bash scripts/ensure_redis.sh
	$(PY) reliability/run.py --minutes $(CHAOS_MINUTES)

chaos-short: $(STAMP)
	VENV=$(VENV) bash scripts/ensure_redis.sh
	$(PY) reliability/run.py --short

run: $(STAMP)
	@if $(PY) -c 'import statetier.daemon.app' 2>/dev/null; then \
		exec $(VENV)/bin/statetier serve $(RUN_ARGS); \
	else \
		echo "daemon not built yet"; \
	fi

bench: $(STAMP)
	@if [ -f benchmarks/seal.py ]; then \
		exec $(PY) benchmarks/seal.py; \
	else \
		echo "benchmarks/seal.py not written yet"; \
	fi

clean:
	rm -rf build dist .pytest_cache .hypothesis statetier-data statetier.sock
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -type d -print0 \
		| xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)
