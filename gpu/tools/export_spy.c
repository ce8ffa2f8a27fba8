// export_spy: a diagnostic libcuda.so.1 for the GPU host, used to learn how the CUDA libraries'
// static runtimes use private driver tables that Remora does not implement yet. It is NOT part
// of Remora: it forwards to the real driver (SPY_REAL_LIBCUDA, default
// /usr/lib/x86_64-linux-gnu/libcuda.so.1) and logs, to stderr, every call into the tables named
// below, with the six integer-register arguments, the return value and 64 bytes behind each
// argument that is a readable pointer (before and after the call), plus 128 bytes behind any
// pointer the call stored through an argument.
//
//   gpu/tools/export_spy_build.sh /path/to/real/libcuda.so.1 spy
//   SPY_REAL_LIBCUDA=/path/to/real/libcuda.so.1 LD_LIBRARY_PATH=spy ./library_probe 2> spy.log
//
// The runtime finds its entry points through cuGetProcAddress; the build script adds a
// forwarding trampoline for every other symbol of the real driver.
// SPY_TABLES names the tables to wrap (default TOOLS_CONTEXT,TOOLS_MODULE); SPY_REFUSE lists
// UUID prefixes to refuse, as Remora does.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

typedef int CUresult;
typedef struct { unsigned char b[16]; } uuid_t16;
typedef uint64_t (*slot_fn)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);

static void *real;
void *spy_real_handle(void) {
  if (!real) {
    const char *p = getenv("SPY_REAL_LIBCUDA");
    real = dlopen(p ? p : "/usr/lib/x86_64-linux-gnu/libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!real) { fprintf(stderr, "SPY: cannot load the real driver: %s\n", dlerror()); abort(); }
  }
  return real;
}
static void *sym(const char *name) {
  void *f = dlsym(spy_real_handle(), name);
  if (!f) fprintf(stderr, "SPY: real driver lacks %s\n", name);
  return f;
}

#define NSLOTS 128
struct spied { const char *name; unsigned char uuid[16]; slot_fn orig[NSLOTS]; void *copy[NSLOTS]; size_t n; };
static struct spied tables[] = {
  {"TOOLS_CONTEXT", {0x21,0x31,0x8c,0x60,0x97,0x14,0x32,0x48,0x8c,0xa6,0x41,0xff,0x73,0x24,0xc8,0xf2}},
  {"TOOLS_MODULE", {0x6e,0x16,0x3f,0xbe,0xb9,0x58,0x44,0x4d,0x83,0x5c,0xe1,0x82,0xaf,0xf1,0x99,0x1e}},
  {"F8CFF951", {0xf8,0xcf,0xf9,0x51,0x21,0x46,0x8b,0x4e,0xb9,0xe2,0xfb,0x46,0x9e,0x7c,0x0d,0xd9}},
  {"TOOLS_TLS", {0x42,0xd8,0x5a,0x81,0x23,0xf6,0xcb,0x47,0x82,0x98,0xf6,0xe7,0x8a,0x3a,0xec,0xdc}},
  // asked for by cuBLASLt (bf16 GEMM); 0x88 bytes on driver 580
  {"1734DC26", {0x17,0x34,0xdc,0x26,0x80,0x0d,0x47,0x45,0x87,0x26,0xc0,0xf1,0xe7,0xdd,0x8b,0xca}},
  {"69A28E9F", {0x69,0xa2,0x8e,0x9f,0x24,0x49,0x8b,0x47,0xb0,0x30,0xc5,0xda,0x33,0x0e,0xa4,0xe9}},
};
#define NTABLES (sizeof tables / sizeof tables[0])

static int readable(uint64_t a, void *buf, size_t n) {
  if (a < 0x10000 || a > 0x7fffffffffffULL) return 0;
  struct iovec l = {buf, n}, r = {(void *)a, n};
  return process_vm_readv(getpid(), &l, 1, &r, 1, 0) == (ssize_t)n;
}
static void dump(const char *what, int i, uint64_t a, size_t n) {
  uint64_t w[32];
  if (n > sizeof w) n = sizeof w;
  if (!readable(a, w, n)) return;
  fprintf(stderr, "SPY     %s arg%d @%#" PRIx64 ":", what, i, a);
  for (size_t k = 0; k < n / 8; k++) fprintf(stderr, " %" PRIx64, w[k]);
  fprintf(stderr, "\n");
}

// Dumps 64 bytes behind every readable word of the 64 bytes behind each argument.
static void deep(const char *what, const uint64_t *a) {
  for (int i = 0; i < 6; i++) {
    uint64_t w[8];
    if (!readable(a[i], w, sizeof w)) continue;
    for (int k = 0; k < 8; k++) {
      char tag[32];
      snprintf(tag, sizeof tag, "%s deep%d.%d", what, i, k);
      dump(tag, i, w[k], 64);
    }
  }
}
static const char *override(int t, int s) {
  static char buf[64];
  const char *o = getenv("SPY_OVERRIDE");
  char key[48];
  snprintf(key, sizeof key, "%s:%d=", tables[t].name, s);
  const char *m = o ? strstr(o, key) : NULL;
  if (!m) return NULL;
  m += strlen(key);
  size_t n = strcspn(m, ",; ");
  if (n >= sizeof buf) n = sizeof buf - 1;
  memcpy(buf, m, n);
  buf[n] = 0;
  return buf;
}

static uint64_t call(int t, int s, uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5) {
  uint64_t a[6] = {a0, a1, a2, a3, a4, a5};
  fprintf(stderr, "SPY %s[%d](%#" PRIx64 ", %#" PRIx64 ", %#" PRIx64 ", %#" PRIx64 ", %#" PRIx64 ", %#" PRIx64 ")\n",
          tables[t].name, s, a0, a1, a2, a3, a4, a5);
  for (int i = 0; i < 6; i++) dump("pre ", i, a[i], 64);
  if (getenv("SPY_DEEP")) deep("pre ", a);
  // SPY_OVERRIDE="NAME:SLOT=MODE,...": instead of the driver's slot, MODE noop (return 0),
  // fail (return 801) or nullout (store NULL through the first two arguments, return 0).
  const char *mode = override(t, s);
  uint64_t r;
  if (!mode) r = tables[t].orig[s](a0, a1, a2, a3, a4, a5);
  else if (!strcmp(mode, "fail")) r = 801;
  else {
    if (!strcmp(mode, "nullout")) { if (readable(a0, &r, 8)) *(uint64_t *)a0 = 0; if (readable(a1, &r, 8)) *(uint64_t *)a1 = 0; }
    r = 0;
  }
  if (mode) fprintf(stderr, "SPY   (overridden: %s)\n", mode);
  if (getenv("SPY_DEEP")) deep("post", a);
  fprintf(stderr, "SPY   -> %#" PRIx64 " (%d)\n", r, (int)r);
  for (int i = 0; i < 6; i++) {
    dump("post", i, a[i], 64);
    uint64_t p;
    if (readable(a[i], &p, 8)) dump("deref", i, p, 256);
  }
  fflush(stderr);
  return r;
}

#define S(t, s) static uint64_t t##_##s(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e, uint64_t f) { return call(t, s, a, b, c, d, e, f); }
#define S8(t, s) S(t, s##0) S(t, s##1) S(t, s##2) S(t, s##3) S(t, s##4) S(t, s##5) S(t, s##6) S(t, s##7)
#define S64(t) S8(t, 00) S8(t, 01) S8(t, 02) S8(t, 03) S8(t, 04) S8(t, 05) S8(t, 06) S8(t, 07)
#define A(t, s) (void *)t##_##s
#define A8(t, s) A(t, s##0), A(t, s##1), A(t, s##2), A(t, s##3), A(t, s##4), A(t, s##5), A(t, s##6), A(t, s##7)
#define A64(t) A8(t, 00), A8(t, 01), A8(t, 02), A8(t, 03), A8(t, 04), A8(t, 05), A8(t, 06), A8(t, 07)
// Slot s of table t is trampoline t_s, with s written as an octal literal (000..0177 are 0..127).
enum { T0, T1, T2, T3, T4, T5 };
#define SETS(t) S64(t) S8(t, 010) S8(t, 011) S8(t, 012) S8(t, 013) S8(t, 014) S8(t, 015) S8(t, 016) S8(t, 017)
SETS(T0) SETS(T1) SETS(T2) SETS(T3) SETS(T4) SETS(T5)
#define ADDRS(t) {A64(t), A8(t, 010), A8(t, 011), A8(t, 012), A8(t, 013), A8(t, 014), A8(t, 015), A8(t, 016), A8(t, 017)}
static void *tramp[NTABLES][NSLOTS] = {ADDRS(T0), ADDRS(T1), ADDRS(T2), ADDRS(T3), ADDRS(T4), ADDRS(T5)};

CUresult cuGetExportTable(const void **out, const uuid_t16 *id) {
  static CUresult (*f)(const void **, const uuid_t16 *);
  if (!f) f = sym("cuGetExportTable");
  // SPY_REFUSE: a UUID prefix (8 hex digits) answered CUDA_ERROR_NOT_SUPPORTED, as Remora does.
  char hex[9];
  snprintf(hex, sizeof hex, "%02X%02X%02X%02X", id->b[0], id->b[1], id->b[2], id->b[3]);
  const char *refuse = getenv("SPY_REFUSE");
  CUresult r = refuse && strstr(refuse, hex) ? 801 : f(out, id);
  fprintf(stderr, "SPY cuGetExportTable {");
  for (int i = 0; i < 16; i++) fprintf(stderr, "%02X", id->b[i]);
  fprintf(stderr, "} -> %d table %p\n", r, r == 0 ? *out : NULL);
  if (r != 0 || !*out) return r;
  for (size_t t = 0; t < NTABLES; t++) {
    if (memcmp(tables[t].uuid, id->b, 16) != 0) continue;
    const char *only = getenv("SPY_TABLES");  // names to wrap; default the two tools tables
    if (!strstr(only ? only : "TOOLS_CONTEXT,TOOLS_MODULE", tables[t].name)) continue;
    void *const *src = *out;
    size_t n = (size_t)(uintptr_t)src[0] / 8;
    fprintf(stderr, "SPY   %s: first word %#zx (%zu slots if a size)\n", tables[t].name, (size_t)(uintptr_t)src[0], n);
    if (n < 2 || n > NSLOTS) return r;
    if (!tables[t].n) {
      tables[t].n = n;
      tables[t].copy[0] = src[0];
      for (size_t s = 1; s < n; s++) { tables[t].orig[s] = (slot_fn)src[s]; tables[t].copy[s] = tramp[t][s]; }
    }
    *out = tables[t].copy;
  }
  return r;
}

CUresult cuGetProcAddress_v2(const char *name, void **pfn, int ver, uint64_t flags, int *status) {
  static CUresult (*f)(const char *, void **, int, uint64_t, int *);
  if (!f) f = sym("cuGetProcAddress_v2");
  CUresult r = f(name, pfn, ver, flags, status);
  if (r == 0 && name && strcmp(name, "cuGetExportTable") == 0) *pfn = (void *)cuGetExportTable;
  if (r == 0 && name && strcmp(name, "cuGetProcAddress") == 0) *pfn = (void *)cuGetProcAddress_v2;
  return r;
}
CUresult cuGetProcAddress(const char *name, void **pfn, int ver, uint64_t flags, int *status) {
  return cuGetProcAddress_v2(name, pfn, ver, flags, status);
}
CUresult cuInit(unsigned f) { return ((CUresult(*)(unsigned))sym("cuInit"))(f); }
CUresult cuDriverGetVersion(int *v) { return ((CUresult(*)(int *))sym("cuDriverGetVersion"))(v); }
