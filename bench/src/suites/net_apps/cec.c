/* fido-bench net-apps: the connect/echo/close loop of issue #19 item 8.
 *   cec server PORT          one thread: accept, echo one 64-byte message, close
 *   cec client PORT SECS     connect, send 64 bytes, read them back, close,
 *                            for SECS seconds; prints "conns N secs S bad B"
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MSG 64

static int full(int fd, char *b, int n, int writing) {
    int done = 0;
    while (done < n) {
        ssize_t r = writing ? write(fd, b + done, n - done) : read(fd, b + done, n - done);
        if (r <= 0) return -1;
        done += r;
    }
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(atoi(argv[2]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char buf[MSG];
    if (!strcmp(argv[1], "server")) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (void *)&a, sizeof a) || listen(l, 512)) { perror("listen"); return 1; }
        for (;;) {
            int c = accept(l, 0, 0);
            if (c < 0) continue;
            if (full(c, buf, MSG, 0) == 0) full(c, buf, MSG, 1);
            while (read(c, buf, MSG) > 0) {}
            close(c);
        }
    }
    double secs = argc > 3 ? atof(argv[3]) : 1, t0 = now(), t;
    long conns = 0, bad = 0;
    do {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (c < 0 || connect(c, (void *)&a, sizeof a)) { perror("connect"); return 1; }
        char out[MSG], in[MSG];
        for (int i = 0; i < MSG; i++) out[i] = (char)(conns * 31 + i);
        if (full(c, out, MSG, 1) || full(c, in, MSG, 0) || memcmp(in, out, MSG)) bad++;
        close(c);
        conns++;
        t = now() - t0;
    } while (t < secs);
    printf("conns %ld secs %.6f bad %ld\n", conns, t, bad);
    return bad != 0;
}
