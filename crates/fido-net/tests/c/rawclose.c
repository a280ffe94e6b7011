/* Descriptors closed behind the library's back. libuv (Node.js) closes
 * sockets with syscall(SYS_close); a static helper or io_uring may close
 * them with no libc call at all. The library must notice (it interposes
 * syscall(2)) or, failing that, never use what it knew about a descriptor
 * number once the number names something else.
 *
 *   server PORT N MODE   accepts N connections; each: reads one line, answers
 *                        "reply <i>", closes the socket (MODE "syscall":
 *                        syscall(SYS_close); "raw": the syscall instruction,
 *                        which no preload sees), then checks that the
 *                        descriptor created next (it gets the same number)
 *                        works as what it is: by turns a pipe, a timerfd
 *                        (poll, read), a file from fopen and one from mkstemp
 *                        (write, read back), and a pipe end received over
 *                        SCM_RIGHTS. Prints "reused R" (how many took the
 *                        closed number) and "memfds K" (memfd descriptors it
 *                        holds) at the end.
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
#include <poll.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/timerfd.h>
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

/* Read and write through `d` as the program would: the library must treat
 * it as the plain descriptor it is, not as the connection it replaced. */
static void write_read_back(int d, const char *what) {
    if (write(d, what, strlen(what)) != (ssize_t)strlen(what))
        die(what);
    if (lseek(d, 0, SEEK_SET) != 0)
        die("lseek");
    char b[16] = {0};
    if (read(d, b, sizeof b) != (ssize_t)strlen(what) || strcmp(b, what) != 0)
        die("read back");
}

/* The number `fd` is free (its socket closed where the library may not have
 * seen it): create a descriptor of `kind`, which takes that number, and
 * check it works. Returns whether it took the number. */
static int reuse_number(int kind, int fd, int sp[2], int held[2]) {
    int got = -1;
    if (kind == 0) {
        int p[2];
        if (pipe(p))
            die("pipe");
        got = p[0] == fd ? p[0] : p[1];
        if (write(p[1], "pipe", 4) != 4)
            die("pipe write");
        char pb[8] = {0};
        if (read(p[0], pb, sizeof pb) != 4 || memcmp(pb, "pipe", 4) != 0)
            die("pipe read back");
        close(p[0]);
        close(p[1]);
    } else if (kind == 1) {
        got = timerfd_create(CLOCK_MONOTONIC, 0);
        struct itimerspec t = {.it_value = {.tv_nsec = 1000000}};
        if (got < 0 || timerfd_settime(got, 0, &t, NULL))
            die("timerfd");
        struct pollfd pf = {.fd = got, .events = POLLIN};
        if (poll(&pf, 1, 5000) != 1 || !(pf.revents & POLLIN))
            die("timerfd poll");
        unsigned long long n = 0;
        if (read(got, &n, sizeof n) != sizeof n || n < 1)
            die("timerfd read");
        close(got);
    } else if (kind == 2) {
        FILE *f = fopen("/proc/self/cwd/rawclose-fopen", "w+");
        if (!f)
            die("fopen");
        got = fileno(f);
        write_read_back(got, "fopen");
        fclose(f);
        unlink("rawclose-fopen");
    } else if (kind == 3) {
        char path[] = "rawclose-XXXXXX";
        got = mkstemp(path);
        if (got < 0)
            die("mkstemp");
        unlink(path);
        write_read_back(got, "mkstemp");
        close(got);
    } else {
        char one = 'x';
        char ctl[CMSG_SPACE(sizeof(int))] = {0};
        struct iovec v = {.iov_base = &one, .iov_len = 1};
        struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &held[0], sizeof(int));
        if (sendmsg(sp[0], &m, 0) != 1)
            die("sendmsg");
        memset(ctl, 0, sizeof ctl);
        if (recvmsg(sp[1], &m, 0) != 1 || !(c = CMSG_FIRSTHDR(&m)) || c->cmsg_type != SCM_RIGHTS)
            die("recvmsg");
        memcpy(&got, CMSG_DATA(c), sizeof(int));
        if (write(held[1], "passed", 6) != 6)
            die("passed pipe write");
        char pb[8] = {0};
        if (read(got, pb, sizeof pb) != 6 || memcmp(pb, "passed", 6) != 0)
            die("passed pipe read back");
        close(got);
        close(held[0]);
        close(held[1]);
        close(sp[0]);
        close(sp[1]);
    }
    return got == fd;
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
        /* Made before the close, so the descriptor received over it later
         * is the one that takes the closed number. */
        int kind = (i / 2) % 5, sp[2] = {-1, -1}, held[2] = {-1, -1};
        if (kind == 4 && (socketpair(AF_UNIX, SOCK_STREAM, 0, sp) || pipe(held)))
            die("socketpair");
        long r = strcmp(mode, "raw") == 0 ? raw_close(fd) : syscall(SYS_close, fd);
        if (r != 0)
            die("close");
        reused += reuse_number(kind, fd, sp, held);
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
