#!/usr/bin/env bash
# End-to-end test: the checkout example in headless Chromium (see README.md, "End-to-end test in a real browser").
#
#   bash tests/e2e/run.sh             # the test
#   bash tests/e2e/run.sh --prepare   # only install what it needs, then exit
#
# Installs what is missing (Debian's chromium, redis-server; npm ci of the
# pinned playwright-core), builds examples/checkout.rs, starts one checkout
# server on the memory backend and two on one redis-server of its own (free
# ports, loopback only), runs tests/e2e/checkout.test.mjs with node's test
# runner and stops every process it started on exit. Screenshots go to
# $E2E_OUT (default target/e2e-screenshots). Exits non-zero on any failure.
# `--prepare` stops after the installs (Chromium, a hundred Debian packages
# on a fresh machine, is mostly download time): CI runs it in the background
# while it compiles.
set -euo pipefail
PREPARE=
case "${1:-}" in
  --prepare) PREPARE=1 ;;
  "") ;;
  *) echo "usage: bash tests/e2e/run.sh [--prepare]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
ROOT=$PWD
STARTED=$(date +%s)

export E2E_OUT="${E2E_OUT:-$ROOT/target/e2e-screenshots}"
export CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"

say() { echo "e2e: $*"; }
die() { echo "e2e: FAILED: $*" >&2; exit 1; }

# --- prerequisites -----------------------------------------------------------
APT_UPDATED=
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "$1 is missing and apt-get is not available: install $*"
  if [ -z "$APT_UPDATED" ]; then apt-get -o DPkg::Lock::Timeout=600 update -qq; APT_UPDATED=1; fi
  say "installing $* (apt)"
  # Waits for another apt run (CI may install something else meanwhile).
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "$@" >/dev/null
}

[ -x "$CHROMIUM" ] || apt_install chromium
[ -x "$CHROMIUM" ] || die "no browser at $CHROMIUM"
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
  || apt_install redis-server redis-tools
command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
  || die "node (>= 20) and npm are needed for playwright-core"
NODE_MAJOR=$(node -p 'process.versions.node.split(".")[0]')
[ "$NODE_MAJOR" -ge 20 ] || die "node $(node --version) is too old: playwright-core needs node >= 20"

say "$("$CHROMIUM" --version 2>/dev/null | head -1), node $(node --version), $(redis-server --version | cut -d' ' -f1-3)"
# npm ci empties node_modules first: skip it when the lockfile it installed is the current one.
LOCK_SUM=$(sha256sum tests/e2e/package-lock.json | cut -d' ' -f1)
if [ "$(cat tests/e2e/node_modules/.installed-from 2>/dev/null)" != "$LOCK_SUM" ]; then
  (cd tests/e2e && npm ci --no-audit --no-fund --loglevel=error) || die "npm ci in tests/e2e"
  echo "$LOCK_SUM" >tests/e2e/node_modules/.installed-from
fi
if [ -n "$PREPARE" ]; then say "prepared in $(( $(date +%s) - STARTED )) s"; exit 0; fi

say "building examples/checkout.rs"
# With every feature of the main crate, as the test command
# (scripts/test.sh: `cargo test -p tower-redis-lock --all-features`) builds:
# after the tests (as in .ci/run) nothing is compiled again. (Features unify
# across the packages a command selects: the package selection matters.)
cargo build --quiet -p tower-redis-lock --all-features --example checkout || die "cargo build --example checkout"
BIN="$TARGET_DIR/debug/examples/checkout"
[ -x "$BIN" ] || die "no binary at $BIN"

# --- servers (all stopped on exit) -------------------------------------------
LOGS=$(mktemp -d)
PIDS=()
cleanup() {
  local rc=$?
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill "$pid" 2>/dev/null || true; done
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do wait "$pid" 2>/dev/null || true; done
  if [ "$rc" -ne 0 ]; then
    for log in "$LOGS"/*.log; do
      [ -s "$log" ] && { echo "--- $(basename "$log") (last lines)"; tail -n 20 "$log"; }
    done
  fi
  rm -rf "$LOGS"
  say "took $(( $(date +%s) - STARTED )) s"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  node -e 'const s = require("net").createServer().listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); })'
}

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  >"$LOGS/redis.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
  [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ] && break
  kill -0 "${PIDS[-1]}" 2>/dev/null || die "redis-server exited"
  sleep 0.1
done
[ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ] || die "redis-server on port $REDIS_PORT did not answer"

# start_checkout NAME [VAR=value...]: start the example on a free port and set
# URL to its address, read from its start-up line.
start_checkout() {
  local name=$1 log="$LOGS/$1.log"
  shift
  env -u REDIS_URL ADDR=127.0.0.1:0 "$@" "$BIN" >"$log" 2>&1 &
  PIDS+=($!)
  URL=
  for _ in $(seq 100); do
    URL=$(grep -o 'http://[^ ]*' "$log" 2>/dev/null | head -1 || true)
    [ -n "$URL" ] && break
    kill -0 "${PIDS[-1]}" 2>/dev/null || die "checkout server $name exited"
    sleep 0.1
  done
  [ -n "$URL" ] || die "checkout server $name printed no address"
  say "$(head -1 "$log") [$name]"
}

start_checkout memory
export E2E_MEMORY_URL=$URL
grep -q 'memory backend' "$LOGS/memory.log" || die "server memory is not on the memory backend"
# Chromium, three servers and Redis share two cores here: a 1 s backend
# deadline keeps a CPU stall of the box from posing as a lock failure (with
# the default 200 ms, one run in three saw an acquire answered after 201 ms).
for name in redis-a redis-b; do
  start_checkout "$name" REDIS_URL="redis://127.0.0.1:$REDIS_PORT" LOCK_DEADLINE_MS=1000
  grep -q 'redis (redis://127.0.0.1:' "$LOGS/$name.log" || die "server $name is not on Redis"
  if [ "$name" = redis-a ]; then export E2E_REDIS_URL_A=$URL; else export E2E_REDIS_URL_B=$URL; fi
done

# --- the test ----------------------------------------------------------------
mkdir -p "$E2E_OUT"
rm -f "$E2E_OUT"/[0-9][0-9]-*.png   # this test's own files from an earlier run
say "running tests/e2e/checkout.test.mjs (screenshots in $E2E_OUT)"
(cd tests/e2e && node --test --test-concurrency=1 --test-reporter=spec checkout.test.mjs) \
  || die "browser test"
say "passed; screenshots: $(ls "$E2E_OUT" | tr '\n' ' ')"
