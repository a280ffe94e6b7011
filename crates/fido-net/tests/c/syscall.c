/* System calls made through libc's variadic syscall(2), which the preload
 * interposes: with fewer argument words than six and with all six, results
 * checked against what the kernel must answer. Then io_uring_setup through
 * syscall(2), between two loopback connections: the library must accelerate
 * the first and leave the second plain TCP (tests/syscall.rs reads that from
 * the published statistics). Prints "ok <what>" per check, "done" at the end;
 * exits 1 on the first failure. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static void check(int ok, const char *what) {
    if (!ok) {
        printf("FAIL %s (errno %d: %s)\n", what, errno, strerror(errno));
        exit(1);
    }
    printf("ok %s\n", what);
    fflush(stdout);
}

static struct timespec after_ms(long ms) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_nsec += ms * 1000000L;
    t.tv_sec += t.tv_nsec / 1000000000L;
    t.tv_nsec %= 1000000000L;
    return t;
}

static uint32_t bitset_word;
static long waiter_result = -2;

/* Sleeps on bitset_word, to be woken only through bit 0 (six words). */
static void *bitset_waiter(void *arg) {
    (void)arg;
    waiter_result = syscall(SYS_futex, &bitset_word, FUTEX_WAIT_BITSET, 0, NULL, NULL, 0x1);
    return NULL;
}

/* A connected loopback pair; exchanges one message each way. */
static void connected_pair(int *client, int *server, const char *what) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    check(l >= 0 && bind(l, (struct sockaddr *)&a, sizeof a) == 0 && listen(l, 4) == 0 &&
              getsockname(l, (struct sockaddr *)&a, &len) == 0,
          "listen");
    int c = socket(AF_INET, SOCK_STREAM, 0);
    check(c >= 0 && connect(c, (struct sockaddr *)&a, sizeof a) == 0, "connect");
    int s = accept(l, NULL, NULL);
    check(s >= 0, "accept");
    close(l);
    char buf[8] = {0};
    check(write(c, "ping", 4) == 4 && read(s, buf, sizeof buf) == 4 && memcmp(buf, "ping", 4) == 0,
          what);
    check(write(s, "pong", 4) == 4 && read(c, buf, sizeof buf) == 4 && memcmp(buf, "pong", 4) == 0,
          what);
    *client = c;
    *server = s;
}

int main(void) {
    long r;

    /* Only the number. */
    r = syscall(SYS_getpid);
    check(r == getpid(), "getpid, no argument words");

    /* Fewer words than six. */
    uint32_t word = 0;
    r = syscall(SYS_futex, &word, FUTEX_WAKE, 1);
    check(r == 0, "futex wake, three words: nobody to wake");
    struct timespec rel = {0, 2000000};
    errno = 0;
    r = syscall(SYS_futex, &word, FUTEX_WAIT, 1, &rel);
    check(r == -1 && errno == EAGAIN, "futex wait, four words: value differs");
    errno = 0;
    r = syscall(SYS_futex, &word, FUTEX_WAIT, 0, &rel);
    check(r == -1 && errno == ETIMEDOUT, "futex wait, four words: times out");

    /* All six: the sixth (the bitset) decides. */
    struct timespec abs = after_ms(2);
    errno = 0;
    r = syscall(SYS_futex, &word, FUTEX_WAIT_BITSET, 0, &abs, NULL, 0);
    check(r == -1 && errno == EINVAL, "futex wait, six words: empty bitset refused");
    abs = after_ms(2);
    errno = 0;
    r = syscall(SYS_futex, &word, FUTEX_WAIT_BITSET, 0, &abs, NULL, FUTEX_BITSET_MATCH_ANY);
    check(r == -1 && errno == ETIMEDOUT, "futex wait, six words: any bit, times out");

    pthread_t t;
    check(pthread_create(&t, NULL, bitset_waiter, NULL) == 0, "waiter thread");
    long woken = 0;
    for (int i = 0; i < 5000 && woken == 0; i++) {
        r = syscall(SYS_futex, &bitset_word, FUTEX_WAKE_BITSET, 1, NULL, NULL, 0x2);
        if (r != 0) {
            check(0, "futex wake, six words: bit 1 must wake nobody");
        }
        woken = syscall(SYS_futex, &bitset_word, FUTEX_WAKE_BITSET, 1, NULL, NULL, 0x1);
        if (woken == 0) {
            usleep(1000);
        }
    }
    check(woken == 1, "futex wake, six words: bit 0 wakes the waiter");
    pthread_join(t, NULL);
    check(waiter_result == 0, "futex wait, six words: woken");

    /* io_uring_setup through syscall(2), between two connections. */
    int c1, s1, c2, s2;
    connected_pair(&c1, &s1, "exchange before io_uring_setup");
    unsigned char params[120]; /* struct io_uring_params */
    memset(params, 0, sizeof params);
    errno = 0;
    r = syscall(SYS_io_uring_setup, 4, params);
    check(r >= 0 || errno == ENOSYS || errno == EPERM, "io_uring_setup: a ring, or refused");
    if (r >= 0) {
        close((int)r);
    }
    connected_pair(&c2, &s2, "exchange after io_uring_setup");
    close(c1);
    close(s1);
    close(c2);
    close(s2);
    printf("done\n");
    return 0;
}
