/* Readiness must be exact for readers: when epoll (level-triggered) reports a
 * socket readable, the next non-blocking read returns data or EOF, never
 * EAGAIN. A child writes N small messages with short pauses; the parent reads
 * with epoll + non-blocking reads (one read per readiness, as wrk does) and,
 * after each, keeps reading eagerly for a while without waiting for readiness
 * (legitimate EAGAINs there are not counted): eager reads consume data whose
 * doorbell may still be on its way, the race behind stale doorbells.
 * Usage: readiness [messages] [eager_us] [gap_us]. Prints a summary; exits 1
 * if any read right after readiness said EAGAIN or the bytes are wrong. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#define MSG 16

static long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000LL + t.tv_nsec / 1000;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 300;
    int eager_us = argc > 2 ? atoi(argv[2]) : 1500;
    int gap_us = argc > 3 ? atoi(argv[3]) : 300;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (bind(l, (void *)&a, sizeof a) || listen(l, 1) || getsockname(l, (void *)&a, &al)) {
        perror("listen");
        return 2;
    }
    pid_t pid = fork();
    if (pid == 0) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (void *)&a, sizeof a)) {
            perror("connect");
            _exit(2);
        }
        unsigned seed = 1;
        for (int i = 0; i < n; i++) {
            unsigned char m[MSG];
            for (int k = 0; k < MSG; k++) m[k] = (unsigned char)(i * 7 + k);
            if (write(c, m, MSG) != MSG) {
                perror("write");
                _exit(2);
            }
            usleep(gap_us / 2 + rand_r(&seed) % (gap_us + 1));
        }
        close(c);
        _exit(0);
    }
    int s = accept(l, NULL, NULL);
    if (s < 0) {
        perror("accept");
        return 2;
    }
    fcntl(s, F_SETFL, O_NONBLOCK);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = s};
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    long long total = 0, spurious = 0, wakeups = 0, eager_hits = 0;
    int bad = 0, eof = 0;
    unsigned char buf[4096];
    while (!eof) {
        int r = epoll_wait(ep, &ev, 1, 20000);
        if (r == 0) {
            fprintf(stderr, "epoll_wait timed out after %lld bytes\n", total);
            return 2;
        }
        if (r < 0) {
            if (errno == EINTR) continue;
            perror("epoll_wait");
            return 2;
        }
        wakeups++;
        ssize_t k = read(s, buf, sizeof buf);
        if (k < 0 && errno == EAGAIN) {
            spurious++;
            continue;
        }
        if (k < 0) {
            perror("read");
            return 2;
        }
        for (long long off = 0; off < k; off++) {
            long long p = total + off;
            if (buf[off] != (unsigned char)((p / MSG) * 7 + p % MSG)) bad = 1;
        }
        total += k;
        if (k == 0) break;
        /* Eager reads: no readiness asked for. */
        long long t0 = now_us();
        while (now_us() - t0 < eager_us) {
            ssize_t e = read(s, buf, sizeof buf);
            if (e == 0) {
                eof = 1;
                break;
            }
            if (e > 0) {
                for (long long off = 0; off < e; off++) {
                    long long p = total + off;
                    if (buf[off] != (unsigned char)((p / MSG) * 7 + p % MSG)) bad = 1;
                }
                total += e;
                eager_hits++;
            }
        }
    }
    int st;
    waitpid(pid, &st, 0);
    printf("messages %d bytes %lld wakeups %lld eager_hits %lld spurious_eagain %lld content %s\n", n,
           total, wakeups, eager_hits, spurious, bad ? "BAD" : "ok");
    return (spurious || bad || total != (long long)n * MSG) ? 1 : 0;
}
