#!/usr/bin/env bash
# Set everything up (once) and run the test suite. Extra arguments go to pytest.
# The browser test needs Chromium, the class server's test nginx: installed here from Debian's packages when
# missing and we are root.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing Debian's chromium for the browser test" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null \
        || echo "[test] could not install chromium: the browser test will be skipped" >&2
fi
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing Debian's nginx for the class server's test (scripts/class_server.py)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx) >/dev/null \
        || echo "[test] could not install nginx: the class server's multi-process test will be skipped" >&2
fi
# The vLLM peer (tests/test_conformance.py holds the lab's V1 mode against it): its own environment,
# built once (about 75 s and 3.4 GB, most of it torch and triton). Where vLLM cannot be installed the conformance tests skip and say so.
if ! bash "$ROOT/scripts/setup_peer.sh"; then
    echo "[test] the vLLM peer could not be set up: the conformance tests will be skipped" >&2
fi
cd "$ROOT"
# Two workers by default (one per core, PAL_TEST_WORKERS to change; 0 or 1 runs in this process), each test file
# on one worker (its module fixtures, e.g. a server it starts, are built once); each worker's torch uses one thread
# (tests/conftest.py), so the two never fight for the cores. Passing -n yourself, or -p no:xdist, overrides this.
workers="${PAL_TEST_WORKERS:-2}"
case " $* " in *" -n"*|*" --numprocesses"*|*"no:xdist"*) workers=0 ;; esac
if [ "$workers" -gt 1 ]; then
    # --no-loadscope-reorder: keep conftest's order (longest file first) instead of xdist's most-tests-first
    set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
# the 25 slowest tests are listed at the end: where the suite's minutes go, in every CI log
exec "$ROOT/.venv/bin/python" -m pytest --durations=25 "$@"
