/* vPipe from C: copy a file through the broker (blocking, with a pipe handle),
 * then send it to a socket asynchronously (one-shot, waiting on the op's eventfd
 * with poll()) while this program reads the other end, and check both copies.
 *
 *   cc -Iinclude examples/c/pipe_copy.c target/debug/libfido.a -lpthread -ldl -lm -o pipe_copy
 *   FIDO_BROKER=/path/to/broker.sock ./pipe_copy SRC DST
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fido.h"

static int fail(const char *what, int rc) {
    fprintf(stderr, "pipe_copy: %s: %s (%d)\n", what, fido_pipe_strerror(rc), rc);
    return 1;
}

static unsigned long long fnv(const unsigned char *p, size_t n) {
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x100000001b3ULL; }
    return h;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: pipe_copy SRC DST\n"); return 2; }
    int in = open(argv[1], O_RDONLY | O_CLOEXEC);
    if (in < 0) { perror(argv[1]); return 1; }
    struct stat st;
    fstat(in, &st);
    int out = open(argv[2], O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) { perror(argv[2]); return 1; }

    fido_pipe_client *c = NULL;
    int rc = fido_pipe_client_connect(NULL, "c-example", &c);
    if (rc) return fail("connect", rc);

    /* 1. file -> file, blocking, through a pipe handle. */
    fido_pipe *p = NULL;
    if ((rc = fido_pipe_create(c, in, out, &p))) return fail("create", rc);
    fido_pipe_result r;
    rc = fido_pipe_file_to_file(p, 0, (uint64_t)st.st_size, 0, &r);
    if (rc) return fail("file_to_file", rc);
    if (r.moved != (uint64_t)st.st_size || r.eof) { fprintf(stderr, "short copy %llu\n", (unsigned long long)r.moved); return 1; }
    /* Past the end: nothing moved, end of input. */
    rc = fido_pipe_file_to_file(p, (uint64_t)st.st_size + 10, 5, 0, &r);
    if (rc || r.moved != 0 || !r.eof) { fprintf(stderr, "past EOF: rc %d moved %llu eof %d\n", rc, (unsigned long long)r.moved, r.eof); return 1; }
    if ((rc = fido_pipe_destroy(p))) return fail("destroy", rc);

    /* A read-only descriptor as sink is refused with -EBADF. */
    rc = fido_pipe_create(c, out, in, &p);
    if (rc != -EBADF) { fprintf(stderr, "read-only sink accepted (rc %d)\n", rc); return 1; }

    /* 2. file -> socket, one-shot and asynchronous; we read the other end. */
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) { perror("socketpair"); return 1; }
    fido_pipe_op *op = NULL;
    rc = fido_pipe_start_once(c, in, sv[0], FIDO_PIPE_FILE_TO_SOCKET, 0, (uint64_t)st.st_size, 0, &op);
    if (rc) return fail("start_once", rc);
    int bell = fido_pipe_op_fd(op);
    if (bell < 0) return fail("op_fd", bell);
    unsigned char *got = malloc((size_t)st.st_size + 1);
    size_t have = 0;
    int done = 0;
    while (!done || have < (size_t)st.st_size) {
        struct pollfd fds[2] = {{sv[1], POLLIN, 0}, {bell, POLLIN, 0}};
        if (poll(fds, 2, 30000) <= 0) { fprintf(stderr, "timeout\n"); return 1; }
        if (fds[0].revents & POLLIN) {
            ssize_t n = read(sv[1], got + have, (size_t)st.st_size + 1 - have);
            if (n <= 0) { fprintf(stderr, "socket read %zd\n", n); return 1; }
            have += (size_t)n;
        }
        if (!done && (fds[1].revents & POLLIN)) {
            rc = fido_pipe_op_poll(op, &r);
            if (rc == -EAGAIN) continue;
            if (rc) return fail("async file_to_socket", rc);
            if (r.moved != (uint64_t)st.st_size) { fprintf(stderr, "async moved %llu\n", (unsigned long long)r.moved); return 1; }
            done = 1;
        }
    }
    fido_pipe_op_free(op);

    /* Check both copies. */
    unsigned char *src = malloc((size_t)st.st_size + 1), *dst = malloc((size_t)st.st_size + 1);
    if (pread(in, src, (size_t)st.st_size, 0) != st.st_size || pread(out, dst, (size_t)st.st_size, 0) != st.st_size) {
        fprintf(stderr, "reading back failed\n");
        return 1;
    }
    if (fnv(src, (size_t)st.st_size) != fnv(dst, (size_t)st.st_size) || fnv(src, (size_t)st.st_size) != fnv(got, have)) {
        fprintf(stderr, "checksum mismatch\n");
        return 1;
    }
    printf("OK %lld bytes file->file and file->socket through the broker (domain %llu)\n",
           (long long)st.st_size, (unsigned long long)fido_pipe_client_domain(c));
    fido_pipe_client_close(c);
    free(src); free(dst); free(got);
    return 0;
}
