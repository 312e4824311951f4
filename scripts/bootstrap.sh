#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine of this kind:
# system packages (redis-server, prometheus for promtool, chromium for the docs page test), a virtualenv in .venv, and the package with its dev extra.
# Java 17+ and Maven must already be there (they resolve and run the Kafka broker).
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in java mvn python3; do
  command -v "$tool" >/dev/null || { echo "error: '$tool' is missing: the local stack needs a JDK 17+, Maven and Python 3.11+" >&2; exit 1; }
done

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v promtool >/dev/null || missing+=(prometheus)   # promtool tests the alert rules
command -v chromium >/dev/null || missing+=(chromium)     # a real browser loads the API's offline docs page
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "error: missing system packages: ${missing[*]} (install them, or set REDIS_URL)" >&2; exit 1
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=".venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "installing Python dependencies into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev]'
  rm -f .venv/.installed-*; touch "$stamp"
fi
