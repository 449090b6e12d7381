#!/usr/bin/env bash
# Run `edgelite node` on an Android phone as a service: started when the phone boots, kept
# awake, restarted when it exits, its output kept in a log.
#
#   bash termux_service.sh [--port 7070] [--memory-mb N] [--name NAME] [--data-dir DIR]
#   bash termux_service.sh --remove
#
# Needs the Termux:Boot app (from F-Droid, opened once) for the start at boot; without it the
# service starts when Termux opens. It installs termux-services (runit), writes the service
# $PREFIX/var/service/edgelite-node (runit restarts it a second after it exits; its log is
# $PREFIX/var/log/sv/edgelite-node/current) and ~/.termux/boot/start-edgelite (takes the
# wake lock, starts the services). The cluster token is kept in ~/.edgelite/token (readable by
# this user only): $EDGELITE_TOKEN when set, else the one kept there, else a new one, printed.
# Running it again rewrites the service with the new options and restarts it. --remove stops
# the service and deletes both files (the token and the models stay).
set -euo pipefail

port=7070
extra=()
remove=0
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="$2"; shift ;;
    --memory-mb|--name|--data-dir) extra+=("$1" "$2"); shift ;;
    --remove) remove=1 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "termux_service.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$port" in
  ''|*[!0-9]*) echo "termux_service.sh: --port $port is not a port number" >&2; exit 2 ;;
esac

prefix="${PREFIX:?termux_service.sh runs in Termux (PREFIX is not set)}"
service="$prefix/var/service/edgelite-node"
boot="$HOME/.termux/boot/start-edgelite"

if [ "$remove" = 1 ]; then
  if command -v sv >/dev/null 2>&1 && [ -d "$service" ]; then
    sv down edgelite-node || true
  fi
  rm -rf "$service" "$boot"
  echo "edgelite-node service removed (its log stays in $prefix/var/log/sv/edgelite-node)."
  exit 0
fi

if ! command -v sv-enable >/dev/null 2>&1; then
  pkg install -y termux-services
fi
if ! command -v edgelite >/dev/null 2>&1; then
  echo "termux_service.sh: edgelite is not installed: run termux_setup.sh first" >&2
  exit 1
fi

tokens="$HOME/.edgelite/token"
mkdir -p "$HOME/.edgelite"
if [ -n "${EDGELITE_TOKEN:-}" ]; then
  (umask 077; printf '%s\n' "$EDGELITE_TOKEN" > "$tokens")
elif [ ! -s "$tokens" ]; then
  (umask 077; python -c 'import secrets; print(secrets.token_urlsafe(24))' > "$tokens")
  echo "a new cluster token is in $tokens: $(cat "$tokens")"
  echo "give every node and the client the same one (EDGELITE_TOKEN)"
fi
chmod 600 "$tokens"

args=""
if [ ${#extra[@]} -gt 0 ]; then
  args=$(printf ' %q' "${extra[@]}")
fi
mkdir -p "$service/log" "$prefix/var/log/sv/edgelite-node"
{
  echo '#!/data/data/com.termux/files/usr/bin/sh'
  echo '# written by termux_service.sh: edgelite node, restarted by runit when it exits'
  echo 'exec 2>&1'
  echo "EDGELITE_TOKEN=\"\$(cat '$tokens')\" exec edgelite node --host 0.0.0.0 --port $port --plain$args"
} > "$service/run"
chmod 755 "$service/run"
ln -sf "$prefix/share/termux-services/svlogger" "$service/log/run"

mkdir -p "$(dirname "$boot")"
{
  echo '#!/data/data/com.termux/files/usr/bin/sh'
  echo '# written by termux_service.sh: at boot, keep the phone awake and start the services'
  echo 'termux-wake-lock'
  echo '. "$PREFIX/etc/profile"'
} > "$boot"
chmod 755 "$boot"

sv-enable edgelite-node
sv restart edgelite-node 2>/dev/null || true
echo "edgelite-node runs as a service on port $port (restarted when it exits, started at boot)."
echo "  status:  sv status edgelite-node"
echo "  log:     tail -f $prefix/var/log/sv/edgelite-node/current"
echo "  stop:    sv down edgelite-node    (remove: bash termux_service.sh --remove)"
