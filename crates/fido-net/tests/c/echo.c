/* Tiny echo server/client for the fallback tests. Built normally, statically
 * (-static: the preload cannot enter), and as a client that creates an
 * io_uring first (the library then leaves its new connections alone).
 *   echo server PORT [ADDR]        accept connections, echo each until EOF
 *   echo client PORT BYTES [ADDR [SPORT]]  send BYTES, read them back, verify, print "ok BYTES"
 *   echo uring-client PORT BYTES   same, after io_uring_setup through syscall()
 * ADDR is an IPv4 address (default 127.0.0.1; the server also takes 0.0.0.0). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static in_addr_t addr_arg(int argc, char **argv, int i) {
    return argc > i ? inet_addr(argv[i]) : htonl(INADDR_LOOPBACK);
}

static int client(int port, size_t n, in_addr_t ip, int sport) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (sport) { /* a fixed source port (the same 4-tuple in two namespace pairs) */
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in s = {.sin_family = AF_INET, .sin_port = htons(sport)};
        if (bind(fd, (void *)&s, sizeof s)) { perror("bind"); return 1; }
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = ip};
    if (connect(fd, (void *)&a, sizeof a)) { perror("connect"); return 1; }
    unsigned char *out = malloc(n), *in = malloc(n);
    /* Per-process pattern: a stream crossed with another client's shows. */
    unsigned seed = (unsigned)getpid() * 2654435761u;
    for (size_t i = 0; i < n; i++) out[i] = (unsigned char)(i * 31 + 7 + (seed >> (i % 24)));
    size_t sent = 0, got = 0;
    while (got < n) {
        if (sent < n) {
            ssize_t w = write(fd, out + sent, n - sent > 65536 ? 65536 : n - sent);
            if (w < 0) { perror("write"); return 1; }
            sent += w;
        }
        ssize_t r = read(fd, in + got, n - got);
        if (r <= 0) { perror("read"); return 1; }
        got += r;
    }
    if (memcmp(in, out, n)) { printf("mismatch\n"); return 1; }
    printf("ok %zu\n", n);
    close(fd);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    int port = atoi(argv[2]);
    if (!strcmp(argv[1], "server")) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = addr_arg(argc, argv, 3)};
        if (bind(l, (void *)&a, sizeof a) || listen(l, 8)) { perror("listen"); return 1; }
        for (;;) {
            int c = accept(l, NULL, NULL);
            if (c < 0) return 1;
            char buf[65536]; ssize_t r;
            while ((r = read(c, buf, sizeof buf)) > 0) {
                for (ssize_t o = 0; o < r;) { ssize_t w = write(c, buf + o, r - o); if (w <= 0) return 1; o += w; }
            }
            close(c);
        }
    }
    size_t n = argc > 3 ? strtoul(argv[3], NULL, 10) : 100000;
    if (!strcmp(argv[1], "uring-client")) {
        unsigned char params[120] = {0};
        long r = syscall(SYS_io_uring_setup, 4, params);
        if (r >= 0) close((int)r);
    }
    return client(port, n, addr_arg(argc, argv, 4), argc > 5 ? atoi(argv[5]) : 0);
}
