/* Programs for the "stays plain TCP, fast" tests (tests/fallback.rs).
 *   fallback server PORT [reuseport]   single-threaded: accept, echo until EOF, close; prints "listening"
 *   fallback server PORT closefirst BYTES  the same, but each connection: read BYTES, echo them,
 *                                      close first (the client waits for that end-of-file)
 *   fallback loop PORT N BYTES [PHASES [eof]]  N times connect / send BYTES / read them back /
 *                                      (with eof: wait for the server's end-of-file) / close;
 *                                      prints "ok N max_us p99_us p50_us" (each connection timed);
 *                                      PHASES times, each after a line on stdin (the first at once)
 *   fallback master PORT UNIXPATH [peek]  accept on PORT, pass each socket to the worker at
 *                                      UNIXPATH over SCM_RIGHTS (before any I/O; with peek:
 *                                      after peeking at the first request byte), close it
 *   fallback worker UNIXPATH           take sockets from the master, echo each until EOF
 *   fallback linger PORT               connect, exchange 1000 bytes, print "held", wait for
 *                                      stdin EOF, then exit() without closing the socket
 * Every byte is checked: a mismatch prints "mismatch" and exits 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int listen_on(int port, int reuseport) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (reuseport) setsockopt(l, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(l, (void *)&a, sizeof a) || listen(l, 128)) { perror("listen"); exit(1); }
    printf("listening\n");
    fflush(stdout);
    return l;
}

static void echo_until_eof(int c) {
    char buf[65536];
    for (;;) {
        ssize_t r = read(c, buf, sizeof buf);
        if (r <= 0) break;
        for (ssize_t off = 0; off < r;) {
            ssize_t w = write(c, buf + off, r - off);
            if (w <= 0) return;
            off += w;
        }
    }
}

static long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000L + t.tv_nsec / 1000;
}

static int cmp_long(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (void *)&a, sizeof a)) { perror("connect"); exit(1); }
    return fd;
}

/* One connection: send n pattern bytes, read them back, check them. */
static void exchange(int fd, size_t n, unsigned seed) {
    unsigned char *out = malloc(n), *in = malloc(n);
    for (size_t i = 0; i < n; i++) out[i] = (unsigned char)(i * 31 + seed);
    size_t sent = 0, got = 0;
    while (got < n) {
        if (sent < n) {
            ssize_t w = write(fd, out + sent, n - sent);
            if (w < 0) { perror("write"); exit(1); }
            sent += w;
        }
        ssize_t r = read(fd, in + got, n - got);
        if (r <= 0) { perror(r ? "read" : "read: EOF"); exit(1); }
        got += r;
    }
    if (memcmp(in, out, n)) { printf("mismatch\n"); exit(1); }
    free(out);
    free(in);
}

static int loop(int port, int n, size_t bytes, int eof) {
    long *lat = calloc(n, sizeof *lat), max = 0;
    for (int i = 0; i < n; i++) {
        long t0 = now_us();
        int fd = connect_to(port);
        exchange(fd, bytes, (unsigned)i);
        char b;
        if (eof && read(fd, &b, 1) != 0) { perror("expected end-of-file"); exit(1); }
        close(fd);
        lat[i] = now_us() - t0;
        if (lat[i] > max) max = lat[i];
    }
    qsort(lat, n, sizeof *lat, cmp_long);
    printf("ok %d %ld %ld %ld\n", n, max, lat[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1], lat[n / 2]);
    return 0;
}

static int unix_socket(const char *path, int listening) {
    int u = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strncpy(a.sun_path, path, sizeof a.sun_path - 1);
    if (listening) {
        unlink(path);
        if (bind(u, (void *)&a, sizeof a) || listen(u, 4)) { perror("unix listen"); exit(1); }
    } else if (connect(u, (void *)&a, sizeof a)) {
        perror("unix connect");
        exit(1);
    }
    return u;
}

static void send_fd(int u, int fd) {
    char byte = 'f';
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(u, &m, 0) != 1) { perror("sendmsg"); exit(1); }
}

static int recv_fd(int u) {
    char byte;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } ctl;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    if (recvmsg(u, &m, 0) != 1) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(argv[1], "server")) {
        int l = listen_on(atoi(argv[2]), argc > 3 && !strcmp(argv[3], "reuseport"));
        size_t first = argc > 4 && !strcmp(argv[3], "closefirst") ? (size_t)atol(argv[4]) : 0;
        for (;;) {
            int c = accept(l, NULL, NULL);
            if (c < 0) continue;
            if (first) {
                char *b = malloc(first);
                size_t got = 0;
                while (got < first) {
                    ssize_t r = read(c, b + got, first - got);
                    if (r <= 0) break;
                    got += r;
                }
                for (size_t off = 0; off < got;) {
                    ssize_t w = write(c, b + off, got - off);
                    if (w <= 0) break;
                    off += w;
                }
                free(b);
            } else {
                echo_until_eof(c);
            }
            close(c);
        }
    }
    if (!strcmp(argv[1], "loop")) {
        if (argc < 5) return 2;
        int phases = argc > 5 ? atoi(argv[5]) : 1;
        int eof = argc > 6 && !strcmp(argv[6], "eof");
        for (int p = 0; p < phases; p++) {
            char line[64];
            if (p > 0 && !fgets(line, sizeof line, stdin)) return 1;
            loop(atoi(argv[2]), atoi(argv[3]), (size_t)atol(argv[4]), eof);
        }
        return 0;
    }
    if (!strcmp(argv[1], "master")) {
        if (argc < 4) return 2;
        int l = listen_on(atoi(argv[2]), 0);
        int u = unix_socket(argv[3], 0);
        int peek = argc > 4 && !strcmp(argv[4], "peek");
        for (;;) {
            int c = accept(l, NULL, NULL);
            if (c < 0) continue;
            char b;
            if (peek && recv(c, &b, 1, MSG_PEEK) != 1) perror("peek");
            send_fd(u, c);
            close(c);
        }
    }
    if (!strcmp(argv[1], "worker")) {
        int ul = unix_socket(argv[2], 1);
        printf("ready\n");
        int u = accept(ul, NULL, NULL);
        for (;;) {
            int c = recv_fd(u);
            if (c < 0) return 0;
            echo_until_eof(c);
            close(c);
        }
    }
    if (!strcmp(argv[1], "linger")) {
        int fd = connect_to(atoi(argv[2]));
        exchange(fd, 1000, 7);
        printf("held\n");
        char b;
        while (read(0, &b, 1) > 0) {}
        exit(0); /* the socket is left open: the kernel closes it */
    }
    return 2;
}
