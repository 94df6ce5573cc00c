#!/bin/sh
# Installs wrk for `cargo bench --bench wrk` (Debian/Ubuntu; as root or with sudo).
set -e
if command -v wrk >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
$SUDO apt-get install -y wrk || { $SUDO apt-get update && $SUDO apt-get install -y wrk; }
