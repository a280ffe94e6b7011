/* A program near its descriptor limit (RLIMIT_NOFILE lowered to LIMIT)
 * holding N connections open at once: under the preload it must get every
 * descriptor it would get over plain TCP (the library's own descriptors
 * yield). Sockets are made without close-on-exec, so the library keeps a
 * segment descriptor for each (an exec could hand them on) until the
 * program runs short.
 *
 *   server PORT N LIMIT   accepts N connections, then echoes 4 bytes on each
 *   client PORT N LIMIT   opens N connections, then sends and reads 4 bytes
 *                         on each. Both print "ok N" (or "FAIL ...").
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

static void die(const char *what, int i) {
    printf("FAIL %s %d (errno %d: %s)\n", what, i, errno, strerror(errno));
    exit(1);
}

static void limit(int n) {
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = n;
    if (setrlimit(RLIMIT_NOFILE, &rl))
        die("setrlimit", n);
}

static void xfer(int fd, int echo, int i) {
    char b[4];
    if (!echo && write(fd, "ping", 4) != 4)
        die("write", i);
    size_t got = 0;
    while (got < 4) {
        ssize_t r = read(fd, b + got, 4 - got);
        if (r <= 0)
            die("read", i);
        got += r;
    }
    if (echo && write(fd, b, 4) != 4)
        die("echo", i);
    if (!echo && memcmp(b, "ping", 4))
        die("echoed bytes", i);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc != 5)
        return 2;
    int port = atoi(argv[2]), n = atoi(argv[3]);
    int *fds = calloc(n, sizeof *fds);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (strcmp(argv[1], "server") == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1024))
            die("listen", 0);
        limit(atoi(argv[4]));
        printf("listening\n");
        for (int i = 0; i < n; i++)
            if ((fds[i] = accept(l, NULL, NULL)) < 0)
                die("accept", i);
        for (int i = 0; i < n; i++)
            xfer(fds[i], 1, i);
    } else {
        limit(atoi(argv[4]));
        for (int i = 0; i < n; i++) {
            fds[i] = socket(AF_INET, SOCK_STREAM, 0);
            if (fds[i] < 0)
                die("socket", i);
            if (connect(fds[i], (struct sockaddr *)&a, sizeof a))
                die("connect", i);
        }
        for (int i = 0; i < n; i++)
            xfer(fds[i], 0, i);
    }
    printf("ok %d\n", n);
    return 0;
}
