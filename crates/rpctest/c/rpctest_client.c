/*
 * A libtirpc client for rpctest.x, built from rpcgen's stubs (rpcgen -N -M).
 *
 * Usage:
 *   rpctest_client ADDR check [BIG_MIB]     run every check; BIG_MIB (default 64) sizes the big echo
 *   rpctest_client ADDR bench null N       time N null calls
 *   rpctest_client ADDR bench echo BYTES N time N echoes of BYTES bytes
 * ADDR is tcp:HOST:PORT or unix:PATH. Checks print "ok NAME" or "FAIL NAME: why"; the exit
 * status is 0 only if every check passed. Benchmarks print one JSON object.
 */
#include <rpc/rpc.h>
#include <time.h>

#include "rpctest.h"
#include "rpctest_common.h"

static int failures;
static int checks;

#define CHECK(name, cond, ...)                                   \
    do {                                                         \
        checks++;                                                \
        if (cond) {                                              \
            printf("ok %s\n", name);                             \
        } else {                                                 \
            failures++;                                          \
            printf("FAIL %s: ", name);                           \
            printf(__VA_ARGS__);                                 \
            printf("\n");                                        \
        }                                                        \
        fflush(stdout);                                          \
    } while (0)

static CLIENT *connect_client(const char *spec) {
    struct sockaddr_storage ss;
    socklen_t len;
    int one = 1;
    int family = rt_parse_addr(spec, &ss, &len);
    if (family < 0) {
        fprintf(stderr, "bad address %s (want tcp:HOST:PORT or unix:PATH)\n", spec);
        exit(2);
    }
    int fd = socket(family, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&ss, len) < 0) {
        perror("connect");
        exit(1);
    }
    if (family == AF_INET) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct netbuf nb = {len, len, &ss};
    CLIENT *c = clnt_vc_create(fd, &nb, RPCTEST_PROG, RPCTEST_V1, 0, 0);
    if (!c) {
        clnt_pcreateerror("clnt_vc_create");
        exit(1);
    }
    struct timeval tv = {120, 0};
    clnt_control(c, CLSET_TIMEOUT, (char *)&tv);
    return c;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int_list make_list(int n) {
    int_list head = NULL;
    for (int i = n; i >= 1; i--) {
        int_node *node = calloc(1, sizeof *node);
        node->value = i * 10;
        node->next = head;
        head = node;
    }
    return head;
}

static void run_checks(CLIENT *c, unsigned big_mib) {
    enum clnt_stat st;

    st = rt_null_1(NULL, c);
    CHECK("null", st == RPC_SUCCESS, "%s", clnt_sperrno(st));

    int sum = 0;
    st = rt_add_1(40, 2, &sum, c);
    CHECK("add", st == RPC_SUCCESS && sum == 42, "%s sum=%d", clnt_sperrno(st), sum);

    char small[5] = {'h', 'e', 'l', 'l', 'o'};
    rt_blob in = {5, small}, out = {0, NULL};
    st = rt_echo_1(in, &out, c);
    CHECK("echo_small", st == RPC_SUCCESS && out.rt_blob_len == 5 && !memcmp(out.rt_blob_val, small, 5),
          "%s len=%u", clnt_sperrno(st), out.rt_blob_len);
    xdr_free((xdrproc_t)xdr_rt_blob, (char *)&out);

    /* Unions: every arm, including two labels sharing one arm and the default arm. */
    shape s, r;
    memset(&s, 0, sizeof s);
    memset(&r, 0, sizeof r);
    s.kind = SHAPE_CIRCLE;
    s.shape_u.radius = 2.5;
    st = rt_shape_echo_1(s, &r, c);
    CHECK("union_circle", st == RPC_SUCCESS && r.kind == SHAPE_CIRCLE && r.shape_u.radius == 2.5, "%s", clnt_sperrno(st));
    xdr_free((xdrproc_t)xdr_shape, (char *)&r);

    s.kind = SHAPE_RECT;
    s.shape_u.dims.width = 3.0;
    s.shape_u.dims.height = -4.25;
    memset(&r, 0, sizeof r);
    st = rt_shape_echo_1(s, &r, c);
    CHECK("union_rect", st == RPC_SUCCESS && r.kind == SHAPE_RECT && r.shape_u.dims.width == 3.0 && r.shape_u.dims.height == -4.25,
          "%s", clnt_sperrno(st));
    xdr_free((xdrproc_t)xdr_shape, (char *)&r);

    point pts[3] = {{1, 2}, {-3, 4}, {5, -6}};
    s.kind = SHAPE_POINT;
    s.shape_u.pts.pts_len = 3;
    s.shape_u.pts.pts_val = pts;
    memset(&r, 0, sizeof r);
    st = rt_shape_echo_1(s, &r, c);
    CHECK("union_shared_arm", st == RPC_SUCCESS && r.kind == SHAPE_POINT && r.shape_u.pts.pts_len == 3 &&
          r.shape_u.pts.pts_val[1].x == -3 && r.shape_u.pts.pts_val[2].y == -6, "%s", clnt_sperrno(st));
    xdr_free((xdrproc_t)xdr_shape, (char *)&r);

    s.kind = SHAPE_NONE;
    memset(&r, 0, sizeof r);
    st = rt_shape_echo_1(s, &r, c);
    CHECK("union_default", st == RPC_SUCCESS && r.kind == SHAPE_NONE, "%s", clnt_sperrno(st));
    xdr_free((xdrproc_t)xdr_shape, (char *)&r);

    /* Optional data: a linked list of 5, reversed by the server, and an empty list. */
    int_list l = make_list(5), rl = NULL;
    st = rt_list_reverse_1(l, &rl, c);
    int good = st == RPC_SUCCESS;
    int expect = 50;
    int count = 0;
    for (int_node *n = rl; good && n; n = n->next, expect -= 10, count++) good = n->value == expect;
    CHECK("optional_list", good && count == 5, "%s count=%d", clnt_sperrno(st), count);
    xdr_free((xdrproc_t)xdr_int_list, (char *)&rl);
    st = rt_list_sum_1(l, &sum, c);
    CHECK("optional_list_sum", st == RPC_SUCCESS && sum == 150, "%s sum=%d", clnt_sperrno(st), sum);
    xdr_free((xdrproc_t)xdr_int_list, (char *)&l);
    int_list empty = NULL;
    rl = (int_list)1;
    st = rt_list_reverse_1(empty, &rl, c);
    CHECK("optional_empty", st == RPC_SUCCESS && rl == NULL, "%s", clnt_sperrno(st));

    /* Fixed and variable arrays, fixed opaque, bounded string, float/double/hyper. */
    arrays a, ar;
    memset(&a, 0, sizeof a);
    memset(&ar, 0, sizeof ar);
    a.fixed[0] = 1; a.fixed[1] = -2; a.fixed[2] = 3; a.fixed[3] = 2147483647;
    u_quad_t wide[2] = {0xFFFFFFFFFFFFFFFFULL, 42};
    a.wide.wide_len = 2;
    a.wide.wide_val = wide;
    a.names = "abcdefg";
    memcpy(a.tag, "xyz", 3);
    bool_t flags[3] = {TRUE, FALSE, TRUE};
    a.flags.flags_len = 3;
    a.flags.flags_val = flags;
    a.f = 1.5f;
    a.d = -0.125;
    a.h = -1234567890123LL;
    a.u = 4000000000U;
    st = rt_arrays_echo_1(a, &ar, c);
    CHECK("arrays", st == RPC_SUCCESS && ar.fixed[3] == 2147483647 && ar.fixed[1] == -2 && ar.wide.wide_len == 2 &&
          ar.wide.wide_val[0] == 0xFFFFFFFFFFFFFFFFULL && !strcmp(ar.names, "abcdefg") && !memcmp(ar.tag, "xyz", 3) &&
          ar.flags.flags_len == 3 && ar.flags.flags_val[2] == TRUE && ar.f == 1.5f && ar.d == -0.125 &&
          ar.h == -1234567890123LL && ar.u == 4000000000U, "%s", clnt_sperrno(st));
    xdr_free((xdrproc_t)xdr_arrays, (char *)&ar);

    rt_name names[3] = {"alpha", "", "gamma-delta"};
    name_list nl = {{3, names}}, nr;
    memset(&nr, 0, sizeof nr);
    st = rt_names_echo_1(nl, &nr, c);
    CHECK("string_array", st == RPC_SUCCESS && nr.names.names_len == 3 && !strcmp(nr.names.names_val[2], "gamma-delta") &&
          !strcmp(nr.names.names_val[1], ""), "%s", clnt_sperrno(st));
    xdr_free((xdrproc_t)xdr_name_list, (char *)&nr);

    /* The big echo: libtirpc fragments it (65,532-byte fragments) in both directions. */
    size_t big = (size_t)big_mib << 20;
    char *buf = malloc(big);
    for (size_t i = 0; i < big; i++) buf[i] = (char)(i * 7 + (i >> 13));
    in.rt_blob_len = big;
    in.rt_blob_val = buf;
    memset(&out, 0, sizeof out);
    double t0 = now();
    st = rt_echo_1(in, &out, c);
    double dt = now() - t0;
    CHECK("echo_big", st == RPC_SUCCESS && out.rt_blob_len == big && !memcmp(out.rt_blob_val, buf, big),
          "%s len=%u", clnt_sperrno(st), out.rt_blob_len);
    printf("echo_big %u MiB in %.3f s\n", big_mib, dt);
    xdr_free((xdrproc_t)xdr_rt_blob, (char *)&out);
    free(buf);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ADDR check [BIG_MIB] | ADDR bench null N | ADDR bench echo BYTES N\n", argv[0]);
        return 2;
    }
    CLIENT *c = connect_client(argv[1]);
    if (!strcmp(argv[2], "check")) {
        run_checks(c, argc > 3 ? (unsigned)atoi(argv[3]) : 64);
        printf("rpctest_client: %d of %d checks ok\n", checks - failures, checks);
        clnt_destroy(c);
        return failures ? 1 : 0;
    }
    if (!strcmp(argv[2], "bench") && argc >= 5 && !strcmp(argv[3], "null")) {
        long n = atol(argv[4]);
        for (int i = 0; i < 100; i++) rt_null_1(NULL, c); /* warm up */
        double t0 = now();
        for (long i = 0; i < n; i++) {
            if (rt_null_1(NULL, c) != RPC_SUCCESS) { fprintf(stderr, "null call failed\n"); return 1; }
        }
        double dt = now() - t0;
        printf("{\"impl\":\"libtirpc\",\"op\":\"null\",\"iters\":%ld,\"seconds\":%.9f}\n", n, dt);
        return 0;
    }
    if (!strcmp(argv[2], "bench") && argc >= 6 && !strcmp(argv[3], "echo")) {
        size_t bytes = (size_t)atol(argv[4]);
        long n = atol(argv[5]);
        char *buf = malloc(bytes ? bytes : 1);
        memset(buf, 0x5a, bytes);
        rt_blob in = {(u_int)bytes, buf}, out;
        double t0 = now();
        for (long i = 0; i < n; i++) {
            memset(&out, 0, sizeof out);
            if (rt_echo_1(in, &out, c) != RPC_SUCCESS || out.rt_blob_len != bytes) { fprintf(stderr, "echo failed\n"); return 1; }
            xdr_free((xdrproc_t)xdr_rt_blob, (char *)&out);
        }
        double dt = now() - t0;
        printf("{\"impl\":\"libtirpc\",\"op\":\"echo\",\"bytes\":%zu,\"iters\":%ld,\"seconds\":%.9f}\n", bytes, n, dt);
        return 0;
    }
    fprintf(stderr, "unknown mode %s\n", argv[2]);
    return 2;
}
