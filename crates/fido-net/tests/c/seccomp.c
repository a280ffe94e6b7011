/* A connection accelerated before the process confines itself with a
 * seccomp filter, then served under it — sshd's pre-auth child does this:
 * its filter kills the process on any call outside a short list (sendto,
 * recvfrom, getsockopt, fstat, sched_yield, ... are not on it). The library
 * must keep the connection working with the calls the program itself makes.
 *
 *   server PORT   accepts one connection, says "hello", forks a child that
 *                 installs the filter (prctl, as sshd) and then, per round,
 *                 reads 2 MiB (checked) and writes 2 MiB back; "bye" ends it.
 *                 Prints "child ok" or how the child died.
 *   client PORT   reads "hello", runs 4 rounds (every byte checked), says
 *                 "bye"; prints "ok".
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ROUND (2 << 20)
#define ROUNDS 4

#if defined(__x86_64__)
#define ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH AUDIT_ARCH_AARCH64
#endif

#define ALLOW(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)

static void die(const char *what) {
    printf("FAIL %s (errno %d: %s)\n", what, errno, strerror(errno));
    exit(1);
}

/* Roughly OpenSSH's pre-auth list (sandbox-seccomp-filter.c): everything
 * else kills the process. */
static void confine(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        ALLOW(__NR_read), ALLOW(__NR_write), ALLOW(__NR_close), ALLOW(__NR_exit),
        ALLOW(__NR_exit_group), ALLOW(__NR_futex), ALLOW(__NR_ppoll),
        ALLOW(__NR_pselect6), ALLOW(__NR_rt_sigprocmask), ALLOW(__NR_rt_sigreturn),
        ALLOW(__NR_clock_gettime), ALLOW(__NR_clock_nanosleep), ALLOW(__NR_nanosleep),
        ALLOW(__NR_gettimeofday), ALLOW(__NR_getpid), ALLOW(__NR_gettid),
        ALLOW(__NR_getrandom), ALLOW(__NR_brk), ALLOW(__NR_mmap), ALLOW(__NR_munmap),
        ALLOW(__NR_mremap), ALLOW(__NR_madvise), ALLOW(__NR_shutdown),
        ALLOW(__NR_restart_syscall),
#ifdef __NR_poll
        ALLOW(__NR_poll), ALLOW(__NR_select),
#endif
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog))
        die("seccomp");
}

static unsigned char byte_at(size_t i, int round) { return (unsigned char)(i * 13 + (i >> 11) + round); }

static void wr_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t r = write(fd, p, n);
        if (r <= 0) die("write");
        p += r; n -= r;
    }
}

/* Reads n bytes, waiting with poll as sshd does. */
static void rd_all(int fd, unsigned char *p, size_t n) {
    while (n) {
        struct pollfd q = {.fd = fd, .events = POLLIN};
        if (poll(&q, 1, 20000) != 1) die("poll");
        ssize_t r = read(fd, p, n);
        if (r <= 0) die("read");
        p += r; n -= r;
    }
}

static unsigned char buf[ROUND];

static void serve(int fd) {
    confine();
    for (int round = 0; round < ROUNDS; round++) {
        rd_all(fd, buf, ROUND);
        for (size_t i = 0; i < ROUND; i++)
            if (buf[i] != byte_at(i, round)) die("bytes from the client");
        for (size_t i = 0; i < ROUND; i++) buf[i] = byte_at(i, round + 100);
        wr_all(fd, buf, ROUND);
    }
    rd_all(fd, buf, 3);
    if (memcmp(buf, "bye", 3)) die("bye");
    exit(0);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc != 3) return 2;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2])),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (strcmp(argv[1], "server") == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 4)) die("listen");
        printf("listening\n");
        int fd = accept(l, NULL, NULL);
        if (fd < 0) die("accept");
        wr_all(fd, (const unsigned char *)"hello", 5);
        pid_t pid = fork();
        if (pid == 0) { close(l); serve(fd); }
        close(fd);
        int st;
        waitpid(pid, &st, 0);
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
            printf("child ok\n");
        else if (WIFSIGNALED(st))
            printf("child killed by signal %d\n", WTERMSIG(st));
        else
            printf("child exited %d\n", WEXITSTATUS(st));
    } else {
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(s, (struct sockaddr *)&a, sizeof a)) die("connect");
        rd_all(s, buf, 5);
        if (memcmp(buf, "hello", 5)) die("hello");
        for (int round = 0; round < ROUNDS; round++) {
            for (size_t i = 0; i < ROUND; i++) buf[i] = byte_at(i, round);
            wr_all(s, buf, ROUND);
            rd_all(s, buf, ROUND);
            for (size_t i = 0; i < ROUND; i++)
                if (buf[i] != byte_at(i, round + 100)) die("bytes from the server");
        }
        wr_all(s, (const unsigned char *)"bye", 3);
        printf("ok\n");
    }
    return 0;
}
