#!/usr/bin/env bash
# Set up edgelite on an Android phone in Termux.
#
#   bash termux_setup.sh [--client] [--from SPEC]
#
# Stage nodes need numpy, onnxruntime and msgpack: they come from Termux's own packages (PyPI
# has no Android onnxruntime wheel), with clang to build edgelite's kernels (attention, products,
# norms; the C sources ship in the package) for this phone's CPU, which a node does in the
# background as it starts (flags from the CPU's features: ARMv8.0, dotprod or dotprod + i8mm,
# never SVE; kept for the next start), then edgelite itself without dependencies, so pip never
# tries to build onnxruntime, highspy, uvloop, torch or onnx (planning falls back to the exact
# DP, the event loop to asyncio's own). --client adds what the client phone needs to tokenize
# and render chat templates (tokenizers from the Termux User Repository, jinja2). --from gives
# what pip installs (default: edgelite from PyPI; a wheel or a source folder works too).
# Running it again installs nothing twice. It ends with this phone's LAN address and a ready
# `edgelite node` command.
set -euo pipefail

client=0
spec=edgelite
while [ $# -gt 0 ]; do
  case "$1" in
    --client) client=1 ;;
    --from) spec="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "termux_setup.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

packages=(python python-numpy python-onnxruntime python-msgpack clang)
if [ "$client" = 1 ]; then
  pkg install -y tur-repo  # the Termux User Repository has python-tokenizers
  packages+=(python-tokenizers)
fi
pkg install -y "${packages[@]}"

if ! pip show edgelite >/dev/null 2>&1; then
  pip install --no-deps "$spec"
fi
pip install rich  # pure Python; the CLI's views
if [ "$client" = 1 ]; then
  pip install jinja2  # chat templates
fi

addr=$(python - <<'EOF'
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.connect(("192.0.2.1", 9))  # picks the route to the LAN; sends nothing
    print(s.getsockname()[0])
except OSError:
    print("127.0.0.1")
finally:
    s.close()
EOF
)
echo
echo "edgelite is ready on this phone (LAN address $addr)."
echo "Start a node (the same token on every phone):"
echo "  edgelite node --host 0.0.0.0 --port 7070 --token \"\${EDGELITE_TOKEN:-choose-a-long-secret}\""
echo "The client reaches it as $addr:7070."
