#!/usr/bin/env bash
# A local run with defaults that work on a laptop: the tiny model, one process.
# Extra arguments go to `pp-runtime run`, e.g. ./launch/local.sh --set pp=2 --requests 16
set -euo pipefail
exec pp-runtime run --config "${PP_RUNTIME_CONFIG:-tiny}" "$@"
