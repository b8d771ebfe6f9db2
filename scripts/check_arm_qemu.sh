#!/usr/bin/env bash
# Runs our kernels' NEON build (hyflash.kernels, for 64-bit Arm Linux) on an x86-64 Debian/Ubuntu machine, under QEMU
# user-mode emulation: a Debian arm64 chroot with Python, the aarch64 torch wheel and this checkout, then
#   1. the kernel tests (tests/test_kernels.py, tests/test_native.py: every test once on the NEON build, including the
#      reference-bits test, which must reproduce the AVX-512 BF16 build's bits), and
#   2. benchmarks/check_identity.py on SmolLM2 in bf16 (greedy speculative decoding against plain decoding).
# Emulation checks results, not speed (it runs ~50x slower than an Arm CPU would).
#
# Needs root (binfmt_misc, chroot, bind mounts), apt and network for the packages. The first run takes about an hour
# on 2 cores (the chroot, pip and the kernels' build are emulated); later runs reuse ROOT.
#
#   sudo bash scripts/check_arm_qemu.sh [ROOT]    (default ROOT: /var/tmp/hyflash-arm64; output: ROOT/src/arm-check.log)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:-/var/tmp/hyflash-arm64}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends qemu-user-static binfmt-support debootstrap
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  update-binfmts --enable qemu-aarch64
fi
interpreter=$(sed -n 's/^interpreter //p' /proc/sys/fs/binfmt_misc/qemu-aarch64)

if [ ! -x "$ROOT/usr/bin/python3" ]; then
  debootstrap --arch=arm64 --foreign --variant=minbase \
    --include=python3,python3-venv,python3-dev,g++,ca-certificates bookworm "$ROOT" "$MIRROR"
  mkdir -p "$ROOT$(dirname "$interpreter")"
  cp "$interpreter" "$ROOT$interpreter"  # binfmt without the F flag looks the interpreter up inside the chroot
  chroot "$ROOT" /debootstrap/debootstrap --second-stage
fi

# torch's CPU detection (oneDNN's xbyak_aarch64, cpuinfo) reads the Arm identification registers from /sys and
# /proc/cpuinfo; the x86 host's have none and the import crashes. A 2-core Neoverse-N1-like description instead.
fake="$ROOT/../$(basename "$ROOT")-sys"
if [ ! -d "$fake/devices/system/cpu" ]; then
  for c in 0 1; do
    d="$fake/devices/system/cpu/cpu$c"
    mkdir -p "$d/regs/identification" "$d/topology"
    echo 0x00000000413fd0c1 > "$d/regs/identification/midr_el1"
    echo 0 > "$d/topology/physical_package_id"
    echo $c > "$d/topology/core_id"
    for spec in "0 1 Data 64K 4 256" "1 1 Instruction 64K 4 256" "2 2 Unified 1024K 8 2048"; do
      read -r i level type size ways sets <<< "$spec"
      mkdir -p "$d/cache/index$i"
      echo "$level" > "$d/cache/index$i/level"; echo "$type" > "$d/cache/index$i/type"
      echo "$size" > "$d/cache/index$i/size"; echo 64 > "$d/cache/index$i/coherency_line_size"
      echo "$ways" > "$d/cache/index$i/ways_of_associativity"; echo "$sets" > "$d/cache/index$i/number_of_sets"
      echo $c > "$d/cache/index$i/shared_cpu_list"
    done
  done
  for f in possible present online; do echo 0-1 > "$fake/devices/system/cpu/$f"; done
  for c in 0 1; do
    printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' $c
  done > "$fake/cpuinfo"
fi
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
mountpoint -q "$ROOT/sys" || { mkdir -p "$ROOT/sys"; mount --bind "$fake" "$ROOT/sys"; }
mount | grep -q " $ROOT/proc/cpuinfo " || mount --bind "$fake/cpuinfo" "$ROOT/proc/cpuinfo"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"

# this checkout (tracked and untracked, not ignored files), fresh each run
rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$ROOT/src"
commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo "+changes")

chroot "$ROOT" /bin/bash -c "
set -euo pipefail
export PIP_CERT=/etc/ssl/certs/ca-certificates.crt
cd /src
[ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
. /opt/venv/bin/activate
python -c 'import hyflash, pytest' 2>/dev/null || bash scripts/install.sh dev
{
  echo \"# \$(date -u '+%Y-%m-%d %H:%M') UTC | QEMU user emulation of aarch64 (uname -m: \$(uname -m)) on an x86-64 host, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) | commit $commit\"
  python -c 'from hyflash import kernels; print(\"# kernels.builds():\", kernels.builds(), \"isa:\", kernels.isa())'
  python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_native.py 2>&1 | tail -n 15 || true
  python -u benchmarks/check_identity.py --dtypes bf16 --max-new-tokens \${MAX_NEW_TOKENS:-32}
} 2>&1 | tee /src/arm-check.log
"
echo "written: $ROOT/src/arm-check.log"
