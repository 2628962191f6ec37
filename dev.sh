#!/usr/bin/env bash
# jaxllm's quick start. On first use it makes .venv with Python 3.12 and installs jaxllm into it.
#   ./dev.sh serve [MODEL] [flags]   serve the OpenAI-compatible API (default model: SmolLM2-135M)
#   ./dev.sh test [pytest args]      run the test suite (what CI runs)
#   ./dev.sh generate "prompt"       any other jaxllm subcommand
set -euo pipefail
cd "$(dirname "$0")"

find_python312() {
  local candidate
  for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
                   /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  echo "error: jaxllm needs Python 3.12 (python3.12 on PATH)" >&2
  exit 1
}

# $1: the extras to install ("" or "test"); reinstalls when pyproject.toml changes.
ensure_venv() {
  local marker=".venv/.installed${1:+-$1}"
  if [ -f "$marker" ] && [ "$marker" -nt pyproject.toml ]; then return; fi
  if [ ! -x .venv/bin/python ]; then
    echo "Creating .venv (Python 3.12)..." >&2
    "$(find_python312)" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
  fi
  echo "Installing jaxllm${1:+[$1]} into .venv (first run only; a few minutes)..." >&2
  .venv/bin/python -m pip install -q -e ".${1:+[$1]}"
  touch "$marker"
}

case "${1:-}" in
  test)
    shift
    ensure_venv test
    export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
    # two workers, a test file each at a time (its module fixtures built once): CI's two cores
    exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
    ;;
  *)
    ensure_venv ""
    exec .venv/bin/jaxllm "$@"
    ;;
esac
