# Two entry points for a fresh machine (see README): `make release` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: release check test sandbox

$(BIN)/jaxlab: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

release: $(BIN)/jaxlab
	$(BIN)/jaxlab release

check: $(BIN)/jaxlab
	$(BIN)/jaxlab release --check

test: $(BIN)/jaxlab sandbox  # the sandbox tests run for real, never skipped
	$(BIN)/python -m pytest

# bubblewrap, the sandbox `jaxlab grade` runs each kernel in (Debian/Ubuntu; needs root)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

sandbox:
	command -v bwrap >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bubblewrap; }
