/* Lazy arming elides doorbells: one thread sends 2000 small messages with
 * short pauses while another reads them without ever waiting (non-blocking
 * reads, yielding on EAGAIN). With lazy arming the reader never arms, so the
 * writer rings no doorbell beyond the connection's first; with eager arming
 * (FIDO_NET_LAZY=0) every read that empties the ring arms, and most messages
 * cost a doorbell (at least the 19 that follow a long pause). The test reads the doorbell count from the statistics.
 * Prints "ok MESSAGES" when every byte arrived in order. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

enum { MESSAGES = 2000, SIZE = 8 };

static void *writer(void *arg) {
    int fd = *(int *)arg;
    for (int i = 0; i < MESSAGES; i++) {
        unsigned char m[SIZE];
        for (int k = 0; k < SIZE; k++) m[k] = (unsigned char)(i + k);
        if (write(fd, m, SIZE) != SIZE) { perror("write"); exit(1); }
        /* Every 100th message a long pause: even on a loaded machine the
         * reader then empties the ring (and, eagerly, arms) before the next. */
        usleep(i % 100 == 99 ? 5000 : 50);
    }
    return NULL;
}

int main(void) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(l, (void *)&a, sizeof a) || listen(l, 1)) { perror("listen"); return 1; }
    socklen_t len = sizeof a;
    getsockname(l, (void *)&a, &len);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (void *)&a, sizeof a)) { perror("connect"); return 1; }
    int s = accept(l, NULL, NULL);
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
    pthread_t t;
    pthread_create(&t, NULL, writer, &c);
    long got = 0;
    unsigned char b[4096];
    while (got < (long)MESSAGES * SIZE) {
        ssize_t r = read(s, b, sizeof b);
        if (r < 0 && errno == EAGAIN) { sched_yield(); continue; }
        if (r <= 0) { perror("read"); return 1; }
        for (ssize_t k = 0; k < r; k++) {
            long pos = got + k;
            if (b[k] != (unsigned char)(pos / SIZE + pos % SIZE)) { fprintf(stderr, "corrupt at %ld\n", pos); return 1; }
        }
        got += r;
    }
    pthread_join(t, NULL);
    printf("ok %d\n", MESSAGES);
    close(c); close(s); close(l);
    return 0;
}
