#!/bin/sh
# Rebuild the aarch64 vDSO-shaped images (Debian: gcc-aarch64-linux-gnu), one
# per hash table style: the kernel links its vDSO with a SysV hash table only.
set -e
cd "$(dirname "$0")"
for h in sysv gnu; do
    aarch64-linux-gnu-gcc -nostdlib -shared -fPIC -Wl,--hash-style=$h \
        -Wl,-T,vdso_aarch64.lds -Wl,-soname=linux-vdso.so.1 -Wl,--build-id=none -s \
        vdso_aarch64.S -o vdso_aarch64_$h.so
done
