#!/usr/bin/env bash
# An aarch64 Python in ROOT for running edgelite under qemu-user on an x86 machine
# (tests/test_arm.py): Debian's arm64 python3.11 and the libraries it needs, unpacked (dpkg -x,
# nothing installed: apt's own state and the host's python3 are untouched), PyPI's aarch64
# onnxruntime 1.29.0, numpy, msgpack and rich (what termux_setup.sh gives a node) in
# ROOT/usr/lib/python3.11/site-packages, and an ARM /proc/cpuinfo in ROOT (onnxruntime reads it
# as it loads). Then:
#   PYTHONPATH=REPO:ROOT/usr/lib/python3.11/site-packages \
#     qemu-aarch64 -cpu max,sme=off -L ROOT ROOT/usr/bin/python3.11 ...
set -euo pipefail
root=$(realpath -m "${1:?usage: arm_python.sh ROOT}")
py=${PYTHON:-python3}
work="$root/.download"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/wheels"
apt=(apt-get -qq -o APT::Architecture=arm64 -o APT::Architectures=arm64 -o Dir::State::Lists="$work/lists"
     -o Dir::Cache="$work/cache" -o Dir::State::status=/dev/null -o Debug::NoLocking=1)
"${apt[@]}" update
(cd "$work/debs" && "${apt[@]}" download python3.11-minimal libpython3.11-minimal libpython3.11-stdlib \
  zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 \
  libdb5.3 libcrypt1 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 \
  libkeyutils1 libc6 libgcc-s1 libstdc++6 2>/dev/null)
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$root"; done
"$py" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.11 \
  --implementation cp --abi cp311 --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
  --platform manylinux_2_17_aarch64 -d "$work/wheels" onnxruntime==1.29.0 numpy msgpack rich
site="$root/usr/lib/python3.11/site-packages"
mkdir -p "$site" "$root/proc"
for wheel in "$work"/wheels/*.whl; do "$py" -m zipfile -e "$wheel" "$site"; done
# one entry per CPU the host has (onnxruntime's cpuinfo matches them with /sys); a Cortex-X2's
"$py" - "$root/proc/cpuinfo" <<'EOF'
import os, sys
entry = ("processor\t: {}\nBogoMIPS\t: 48.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
         "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp i8mm bf16\nCPU implementer\t: 0x41\n"
         "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd48\nCPU revision\t: 0\n\n")
open(sys.argv[1], "w").write("".join(entry.format(i) for i in range(os.cpu_count() or 1)))
EOF
rm -rf "$work"
echo "$root/usr/bin/python3.11"
