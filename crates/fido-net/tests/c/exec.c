/* An accelerated connection handed to a new image across exec.
 *   exec server PORT MODE N [HANDLER]
 *                             accept one connection; phase 1: read N bytes
 *                             (pattern 1), echo them; then hand the socket to
 *                             `exec handler N` on descriptors 0 and 1 by MODE:
 *        exec      dup2 onto 0/1, close the original, execl (inetd style)
 *        forkexec  fork; the child dup2s and execv's; the parent closes its copy
 *        spawn     posix_spawn with dup2 file actions; the parent closes its copy
 *        noload    like exec, but execve with LD_PRELOAD removed from the
 *                  environment: the new image cannot read the ring
 *        off       like exec, with FIDO_NET=off in the new image's environment
 *                  (the library is loaded: it still adopts the connection)
 *        failexec  dup2 onto 0/1, an execl that fails (no such file), then
 *                  phase 2 in this process on 0/1: a failed exec undoes everything
 *        cloexec   fork; the child execs /bin/true (the socket is close-on-exec:
 *                  the child's hold is given up); the parent does phase 2, closes
 *   HANDLER is the program exec'd as the handler (default: this one; the
 *   test passes a static build of it, which cannot load the library).
 *   exec handler N            phase 2: read N bytes (pattern 2) from fd 0,
 *                             write N bytes (pattern 3) to fd 1; "handler ok"
 *                             on stderr, or what went wrong
 *   exec client PORT N [epipe]  both phases, verifying every byte; then expects
 *                             EOF. Prints "ok", or "reset"/"cut" when the
 *                             connection was reset or ended before the phase 2
 *                             data (never data that is not the peer's).
 *                             With "epipe": after EOF, a write then (after
 *                             the peer's RST) another must fail with EPIPE —
 *                             which needs the server's last holder to have
 *                             marked the connection closed. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static unsigned char pat(int phase, size_t i) { return (unsigned char)(i * (7 + 2 * phase) + phase * 101 + (i >> 9)); }

static int read_full(int fd, unsigned char *b, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, b + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r == 0 ? -2 : -1;
        got += r;
    }
    return 0;
}

static int write_full(int fd, const unsigned char *b, size_t n) {
    size_t put = 0;
    while (put < n) {
        ssize_t w = write(fd, b + put, n - put);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        put += w;
    }
    return 0;
}

static int check(const unsigned char *b, size_t n, int phase) {
    for (size_t i = 0; i < n; i++)
        if (b[i] != pat(phase, i)) return -1;
    return 0;
}

static int handler(size_t n) {
    unsigned char *b = malloc(n);
    int r = read_full(0, b, n);
    if (r) { fprintf(stderr, "handler: read: %s\n", r == -2 ? "EOF" : strerror(errno)); return 1; }
    if (check(b, n, 2)) { fprintf(stderr, "handler: mismatch\n"); return 1; }
    for (size_t i = 0; i < n; i++) b[i] = pat(3, i);
    if (write_full(1, b, n)) { fprintf(stderr, "handler: write: %s\n", strerror(errno)); return 1; }
    fprintf(stderr, "handler ok\n");
    close(0);
    close(1);
    return 0;
}

static int server(int port, const char *mode, size_t n, const char *self) {
    int inetd = !strcmp(mode, "exec") || !strcmp(mode, "noload") || !strcmp(mode, "off");
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(l, (void *)&a, sizeof a) || listen(l, 8)) { perror("listen"); return 1; }
    int c = accept4(l, NULL, NULL, SOCK_CLOEXEC); /* only dup2 copies survive */
    if (c < 0) { perror("accept"); return 1; }
    close(l);
    unsigned char *b = malloc(n);
    if (read_full(c, b, n) || check(b, n, 1)) { fprintf(stderr, "server: phase 1 failed\n"); return 1; }
    if (write_full(c, b, n)) { perror("server write"); return 1; }
    char ns[32];
    snprintf(ns, sizeof ns, "%zu", n);
    fflush(NULL);
    if (inetd) {
        dup2(c, 0);
        dup2(c, 1);
        close(c);
        if (!strcmp(mode, "off")) setenv("FIDO_NET", "off", 1);
        if (strcmp(mode, "noload")) {
            execl(self, self, "handler", ns, (char *)NULL);
        } else {
            char *env[256];
            int k = 0;
            for (char **e = environ; *e && k < 255; e++)
                if (strncmp(*e, "LD_PRELOAD=", 11)) env[k++] = *e;
            env[k] = NULL;
            char *argv[] = {(char *)self, "handler", ns, NULL};
            execve(self, argv, env);
        }
        perror("exec");
        return 1;
    }
    if (!strcmp(mode, "forkexec")) {
        pid_t p = fork();
        if (p == 0) {
            dup2(c, 0);
            dup2(c, 1);
            close(c);
            char *argv[] = {(char *)self, "handler", ns, NULL};
            execv(self, argv);
            _exit(127);
        }
        close(c);
        int st;
        waitpid(p, &st, 0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
    if (!strcmp(mode, "spawn")) {
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, c, 0);
        posix_spawn_file_actions_adddup2(&fa, c, 1);
        char *argv[] = {(char *)self, "handler", ns, NULL};
        pid_t p;
        int e = posix_spawn(&p, self, &fa, NULL, argv, environ);
        if (e) { fprintf(stderr, "posix_spawn: %s\n", strerror(e)); return 1; }
        close(c);
        int st;
        waitpid(p, &st, 0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
    if (!strcmp(mode, "failexec")) {
        dup2(c, 0);
        dup2(c, 1);
        close(c);
        execl("/nonexistent/fido-net-handler", "x", (char *)NULL);
        fprintf(stderr, "exec failed as expected: %s\n", strerror(errno));
        return handler(n);
    }
    if (!strcmp(mode, "cloexec")) {
        pid_t p = fork();
        if (p == 0) {
            execl("/bin/true", "true", (char *)NULL);
            _exit(127);
        }
        int st;
        waitpid(p, &st, 0);
        dup2(c, 0); /* the handler's descriptors, in this process */
        dup2(c, 1);
        close(c);
        return handler(n);
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}

static int client(int port, size_t n, int epipe) {
    signal(SIGPIPE, SIG_IGN);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (void *)&a, sizeof a)) { perror("connect"); return 1; }
    unsigned char *b = malloc(n);
    for (size_t i = 0; i < n; i++) b[i] = pat(1, i);
    if (write_full(fd, b, n)) { perror("write 1"); return 1; }
    memset(b, 0, n);
    if (read_full(fd, b, n) || check(b, n, 1)) { printf("phase 1 failed\n"); return 1; }
    for (size_t i = 0; i < n; i++) b[i] = pat(2, i);
    if (write_full(fd, b, n)) {
        if (errno == ECONNRESET || errno == EPIPE) { printf("reset\n"); return 0; }
        perror("write 2");
        return 1;
    }
    memset(b, 0, n);
    int r = read_full(fd, b, n);
    if (r == -1 && errno == ECONNRESET) { printf("reset\n"); return 0; }
    if (r == -2) { printf("cut\n"); return 0; } /* EOF where data was due: cut, not corrupted */
    if (r) { perror("read 2"); return 1; }
    if (check(b, n, 3)) { printf("mismatch\n"); return 1; }
    char x;
    ssize_t e = read(fd, &x, 1);
    if (e != 0) { printf("expected EOF, got %zd (%s)\n", e, e < 0 ? strerror(errno) : "data"); return 1; }
    if (epipe) {
        /* TCP: the first write after the peer closed succeeds, the peer
         * answers with a RST, a later one fails with EPIPE. */
        int failed = 0;
        for (int i = 0; i < 50 && !failed; i++) {
            if (write(fd, "x", 1) < 0) failed = errno;
            usleep(20000);
        }
        if (failed != EPIPE && failed != ECONNRESET) { printf("writes after close: %s\n", failed ? strerror(failed) : "all succeeded"); return 1; }
    }
    printf("ok\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "handler")) return handler(strtoul(argv[2], NULL, 10));
    if (argc >= 4 && !strcmp(argv[1], "client"))
        return client(atoi(argv[2]), strtoul(argv[3], NULL, 10), argc > 4 && !strcmp(argv[4], "epipe"));
    if (argc >= 5 && !strcmp(argv[1], "server"))
        return server(atoi(argv[2]), argv[3], strtoul(argv[4], NULL, 10), argc > 5 ? argv[5] : argv[0]);
    fprintf(stderr, "usage: see the comment at the top\n");
    return 2;
}
