#!/usr/bin/env python3
"""List the driver entry points that CUDA's cuda.h declares, for the Remora shim.

Usage: list-entry-points.py INCLUDE_DIR > crates/shim/src/entry_points.txt
       list-entry-points.py INCLUDE_DIR --results   (names from cuda.h; crates/client/src/cu_results.txt
       itself holds the texts captured from NVIDIA's driver by gpu/tools/error_strings.c)

INCLUDE_DIR holds cuda.h and cudaTypedefs.h (CUDA 13.0: the nvidia/cu13/include directory of
NVIDIA's PyPI wheels). The interop headers are read too, because the CUDA runtime asks
cuGetProcAddress for their entry points: cudaGL.h, cudaEGL.h and cudaVDPAU.h (preprocessed
against empty stand-ins for the GL, EGL and VDPAU headers, which the wheels do not ship) with
their *Typedefs.h, and cudaProfilerTypedefs.h. The wheels lack cudaProfiler.h itself; its
entry points (one version each) are taken from the PFN typedefs. The output is committed; crates/shim/build.rs turns it into stubs and the
cuGetProcAddress table, so regenerate it only when moving to a newer cuda.h.

Output lines:
  sym NAME                      every cu* function cuda.h declares, under every spelling
                                (default, __CUDA_API_VERSION_INTERNAL legacy names, and the
                                per-thread default stream _ptds/_ptsz names)
  proc BASE VERSION MODE NAME   cuGetProcAddress: BASE requested with cudaVersion >= VERSION
                                resolves to the symbol NAME; MODE is "legacy" or "ptds"
                                (per-thread default stream). Derived from cudaTypedefs.h's
                                PFN_<BASE>_v<VERSION>[_ptds|_ptsz] typedefs: the k-th oldest
                                non-per-thread version is BASE, BASE_v2, ...; a per-thread
                                typedef names the per-thread spelling of the symbol current at
                                its version.
"""
import os
import re
import subprocess
import sys
import tempfile

# Headers that declare driver entry points, and the typedef files that version them.
HEADERS = ["cuda.h", "cudaGL.h", "cudaEGL.h", "cudaVDPAU.h", "cudaProfiler.h"]
TYPEDEFS = ["cudaTypedefs.h", "cudaGLTypedefs.h", "cudaEGLTypedefs.h", "cudaVDPAUTypedefs.h",
            "cudaProfilerTypedefs.h"]
# Third-party headers the interop headers include; empty stand-ins are enough to find names.
STAND_INS = ["GL/gl.h", "EGL/egl.h", "EGL/eglext.h", "vdpau/vdpau.h"]


def declared(include, defines, header, stand_ins):
    cmd = ["cc", "-E", "-P", *defines, "-I", include, "-I", stand_ins, f"{include}/{header}"]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    text = " ".join(text.split())
    return set(re.findall(r"CUresult\s+(?:CUDAAPI\s+)?(cu[A-Za-z0-9_]+)\s*\(", text))


def main():
    include = sys.argv[1]
    names = set()
    typedefs = ""
    with tempfile.TemporaryDirectory() as stand_ins:
        for h in STAND_INS:
            os.makedirs(os.path.dirname(f"{stand_ins}/{h}"), exist_ok=True)
            open(f"{stand_ins}/{h}", "w").close()
        for header in HEADERS:
            if not os.path.exists(f"{include}/{header}"):
                continue
            for defines in ([], ["-D__CUDA_API_VERSION_INTERNAL"],
                            ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"]):
                names |= declared(include, defines, header, stand_ins)
    for t in TYPEDEFS:
        typedefs += open(f"{include}/{t}").read()
    if not os.path.exists(f"{include}/cudaProfiler.h"):
        names |= set(re.findall(r"PFN_(cuProfiler[A-Za-z]+)_v\d+\)", typedefs))
    versions = {}  # base -> {"legacy": [v...], "ptds": [(v, suffix)...]}
    for base, ver, suffix in re.findall(
        r"PFN_(cu[A-Za-z0-9]+)_v(\d+)(_ptds|_ptsz)?\)", typedefs
    ):
        entry = versions.setdefault(base, {"legacy": set(), "ptds": set()})
        if suffix:
            entry["ptds"].add((int(ver), suffix))
        else:
            entry["legacy"].add(int(ver))
    procs = []
    problems = []
    for base in sorted(versions):
        legacy = sorted(versions[base]["legacy"])
        spelled = {}
        for k, ver in enumerate(legacy):
            sym = base if k == 0 else f"{base}_v{k + 1}"
            spelled[ver] = sym
            if sym not in names:
                problems.append(f"{base} v{ver}: {sym} is not declared")
                continue
            procs.append((base, ver, "legacy", sym))
        for ver, suffix in sorted(versions[base]["ptds"]):
            current = [v for v in legacy if v <= ver]
            sym = (spelled[current[-1]] if current else base) + suffix
            if sym not in names:
                problems.append(f"{base} v{ver}{suffix}: {sym} is not declared")
                continue
            procs.append((base, ver, "ptds", sym))
    # Declared names that no typedef reaches are still resolvable by their own name.
    reached = {p[3] for p in procs}
    for sym in sorted(names - reached):
        if re.search(r"_(ptds|ptsz)$", sym):
            continue
        base = re.sub(r"_v\d+$", "", sym)
        if base == sym and sym not in versions:
            procs.append((sym, 0, "legacy", sym))
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    print("# Generated by crates/shim/tools/list-entry-points.py from CUDA 13.0 cuda.h, cudaGL.h, cudaEGL.h,")
    print("# cudaVDPAU.h and their *Typedefs.h, and cudaProfilerTypedefs.h.")
    print("# Do not edit; rerun the script. Format: see the script's docstring.")
    for sym in sorted(names):
        print(f"sym {sym}")
    for base, ver, mode, sym in procs:
        print(f"proc {base} {ver} {mode} {sym}")


def results(include):
    """Every CUresult: CODE NAME first sentence of its cuda.h comment (for cuGetErrorString)."""
    text = open(f"{include}/cuda.h").read()
    body = text[text.index("typedef enum cudaError_enum {"):]
    body = body[: body.index("} CUresult;")]
    print("# Generated by crates/shim/tools/list-entry-points.py --results from CUDA 13.0 cuda.h. Do not edit.")
    for comment, name, code in re.findall(r"/\*\*(.*?)\*/\s*(CUDA_[A-Z0-9_]+)\s*=\s*(\d+)", body, re.S):
        words = " ".join(w for w in comment.replace("*", " ").split())
        words = re.sub(r"::(\w+)\(\)", r"\1()", words).replace("::", "")
        sentence = re.split(r"(?<=[a-z0-9)])\. ", words + " ")[0].strip().rstrip(".")
        print(f"{code} {name} {sentence}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--results":
        results(sys.argv[1])
    else:
        main()
