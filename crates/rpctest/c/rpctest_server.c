/*
 * A libtirpc server for rpctest.x, built from rpcgen's stubs (rpcgen -N -M -m).
 * Usage: rpctest_server tcp:127.0.0.1:PORT | unix:PATH
 * Prints "LISTENING <port>" (0 for Unix) once it accepts calls; it does not use rpcbind.
 */
#include <rpc/rpc.h>
#include <signal.h>

#include "rpctest.h"
#include "rpctest_common.h"

extern void rpctest_prog_1(struct svc_req *rqstp, SVCXPRT *transp);

/* Deep copy through XDR: encode src, decode into dst (zeroed). */
static bool_t copy_via_xdr(xdrproc_t proc, void *src, void *dst, size_t dst_size) {
    unsigned long size = xdr_sizeof(proc, src);
    char *buf = malloc(size ? size : 4);
    XDR x;
    bool_t ok;
    if (!buf) return FALSE;
    xdrmem_create(&x, buf, size, XDR_ENCODE);
    ok = proc(&x, src);
    xdr_destroy(&x);
    if (ok) {
        memset(dst, 0, dst_size);
        xdrmem_create(&x, buf, size, XDR_DECODE);
        ok = proc(&x, dst);
        xdr_destroy(&x);
    }
    free(buf);
    return ok;
}

/* A procedure that answers a deep copy of its argument of type TYPE. */
#define ECHO_SVC(PROC, TYPE)                                                      \
    bool_t rt_##PROC##_1_svc(TYPE arg, TYPE *result, struct svc_req *req) {      \
        (void)req;                                                                \
        return copy_via_xdr((xdrproc_t)xdr_##TYPE, &arg, result, sizeof *result); \
    }

bool_t rt_null_1_svc(void *result, struct svc_req *req) {
    (void)result; (void)req;
    return TRUE;
}

bool_t rt_echo_1_svc(rt_blob arg, rt_blob *result, struct svc_req *req) {
    (void)req;
    result->rt_blob_len = arg.rt_blob_len;
    result->rt_blob_val = malloc(arg.rt_blob_len ? arg.rt_blob_len : 1);
    if (!result->rt_blob_val) return FALSE;
    memcpy(result->rt_blob_val, arg.rt_blob_val, arg.rt_blob_len);
    return TRUE;
}

bool_t rt_add_1_svc(int a, int b, int *result, struct svc_req *req) {
    (void)req;
    *result = a + b;
    return TRUE;
}

ECHO_SVC(shape_echo, shape)

bool_t rt_list_reverse_1_svc(int_list arg, int_list *result, struct svc_req *req) {
    (void)req;
    int_list out = NULL;
    for (int_node *n = arg; n; n = n->next) {
        int_node *c = calloc(1, sizeof *c);
        if (!c) return FALSE;
        c->value = n->value;
        c->next = out;
        out = c;
    }
    *result = out;
    return TRUE;
}

ECHO_SVC(arrays_echo, arrays)

ECHO_SVC(names_echo, name_list)

bool_t rt_list_sum_1_svc(int_list arg, int *result, struct svc_req *req) {
    (void)req;
    int sum = 0;
    for (int_node *n = arg; n; n = n->next) sum += n->value;
    *result = sum;
    return TRUE;
}

int rpctest_prog_1_freeresult(SVCXPRT *transp, xdrproc_t xdr_result, caddr_t result) {
    (void)transp;
    xdr_free(xdr_result, result);
    return 1;
}

int main(int argc, char **argv) {
    struct sockaddr_storage ss;
    socklen_t len;
    int one = 1;
    if (argc != 2) {
        fprintf(stderr, "usage: %s tcp:HOST:PORT | unix:PATH\n", argv[0]);
        return 2;
    }
    int family = rt_parse_addr(argv[1], &ss, &len);
    if (family < 0) {
        fprintf(stderr, "bad address %s\n", argv[1]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int fd = socket(family, SOCK_STREAM, 0);
    if (family == AF_INET) {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    } else {
        unlink(((struct sockaddr_un *)&ss)->sun_path);
    }
    if (fd < 0 || bind(fd, (struct sockaddr *)&ss, len) < 0 || listen(fd, 64) < 0) {
        perror("bind/listen");
        return 1;
    }
    /* svc_vc_create: send and receive buffer sizes 0 = libtirpc defaults. */
    SVCXPRT *transp = svc_vc_create(fd, 0, 0);
    if (!transp) {
        fprintf(stderr, "svc_vc_create failed\n");
        return 1;
    }
    /* Protocol 0: do not register with rpcbind. */
    if (!svc_register(transp, RPCTEST_PROG, RPCTEST_V1, rpctest_prog_1, 0)) {
        fprintf(stderr, "svc_register failed\n");
        return 1;
    }
    int port = 0;
    if (family == AF_INET) {
        struct sockaddr_in bound;
        socklen_t blen = sizeof bound;
        getsockname(fd, (struct sockaddr *)&bound, &blen);
        port = ntohs(bound.sin_port);
    }
    printf("LISTENING %d\n", port);
    fflush(stdout);
    svc_run();
    return 1;
}
