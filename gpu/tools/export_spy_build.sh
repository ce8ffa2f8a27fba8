#!/usr/bin/env bash
# Builds export_spy.c into OUT_DIR/libcuda.so.1 (a diagnostic interposer, not part of Remora).
# Every symbol the real driver exports and export_spy.c does not define is forwarded by a
# generated `jmp` trampoline, so programs that look driver symbols up by name still find them.
#   gpu/tools/export_spy_build.sh REAL_LIBCUDA OUT_DIR
set -euo pipefail
real=${1:?usage: export_spy_build.sh REAL_LIBCUDA OUT_DIR}
out=${2:?usage: export_spy_build.sh REAL_LIBCUDA OUT_DIR}
src=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
own="cuGetExportTable cuGetProcAddress_v2 cuGetProcAddress cuInit cuDriverGetVersion"
names=$(nm -D --defined-only "$real" | awk '$2 == "T" || $2 == "t" {print $3}' | sed 's/@.*//' | sort -u |
        grep -vxF -f <(tr ' ' '\n' <<< "$own"))
{
  echo '.text'
  for n in $names; do printf '.globl %s\n.type %s,@function\n%s: jmp *fwd_%s(%%rip)\n' "$n" "$n" "$n" "$n"; done
  echo '.section .note.GNU-stack,"",@progbits'
  echo '.data'
  for n in $names; do printf '.globl fwd_%s\n.hidden fwd_%s\nfwd_%s: .quad 0\n' "$n" "$n" "$n"; done
} > "$out/forward.S"
{
  echo '#include <dlfcn.h>'
  echo 'void *spy_real_handle(void);'
  for n in $names; do echo "extern void *fwd_$n;"; done
  echo '__attribute__((constructor)) static void spy_forward_init(void) { void *h = spy_real_handle();'
  for n in $names; do echo "  fwd_$n = dlsym(h, \"$n\");"; done
  echo '}'
} > "$out/forward.c"
cc -O1 -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$out/libcuda.so.1" "$src/export_spy.c" "$out/forward.c" "$out/forward.S" -ldl
echo "export_spy: $(wc -w <<< "$names") forwarded symbols"
