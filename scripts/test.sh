#!/usr/bin/env bash
# The test command (README.md, "Tests"); `.ci/run` runs it as its test step.
#
#   scripts/test.sh [arguments for each crate's `cargo test`, e.g. -- layer::]
#   scripts/test.sh --no-run   # only compile every test (CI's build step)
#
# On a fresh Debian machine it installs and starts what the tests need, where
# missing, then runs every crate's tests:
#   - redis-server and redis-cli on PATH (apt-get install redis-server
#     redis-tools); the tests start their own servers on free ports;
#   - pgbouncer (apt-get install pgbouncer); the SQL stores' pooler test
#     starts its own on a free port;
#   - a C compiler (sqlx builds its bundled SQLite);
#   - PostgreSQL on 127.0.0.1:5432, user postgres, no password: started when
#     down, installed when missing (Debian's postgresql, with trust auth on
#     loopback for the cluster it installs); each test makes its own database;
#   - Valkey >= 9: `scripts/valkey.sh` finds or builds it (cached outside the
#     clone, under ~/.cache/tower-redis-lock/) while cargo compiles, and its
#     path goes to the tests as TRL_VALKEY_SERVER.
# Then each crate of the workspace, `cargo test -p <crate> --all-features`,
# the main crate's lib and integration tests again on Valkey 9
# (`TRL_TEST_SERVER=valkey`: the native lease commands), and the one test
# that needs a build without TLS. Fails loudly when a service
# cannot be had: no test skips.
# apt-get and pg_ctlcluster run through sudo when not root.
set -euo pipefail
cd "$(dirname "$0")/.."
NO_RUN=
if [ "${1:-}" = --no-run ]; then NO_RUN=1; shift; fi

say() { echo "test.sh: $*"; }
die() { echo "test.sh: error: $*" >&2; exit 1; }
STARTED=$SECONDS
PHASE_STARTED=$SECONDS
took() { say "$1 took $((SECONDS - PHASE_STARTED)) s (total $((SECONDS - STARTED)) s)"; PHASE_STARTED=$SECONDS; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else die "'$*' needs root (no sudo here): run it yourself, then this script again"; fi
}
APT_UPDATED=
apt_install() {
  command -v apt-get >/dev/null 2>&1 \
    || die "$* missing and apt-get is not available: install the equivalent yourself (README.md, Tests)"
  # Waits for another apt run instead of failing on its lock (CI installs
  # the browser test's Chromium in the background meanwhile).
  if [ -z "$APT_UPDATED" ]; then as_root apt-get -o DPkg::Lock::Timeout=600 update -qq; APT_UPDATED=1; fi
  say "installing $* (apt)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "$@" >/dev/null
}

# --- what is compiled ------------------------------------------------------------
# Crate by crate, each with all its features, not `--workspace`: features
# unify across the packages one command selects, so `--workspace` would build
# the main crate and its dependencies with what no single crate asks for, and
# the tests that build an example (`cargo build --example`, for their own
# crate) would then compile it all again in the middle of the test run (64
# units with the SQL crate, and 27 more for the no-TLS test, against 3 crate
# by crate: cargo's unit graph).
CRATES=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json, sys; print(*[p["name"] for p in json.load(sys.stdin)["packages"]])')
# A `rediss://` URL on a build without `tls-rustls` is refused before a byte
# is sent: that build for real, one test in a binary of its own (empty with
# the feature on; the decision itself is unit-tested for both builds).
NO_TLS=(-p tower-redis-lock --no-default-features --features redis,axum --test no_tls)
compile_tests() {
  for crate in $CRATES; do
    cargo test -p "$crate" --all-features --no-run
  done
  cargo test "${NO_TLS[@]}" --no-run
}

# sqlx's bundled SQLite is C; the Rust toolchain's linker needs cc anyway.
command -v cc >/dev/null 2>&1 || apt_install gcc libc6-dev
if [ -n "$NO_RUN" ]; then
  compile_tests
  took "compiling the tests"
  exit 0
fi

# --- services ------------------------------------------------------------------
# Redis: the tests start their own redis-server processes on free ports.
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
  || apt_install redis-server redis-tools

# PgBouncer: the SQL stores' pooler test starts its own on a free port (Debian
# puts it in /usr/sbin, which may not be on PATH).
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || apt_install pgbouncer

# PostgreSQL on 127.0.0.1:5432, user postgres, trust auth (the bank test, the
# SQL stores' tests): start it when down, install it when missing.
pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 >/dev/null 2>&1; }
if ! pg_up; then
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    apt_install postgresql
    # A fresh Debian cluster asks for a password over TCP: trust loopback
    # (only on the cluster installed here, never on an existing one).
    for hba in /etc/postgresql/*/main/pg_hba.conf; do
      as_root sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
    done
  fi
  for version in $(ls /etc/postgresql 2>/dev/null); do
    say "starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  done
  for _ in $(seq 1 30); do pg_up && break; sleep 1; done
fi
if ! pg_up || ! psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -Atqc 'SELECT 1' >/dev/null; then
  echo "test.sh: error: PostgreSQL is not reachable on 127.0.0.1:5432 as user postgres without a password." >&2
  echo "Start it with" >&2
  echo "  pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start" >&2
  echo "or install it (apt-get install postgresql) and allow trust auth on 127.0.0.1 in pg_hba.conf." >&2
  exit 1
fi
say "$(redis-server --version | cut -d' ' -f1-3); $(psql -h 127.0.0.1 -U postgres -d postgres -Atqc 'SHOW server_version' | sed 's/^/PostgreSQL /')"
took "services"

# --- Valkey, built while cargo compiles ----------------------------------------
# A build takes minutes of CPU: at the lowest priority it fills the cores
# cargo leaves idle and never slows the compile down much. A cached build is
# checked and reused in about a second.
VALKEY_OUT=$(mktemp)
VALKEY_PID=
VALKEY_PASS_PID=
cleanup() {
  # Only this script's own Valkey build (its own process group), if it still runs.
  if [ -n "$VALKEY_PID" ] && kill -0 "$VALKEY_PID" 2>/dev/null; then
    kill -- "-$VALKEY_PID" 2>/dev/null || true
  fi
  # The tests on Valkey beside the others, when another crate's failed first.
  if [ -n "$VALKEY_PASS_PID" ] && kill -0 "$VALKEY_PASS_PID" 2>/dev/null; then
    kill -- "-$VALKEY_PASS_PID" 2>/dev/null || true
  fi
  rm -f "$VALKEY_OUT"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
setsid nice -n 19 scripts/valkey.sh >"$VALKEY_OUT" &
VALKEY_PID=$!

# --- the tests -----------------------------------------------------------------
# Compiled first, so that Valkey's build overlaps the compile and the tests
# then run on a quiet machine (several tests bound their own timing).
compile_tests
took "compiling the tests"
wait "$VALKEY_PID" || { VALKEY_PID=; die "scripts/valkey.sh failed (above): the Valkey tests need Valkey >= 9"; }
VALKEY_PID=
TRL_VALKEY_SERVER=$(tail -n 1 "$VALKEY_OUT")
export TRL_VALKEY_SERVER
say "TRL_VALKEY_SERVER=$TRL_VALKEY_SERVER"
took "waiting for Valkey"

# Every crate of the workspace, with every feature; the default two test
# threads (with four, failover, join-bound and cluster tests missed their
# time bounds here).
#
# The main crate's tests run again with Valkey 9 wherever they start a
# `redis-server` (the cluster and sentinel fixtures too): the lease calls
# take the native road (`DELIFEQ`, `SET … IFEQ`) there, the script road on
# Redis 7, and every guarantee is checked on both. That pass runs beside
# the other crates' tests (they wait on PostgreSQL and on servers, not on
# the CPU: the Valkey pass used 26 s of CPU in 92 s here), its output kept
# and printed when it ends.
#
# One test of that pass runs on its own after it: 1,000 concurrent requests
# during a hang, each answered within the deadline plus a margin, measured
# on the shared 2 cores. Beside the other crates' tests it once took 1.06 s
# where it takes 0.22-0.26 s alone and 0.23-0.38 s with both cores busy
# (`yes` twice), with this code and before it alike: the bound is the
# layer's, not the neighbours'.
HEAVY=faults::hung_redis_1000_concurrent_requests_bounded_without_leaks
SKIP=(--skip "$HEAVY")
case " $* " in *" -- "*) ;; *) SKIP=(-- "${SKIP[@]}") ;; esac
VALKEY_PASS_LOG=$(mktemp)
for crate in $CRATES; do
  cargo test -p "$crate" --all-features "$@"
  took "cargo test -p $crate --all-features"
  if [ "$crate" = tower-redis-lock ]; then
    TRL_TEST_SERVER=valkey setsid cargo test -p tower-redis-lock --all-features --lib --test it "$@" "${SKIP[@]}" \
      >"$VALKEY_PASS_LOG" 2>&1 &
    VALKEY_PASS_PID=$!
  fi
done
if [ -n "$VALKEY_PASS_PID" ]; then
  if ! wait "$VALKEY_PASS_PID"; then
    cat "$VALKEY_PASS_LOG"
    VALKEY_PASS_PID=
    die "the main crate's tests on Valkey (TRL_TEST_SERVER=valkey) failed (above)"
  fi
  VALKEY_PASS_PID=
  grep -E '^test result|^     Running' "$VALKEY_PASS_LOG" || true
  took "the main crate's tests on Valkey (TRL_TEST_SERVER=valkey), beside the others"
  if [ $# -eq 0 ]; then
    TRL_TEST_SERVER=valkey cargo test -p tower-redis-lock --all-features --test it -- --exact "$HEAVY"
    took "$HEAVY on Valkey, alone"
  fi
fi
rm -f "$VALKEY_PASS_LOG"

cargo test "${NO_TLS[@]}" -- --exact tls_url_without_the_tls_feature_is_refused_before_a_byte
took "the no-TLS test"
say "all tests passed in $((SECONDS - STARTED)) s"
