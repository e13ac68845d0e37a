#!/usr/bin/env bash
# A throwaway local PostgreSQL server for the queue tests (Debian's postgresql package).
#   tests/pg_server.sh start   -> prints a SQLAlchemy URL on stdout (empty when none could start)
#   tests/pg_server.sh stop DIR
# Installs the package when it is missing and apt can; runs the server as the 'postgres' user on
# 127.0.0.1 with trust auth, in a temp dir that `stop` removes. Never fails the caller.
set -u
PORT=${WHETSTONE_TEST_PG_PORT:-55439}
find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
case "${1:-}" in
start)
  bin=$(find_bin)
  if [ -z "$bin" ] && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2 || true
    bin=$(find_bin)
  fi
  if [ -z "$bin" ] || ! id postgres >/dev/null 2>&1; then
    echo "pg_server.sh: no PostgreSQL server available; Postgres tests will be skipped" >&2; exit 0
  fi
  dir=$(mktemp -d /tmp/whetstone-pg.XXXXXX); chown postgres "$dir"
  as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
  if as_pg "$bin/initdb" -D "$dir/data" -A trust -U postgres >"$dir/initdb.log" 2>&1 &&
     as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w \
       -o "-p $PORT -k $dir -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null 2>&1; then
    echo "$dir" > /tmp/whetstone-pg.current
    echo "postgresql+psycopg://postgres@127.0.0.1:$PORT/postgres"
  else
    echo "pg_server.sh: PostgreSQL did not start (see $dir); Postgres tests will be skipped" >&2
  fi
  ;;
stop)
  dir=$(cat /tmp/whetstone-pg.current 2>/dev/null) || exit 0
  bin=$(find_bin)
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$bin/pg_ctl" -D "$dir/data" -m fast stop >/dev/null 2>&1
  else "$bin/pg_ctl" -D "$dir/data" -m fast stop >/dev/null 2>&1; fi
  rm -rf "$dir" /tmp/whetstone-pg.current
  ;;
*) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
exit 0
