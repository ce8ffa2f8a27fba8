#!/usr/bin/env bash
# Builds the GPU test and benchmark programs and their kernel images into BUILD_DIR.
#
#   gpu/build.sh BUILD_DIR
#
# Uses $NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc. Host programs are C++ linked
# with the driver API only (-lcuda, -cudart none); kernels are separate images loaded at run time.
# With REMORA_LINK_CHECK=1 (machines without libcuda) the host link ignores unresolved symbols.
set -euo pipefail
build=${1:?usage: build.sh BUILD_DIR}
src=$(cd "$(dirname "$0")" && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
mkdir -p "$build"
link=(-lcuda -lpthread)
[ "${REMORA_LINK_CHECK:-0}" = 1 ] && link=(-lpthread -Xlinker --unresolved-symbols=ignore-all)
fat=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90)
host() { # name source
  "$nvcc" -O2 -std=c++17 -cudart none -Xcompiler -Wall -o "$build/$1" "$2" "${link[@]}"
}
set -x
# vecadd: the same kernel as cubin, PTX and fatbin
"$nvcc" -cubin -arch=sm_90 -o "$build/vecadd.cubin" "$src/tests/vecadd_kernel.cu"
"$nvcc" -ptx -arch=compute_80 -o "$build/vecadd.ptx" "$src/tests/vecadd_kernel.cu"
"$nvcc" -fatbin "${fat[@]}" -o "$build/vecadd.fatbin" "$src/tests/vecadd_kernel.cu"
# the other kernel modules: fatbins (sm_90 SASS + PTX; cluster kernels need sm_90)
for k in multikernel streams_events occupancy multithread errors devprintf; do
  "$nvcc" -fatbin "${fat[@]}" -o "$build/${k}.fatbin" "$src/tests/${k}_kernel.cu"
done
"$nvcc" -fatbin -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
  -o "$build/cluster.fatbin" "$src/tests/cluster_kernel.cu"
"$nvcc" -fatbin "${fat[@]}" -o "$build/driver_bench.fatbin" "$src/bench/driver_bench_kernel.cu"
for p in vecadd multikernel streams_events memcpy_sweep memcpy2d3d occupancy cluster multithread errors devprintf; do
  host "$p" "$src/tests/$p.cpp"
done
host driver_bench "$src/bench/driver_bench.cpp"
