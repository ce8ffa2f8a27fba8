#!/usr/bin/env bash
# Builds the GPU test and benchmark programs and their kernel images into BUILD_DIR.
#
#   gpu/build.sh BUILD_DIR
#
# Uses $NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc. Host programs are C++ linked
# with the driver API only (-lcuda, -cudart none); kernels are separate images loaded at run time.
# The runtime-API programs are the exception: runtime_api.cu is built with nvcc's default static
# cudart (runtime_static) and with the shared one (runtime_shared), kernels embedded.
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
# runtime NAME SOURCE [NVCC_ARG...]: a runtime-API program, kernels embedded, linked with nvcc's
# default static cudart (from $cudart_dir, set below, when found)
runtime() {
  local name=$1 source=$2; shift 2
  "$nvcc" -O2 -std=c++17 "${fat[@]}" ${cudart_dir:+-L"$cudart_dir"} -o "$build/$name" "$source" "$@"
}
set -x
# vecadd: the same kernel as cubin, PTX and fatbin
"$nvcc" -cubin -arch=sm_90 -o "$build/vecadd.cubin" "$src/tests/vecadd_kernel.cu"
"$nvcc" -ptx -arch=compute_80 -o "$build/vecadd.ptx" "$src/tests/vecadd_kernel.cu"
"$nvcc" -fatbin "${fat[@]}" -o "$build/vecadd.fatbin" "$src/tests/vecadd_kernel.cu"
# the other kernel modules: fatbins (sm_90 SASS + PTX; cluster kernels need sm_90)
for k in multikernel streams_events occupancy multithread errors devprintf hostfunc; do
  "$nvcc" -fatbin "${fat[@]}" -o "$build/${k}.fatbin" "$src/tests/${k}_kernel.cu"
done
"$nvcc" -fatbin -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
  -o "$build/cluster.fatbin" "$src/tests/cluster_kernel.cu"
"$nvcc" -fatbin "${fat[@]}" -o "$build/driver_bench.fatbin" "$src/bench/driver_bench_kernel.cu"
for p in vecadd multikernel streams_events memcpy_sweep memcpy2d3d occupancy cluster multithread errors devprintf hostfunc; do
  host "$p" "$src/tests/$p.cpp"
done
host driver_bench "$src/bench/driver_bench.cpp"
# runtime-API programs: the CUDA runtime dlopens libcuda.so.1 itself (no -lcuda). The shared
# cudart is linked from nvcc's own library directory (NVIDIA's wheels ship only
# libcudart.so.13, without the unversioned name that -cudart shared needs), with an rpath.
cudart_dir=
for d in "$(dirname "$nvcc")/../lib64" "$(dirname "$nvcc")/../lib"; do
  if ls "$d"/libcudart* >/dev/null 2>&1; then cudart_dir=$(cd "$d" && pwd); break; fi
done
runtime runtime_static "$src/tests/runtime_api.cu"
if [ -n "$cudart_dir" ] && [ ! -e "$cudart_dir/libcudart.so" ]; then
  shared=(-cudart none -L"$cudart_dir" -l:libcudart.so.13 -Xlinker -rpath="$cudart_dir")
else
  shared=(-cudart shared ${cudart_dir:+-Xlinker -rpath="$cudart_dir"})
fi
"$nvcc" -O2 -std=c++17 "${fat[@]}" "${shared[@]}" -o "$build/runtime_shared" "$src/tests/runtime_api.cu"
# the other runtime-API test programs, one gpu/tests/NAME.cu each:
#   graphs: CUDA graphs through stream capture
#   async_visibility: every byte of async device-to-host copies at each completion point
#   mapped_memory: mapped (zero-copy) host memory through device and host pointers
#   mapped_default: cudaMallocHost memory used as mapped memory (default flags)
#   managed_memory: cudaMallocManaged with host and kernel turns, copies, memsets, hints, attributes
#   stream_ordered: cudaMallocAsync/cudaFreeAsync on several streams, memory pools, graph memory nodes
#   graph_memory: memory allocation/free nodes, memcpy nodes and captured copies of pageable memory
#   explicit_graphs: graphs built node by node (kernel, memset, memcpy, host, child, event nodes),
#     exec set-params, update, clone
#   device_props: every cudaDeviceProp field, function attributes, occupancy, cooperative launch
for p in graphs async_visibility mapped_memory mapped_default managed_memory stream_ordered \
  graph_memory explicit_graphs device_props; do
  runtime "$p" "$src/tests/$p.cu"
done
# explicit_graphs_pinned: explicit_graphs plus memcpy nodes with pinned host sides
runtime explicit_graphs_pinned "$src/tests/explicit_graphs.cu" -DPINNED_NODES
# vmm: virtual memory management (expandable segments, aliasing), driver API in a runtime program
runtime vmm "$src/tests/vmm.cu" "${link[@]}"
# runtime-API samples (gpu/samples), built like any CUDA program: nvcc's default static cudart
for p in matmul histogram lu_solve bandwidth streams_overlap; do
  runtime "$p" "$src/samples/$p.cu"
done
# libraries: cuBLAS, cuRAND, cuFFT, cuSOLVER linked normally (skipped when nvcc's toolkit has
# no cuBLAS, e.g. the CUDA wheels used for link checks in CI)
libdir=$(cd "$(dirname "$nvcc")/.." && pwd)/lib64
if ls "$libdir"/libcublas.so* >/dev/null 2>&1; then
  "$nvcc" -O2 -std=c++17 -o "$build/libraries" "$src/tests/libraries.cu" -L"$libdir" \
    -lcublas -lcublasLt -lcufft -lcurand -lcusolver -Xlinker -rpath="$libdir"
  "$nvcc" -O2 -std=c++17 "${fat[@]}" -o "$build/cublas_simple" "$src/samples/cublas_simple.cu" \
    -L"$libdir" -lcublas -lcublasLt -Xlinker -rpath="$libdir"
else
  echo "libraries: no cuBLAS beside $nvcc; not built" >&2
fi
