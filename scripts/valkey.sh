#!/usr/bin/env bash
# Finds or builds a valkey-server >= 9.0 for the tests (native DELIFEQ and
# SET ... IFEQ), checks it, and prints its path as the last line on stdout
# (everything else goes to stderr):
#
#   export TRL_VALKEY_SERVER=$(scripts/valkey.sh)
#
# Where it comes from, first match wins:
#   1. $TRL_VALKEY_SERVER, if set: it must pass the check below, or this
#      fails (a server you chose is never silently replaced);
#   2. the cached build, ${XDG_CACHE_HOME:-$HOME/.cache}/tower-redis-lock/valkey/bin/;
#   3. `valkey-server` on PATH;
#   4. a new build: Valkey is not packaged for Debian 12 (bookworm) and the
#      `.deb` of Debian's sid needs a newer glibc, so this fetches Debian
#      sid's *source* package (`apt-get source --download-only valkey`, with
#      apt's lists in a private folder: the system's apt setup is not
#      touched and nothing is installed), builds valkey-server and
#      valkey-cli (`make BUILD_TLS=no MALLOC=libc`: no OpenSSL or jemalloc
#      needed, only make and a C compiler; about 4 minutes on 2 cores) and
#      caches the two binaries. Needs apt-get and Debian's archive keyring.
#
# The check, for each candidate: `--version` reports 9.0 or newer, and a
# server started on a private Unix socket answers `DELIFEQ` as Valkey 9
# documents (0 and the key kept for another value, 1 and the key gone for
# its own). A cached build that fails it is rebuilt; a new build that fails
# it is an error. Concurrent runs (CI starts one early) wait for each other.
set -euo pipefail

say() { echo "valkey.sh: $*" >&2; }
die() { echo "valkey.sh: error: $*" >&2; exit 1; }

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tower-redis-lock/valkey"
MIN_MAJOR=9

# check BIN: 0 when BIN is a valkey-server >= 9.0 that answers DELIFEQ right;
# otherwise says why on stderr and returns 1. Starts the server on a Unix
# socket of a temporary folder (no port to collide on) and stops it again.
check() {
  local bin=$1 version major cli dir pid out ok=1
  [ -x "$bin" ] || { say "$bin: not an executable file"; return 1; }
  version=$("$bin" --version 2>/dev/null | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p' | head -1)
  [ -n "$version" ] || { say "$bin: --version printed no v=<version>"; return 1; }
  "$bin" --version 2>/dev/null | grep -qi valkey || { say "$bin: not Valkey ($("$bin" --version 2>&1 | head -1))"; return 1; }
  major=${version%%.*}
  [ "$major" -ge "$MIN_MAJOR" ] || { say "$bin: Valkey $version is older than $MIN_MAJOR.0 (no DELIFEQ)"; return 1; }
  cli="$(dirname "$bin")/valkey-cli"
  [ -x "$cli" ] || cli=$(command -v valkey-cli || command -v redis-cli || true)
  [ -n "$cli" ] || { say "no valkey-cli beside $bin and no valkey-cli or redis-cli on PATH"; return 1; }
  dir=$(mktemp -d)
  "$bin" --port 0 --unixsocket "$dir/s" --unixsocketperm 700 --save "" --appendonly no \
    --dir "$dir" --daemonize no >"$dir/log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    [ "$("$cli" -s "$dir/s" PING 2>/dev/null)" = PONG ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  c() { "$cli" -s "$dir/s" "$@" 2>&1 || true; }
  # Each answer, in order: OK, 0 (another value), 1 (still there), 1 (its own), 0 (gone).
  out="$(c SET trl:probe mine) $(c DELIFEQ trl:probe other) $(c EXISTS trl:probe) $(c DELIFEQ trl:probe mine) $(c EXISTS trl:probe)"
  [ "$out" = "OK 0 1 1 0" ] && ok=0
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  if [ "$ok" -ne 0 ]; then
    say "$bin (Valkey $version): DELIFEQ check failed: answers '$out', expected 'OK 0 1 1 0'"
    tail -n 5 "$dir/log" >&2 || true
  fi
  rm -rf "$dir"
  return "$ok"
}

found() { say "using $1 ($("$1" --version | cut -d' ' -f1-3))"; echo "$1"; exit 0; }

if [ -n "${TRL_VALKEY_SERVER:-}" ]; then
  check "$TRL_VALKEY_SERVER" \
    || die "TRL_VALKEY_SERVER=$TRL_VALKEY_SERVER is not a valkey-server >= $MIN_MAJOR.0 that answers DELIFEQ; unset it to let this script build one"
  found "$TRL_VALKEY_SERVER"
fi

mkdir -p "$CACHE"
# One run at a time: a second run waits here for the first one's build.
exec 9>"$CACHE/lock"
if command -v flock >/dev/null 2>&1; then
  flock -n 9 || { say "another run is building or checking Valkey; waiting for it"; flock 9; }
fi

BIN="$CACHE/bin/valkey-server"
if [ -e "$BIN" ]; then
  check "$BIN" && found "$BIN"
  say "the cached build fails the check: building again"
fi
if command -v valkey-server >/dev/null 2>&1; then
  on_path=$(command -v valkey-server)
  if check "$on_path"; then found "$on_path"; fi
  say "ignoring $on_path on PATH"
fi

# --- build from Debian sid's source package -----------------------------------
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
hint="or install Valkey >= $MIN_MAJOR.0 yourself and set TRL_VALKEY_SERVER=/path/to/valkey-server"
command -v apt-get >/dev/null 2>&1 || die "no valkey-server >= $MIN_MAJOR.0 found and apt-get is missing to fetch Debian's source package: $hint"
[ -r "$KEYRING" ] || die "$KEYRING is missing (Debian: apt-get install debian-archive-keyring): $hint"
for tool in make cc tar; do
  command -v "$tool" >/dev/null 2>&1 || die "building Valkey needs '$tool' (Debian: apt-get install build-essential): $hint"
done

say "no valkey-server >= $MIN_MAJOR.0 found: building one from Debian sid's source package (about 4 minutes on 2 cores; cached in $CACHE)"
STARTED=$SECONDS
WORK="$CACHE/build"
rm -rf "$WORK" "$CACHE/bin.new"
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/apt/parts" "$WORK/src"
cat >"$WORK/apt/parts/sid-src.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: sid
Components: main
Signed-By: $KEYRING
SRC
APT=(-o Dir::Etc::sourcelist=/dev/null -o Dir::Etc::sourceparts="$WORK/apt/parts"
     -o Dir::State::Lists="$WORK/apt/lists" -o Dir::Cache="$WORK/apt/cache")
# As root, apt would download as the `_apt` user, who may not write here.
[ "$(id -u)" -eq 0 ] && APT+=(-o APT::Sandbox::User=root)
apt-get "${APT[@]}" -qq update >&2 || die "apt-get update of Debian sid's source index failed (network?): $hint"
(cd "$WORK/src" && apt-get "${APT[@]}" -qq source --download-only valkey >&2) \
  || die "apt-get source --download-only valkey failed: $hint"
tarball=$(ls "$WORK"/src/valkey_*.orig.tar.* 2>/dev/null | head -1 || true)
[ -n "$tarball" ] || die "no valkey_*.orig.tar.* in $WORK/src after apt-get source"
say "building from $(basename "$tarball")"
tar -C "$WORK/src" -xf "$tarball"
top=$(find "$WORK/src" -mindepth 2 -maxdepth 2 -name Makefile -printf '%h\n' | head -1)
[ -n "$top" ] && [ -d "$top/src" ] || die "no source tree with a Makefile under $WORK/src"
if ! make -C "$top/src" -j"$(nproc 2>/dev/null || echo 2)" BUILD_TLS=no MALLOC=libc \
    valkey-server valkey-cli >"$CACHE/build.log" 2>&1; then
  tail -n 30 "$CACHE/build.log" >&2
  die "make failed (whole log: $CACHE/build.log): $hint"
fi
mkdir -p "$CACHE/bin.new"
cp "$top/src/valkey-server" "$top/src/valkey-cli" "$CACHE/bin.new/"
check "$CACHE/bin.new/valkey-server" \
  || die "the valkey-server just built from $(basename "$tarball") fails the check (is Debian sid's valkey older than $MIN_MAJOR.0?): $hint"
rm -rf "$CACHE/bin"
mv "$CACHE/bin.new" "$CACHE/bin"
rm -rf "$WORK"
say "built in $((SECONDS - STARTED)) s"
found "$BIN"
