#!/usr/bin/env bash
# Builds the libtirpc C peers for rpctest.x with Debian's rpcgen: build.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUT_DIR}
mkdir -p "$out"
cp "$here/../x/rpctest.x" "$out/"
cd "$out"
rpcgen -N -M -h -o rpctest.h rpctest.x
rpcgen -N -M -c -o rpctest_xdr.c rpctest.x
rpcgen -N -M -l -o rpctest_clnt.c rpctest.x
rpcgen -N -M -m -o rpctest_svc.c rpctest.x
cflags="-O2 -g -w -I/usr/include/tirpc -I$here -I."
cc $cflags -o rpctest_server rpctest_svc.c rpctest_xdr.c "$here/rpctest_server.c" -ltirpc
cc $cflags -o rpctest_client rpctest_clnt.c rpctest_xdr.c "$here/rpctest_client.c" -ltirpc
