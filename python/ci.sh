#!/usr/bin/env bash
# The Python package in CI: build the ghost_oracle wheel with maturin, install it in a fresh
# virtual environment with the test dependencies, and run its tests (python/tests) and the
# example a DP-library maintainer copies (examples/). Exits non-zero when anything fails,
# including a pytest run that collects no test (exit status 5). Extra arguments go to pytest.
#
#     bash python/ci.sh            # from anywhere; PYTHON=python3.12 bash python/ci.sh for another Python
#
# GHOST_ORACLE_WHEEL_PROFILE=dev builds the wheel with cargo's dev profile instead of release (a
# slower extension, but one that can reuse dependencies a `cargo test` run compiled already).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A fresh environment, but one that sees the interpreter's own site-packages: the test
# dependencies (torch with its CUDA libraries, transformers, opacus) are about 6 GB from PyPI.
# Where they are already installed system-wide (developers' machines, a reused CI machine) the
# venv uses them as they are; where they are not, the `pip install` below fetches them into
# the venv. The JAX stack (CPU wheels: jax, flax, optax, jax-privacy, gemma) took 12.5 min to
# install on a 2-core machine, most of it gemma's dependencies (TensorFlow among them); gemma's
# tokenizer needs protobuf 7, where TensorFlow's pin alone resolves to 6. ghost_oracle itself is never taken from outside: the wheel built here is installed
# into the venv, and the import check below makes sure that is the one the tests load.
"$python" -m venv --system-site-packages "$work/venv"
venv_python="$work/venv/bin/python"

echo "python/ci.sh: building the wheel"
if command -v maturin >/dev/null 2>&1; then
    maturin=maturin
else  # into the venv (its own copy: a system-wide maturin module without its script is no use)
    "$venv_python" -m pip install --quiet --disable-pip-version-check --ignore-installed "maturin>=1.9.4,<2"
    maturin="$work/venv/bin/maturin"
fi
"$maturin" --version
"$maturin" build --profile "${GHOST_ORACLE_WHEEL_PROFILE:-release}" --locked --manifest-path python/Cargo.toml \
    --interpreter "$venv_python" --out "$work/dist"

echo "python/ci.sh: installing the wheel and the test dependencies"
"$venv_python" -m pip install --quiet --disable-pip-version-check "$work"/dist/ghost_oracle-*.whl \
    pytest pytest-xdist hypothesis numpy torch safetensors transformers "accelerate>=1.1" "opacus>=1.6,<1.7" \
    "jax[cpu]" flax optax "jax-privacy>=2.0,<3" gemma "protobuf>=7,<8" equinox dm-haiku "keras>=3.10"
(cd "$work" && "$venv_python" - <<'PY'
import sys
import ghost_oracle
assert ghost_oracle.__file__.startswith(sys.prefix), f"ghost_oracle imported from {ghost_oracle.__file__}, not the venv"
print(f"python/ci.sh: ghost_oracle {ghost_oracle.__version__} from {ghost_oracle.__file__}")
PY
)

# The type gate: mypy --strict over the package, with its dependencies importable (mypy.ini at
# the root); its cache lives outside the clone, so that torch's and jax's stubs are read once a
# machine.
echo "python/ci.sh: mypy --strict python/ghost_oracle"
"$venv_python" -m pip install --quiet --disable-pip-version-check mypy==2.4.1
MYPY_CACHE_DIR=/var/tmp/ghost-oracle-mypy-cache "$venv_python" -m mypy --strict python/ghost_oracle

echo "python/ci.sh: pytest python/tests examples"
status=0
# One worker per core (pytest-xdist): the tests are tiny models, bound by one core's Python, so
# two workers on CI's two cores take about half the time of one.
"$venv_python" -m pytest -p no:cacheprovider -n auto --durations=15 --rootdir . python/tests examples "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "python/ci.sh: pytest collected no test" >&2
    status=1
fi
echo "python/ci.sh: exit status $status after $((SECONDS - start)) s"
exit "$status"
