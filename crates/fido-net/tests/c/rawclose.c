/* Descriptors closed behind the library's back. libuv (Node.js) closes
 * sockets with syscall(SYS_close); a static helper or io_uring may close
 * them with no libc call at all. The library must notice (it interposes
 * syscall(2)) or, failing that, never use what it knew about a descriptor
 * number once the number names something else.
 *
 *   server PORT N MODE   accepts N connections; each: reads one line, answers
 *                        "reply <i>", closes the socket (MODE "syscall":
 *                        syscall(SYS_close); "raw": the syscall instruction,
 *                        which no preload sees), then checks that a pipe
 *                        created next (it gets the same number) reads back
 *                        what was written into it. Prints "memfds K" (memfd
 *                        descriptors it holds) at the end.
 *   client PORT I        connects, sends a line, prints the reply (10 s limit).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

static void die(const char *what) {
    printf("FAIL %s (errno %d: %s)\n", what, errno, strerror(errno));
    exit(1);
}

static long raw_close(int fd) {
#if defined(__x86_64__)
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "0"((long)SYS_close), "D"((long)fd) : "rcx", "r11", "memory");
    return r;
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = SYS_close;
    register long x0 __asm__("x0") = fd;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8) : "memory");
    return x0;
#else
    return syscall(SYS_close, fd);
#endif
}

static int memfds(void) {
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int n = 0;
    char p[300], t[256];
    while (d && (e = readdir(d))) {
        snprintf(p, sizeof p, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(p, t, sizeof t - 1);
        if (k > 0) {
            t[k] = 0;
            if (strncmp(t, "/memfd:", 7) == 0)
                n++;
        }
    }
    if (d)
        closedir(d);
    return n;
}

static void server(int port, int n, const char *mode) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 64))
        die("listen");
    printf("listening\n");
    fflush(stdout);
    int reused = 0;
    for (int i = 0; i < n; i++) {
        int fd = accept(l, NULL, NULL);
        if (fd < 0)
            die("accept");
        char buf[256];
        size_t got = 0;
        while (got == 0 || buf[got - 1] != '\n') {
            ssize_t r = read(fd, buf + got, sizeof buf - got);
            if (r <= 0)
                die("server read");
            got += r;
        }
        char out[64];
        int len = snprintf(out, sizeof out, "reply %d\n", i);
        if (write(fd, out, len) != len)
            die("server write");
        long r = strcmp(mode, "raw") == 0 ? raw_close(fd) : syscall(SYS_close, fd);
        if (r != 0)
            die("close");
        /* The number is free: a pipe takes it, and must behave as a pipe. */
        int p[2];
        if (pipe(p))
            die("pipe");
        reused += p[0] == fd || p[1] == fd;
        if (write(p[1], "pipe", 4) != 4)
            die("pipe write");
        char pb[8] = {0};
        if (read(p[0], pb, sizeof pb) != 4 || memcmp(pb, "pipe", 4) != 0)
            die("pipe read back");
        close(p[0]);
        close(p[1]);
    }
    printf("reused %d\nmemfds %d\n", reused, memfds());
}

static void client(int port, int i) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {.tv_sec = 10};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a))
        die("connect");
    char req[32];
    int len = snprintf(req, sizeof req, "request %d\n", i);
    if (write(s, req, len) != len)
        die("client write");
    char buf[64];
    size_t got = 0;
    while (got == 0 || buf[got - 1] != '\n') {
        ssize_t r = read(s, buf + got, sizeof buf - 1 - got);
        if (r <= 0)
            die("no reply");
        got += r;
    }
    buf[got] = 0;
    printf("%s", buf);
    close(s);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 5 && strcmp(argv[1], "server") == 0)
        server(atoi(argv[2]), atoi(argv[3]), argv[4]);
    else if (argc == 4 && strcmp(argv[1], "client") == 0)
        client(atoi(argv[2]), atoi(argv[3]));
    else
        return 2;
    return 0;
}
