/* Shared helpers of the C peers (libtirpc) used by Remora's interop tests and benchmarks. */
#ifndef RPCTEST_COMMON_H
#define RPCTEST_COMMON_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* Parses "tcp:HOST:PORT" or "unix:PATH" into a socket address. Returns the family or -1. */
static int rt_parse_addr(const char *spec, struct sockaddr_storage *ss, socklen_t *len) {
    memset(ss, 0, sizeof *ss);
    if (strncmp(spec, "tcp:", 4) == 0) {
        char host[256];
        const char *colon = strrchr(spec + 4, ':');
        if (!colon || (size_t)(colon - spec - 4) >= sizeof host) return -1;
        memcpy(host, spec + 4, colon - spec - 4);
        host[colon - spec - 4] = 0;
        struct sockaddr_in *sin = (struct sockaddr_in *)ss;
        sin->sin_family = AF_INET;
        sin->sin_port = htons((unsigned short)atoi(colon + 1));
        if (inet_pton(AF_INET, host, &sin->sin_addr) != 1) return -1;
        *len = sizeof *sin;
        return AF_INET;
    }
    if (strncmp(spec, "unix:", 5) == 0) {
        struct sockaddr_un *sun = (struct sockaddr_un *)ss;
        if (strlen(spec + 5) >= sizeof sun->sun_path) return -1;
        sun->sun_family = AF_UNIX;
        strcpy(sun->sun_path, spec + 5);
        *len = sizeof *sun;
        return AF_UNIX;
    }
    return -1;
}

#endif
