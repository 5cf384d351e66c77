#!/bin/sh
# Initialises PGDATA on first start (superuser POSTGRES_USER with the password in POSTGRES_PASSWORD_FILE,
# database POSTGRES_DB, scram-sha-256 over TCP), then runs the server as the postgres user.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
mkdir -p "$PGDATA" /var/run/postgresql
chown postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    [ -s "${POSTGRES_PASSWORD_FILE:-}" ] || { echo "POSTGRES_PASSWORD_FILE must name a non-empty file" >&2; exit 1; }
    pwfile=$(mktemp) && cp "$POSTGRES_PASSWORD_FILE" "$pwfile" && chown postgres "$pwfile"
    as_postgres initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust \
        --auth-host=scram-sha-256 --encoding=UTF8 -D "$PGDATA" > /dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.auto.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\";" \
            | as_postgres postgres --single -D "$PGDATA" postgres > /dev/null
    fi
    echo "initialised $PGDATA (user $POSTGRES_USER, database $POSTGRES_DB)"
fi
[ "$1" = postgres ] && exec setpriv --reuid=postgres --regid=postgres --init-groups "$@"
exec "$@"
