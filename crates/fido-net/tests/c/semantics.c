/* Socket semantics probe for fido-net. Prints one line per observation; the
 * Rust test runs it over plain TCP and under the preload and requires the two
 * transcripts to be identical. Nothing printed may depend on timing, ports or
 * buffer sizes. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/time.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#define OUT(...) do { printf(__VA_ARGS__); printf("\n"); fflush(stdout); } while (0)
#define DIE(msg) do { perror(msg); exit(2); } while (0)

static const char *ename(int e) {
    switch (e) {
    case 0: return "OK";
    case EAGAIN: return "EAGAIN";
    case EPIPE: return "EPIPE";
    case ECONNRESET: return "ECONNRESET";
    case ENOTCONN: return "ENOTCONN";
    case EBADF: return "EBADF";
    case EINVAL: return "EINVAL";
    default: return strerror(e);
    }
}

static void pair(int *cli, int *srv) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0) DIE("socket");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(l, (void *)&a, sizeof a) || listen(l, 16)) DIE("bind/listen");
    socklen_t len = sizeof a;
    getsockname(l, (void *)&a, &len);
    *cli = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(*cli, (void *)&a, sizeof a)) DIE("connect");
    *srv = accept(l, NULL, NULL);
    if (*srv < 0) DIE("accept");
    close(l);
}

static void wr_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t r = write(fd, c, n);
        if (r <= 0) DIE("write");
        c += r; n -= r;
    }
}

static size_t rd_all(int fd, void *p, size_t n) {
    char *c = p; size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, c + got, n - got);
        if (r < 0) DIE("read");
        if (r == 0) break;
        got += r;
    }
    return got;
}

static int readable(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r = poll(&p, 1, 0);
    return r > 0 && (p.revents & POLLIN);
}

/* Wait (bounded) until fd is readable per poll: data sent over loopback may
 * take a moment to become visible to the peer under load. */
static int wait_readable(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 10000);
}

static void t_basic(void) {
    int c, s; pair(&c, &s);
    size_t n = 3 << 20;
    unsigned char *buf = malloc(n), *in = malloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 7 + (i >> 9));
    pid_t pid = fork();
    if (pid == 0) { close(s); wr_all(c, buf, n); close(c); _exit(0); }
    close(c);
    size_t got = rd_all(s, in, n);
    char extra; ssize_t e = read(s, &extra, 1);
    OUT("basic: got %zu, equal %d, then read %zd", got, got == n && !memcmp(buf, in, n), e);
    waitpid(pid, NULL, 0);
    close(s); free(buf); free(in);
}

static void t_flags(void) {
    int c, s; pair(&c, &s);
    char b[64];
    ssize_t r = recv(s, b, sizeof b, MSG_DONTWAIT);
    OUT("dontwait empty: %zd %s", r, ename(r < 0 ? errno : 0));
    send(c, "hello world", 11, 0);
    wait_readable(s);
    int nread = -1; ioctl(s, FIONREAD, &nread);
    OUT("fionread: %d", nread);
    r = recv(s, b, 5, MSG_PEEK);
    OUT("peek: %zd '%.*s'", r, (int)r, b);
    r = recv(s, b, sizeof b, MSG_PEEK);
    OUT("peek all: %zd", r);
    r = recv(s, b, sizeof b, 0);
    OUT("recv: %zd '%.*s'", r, (int)r, b);
    r = recv(s, b, sizeof b, MSG_DONTWAIT);
    OUT("dontwait drained: %zd %s", r, ename(r < 0 ? errno : 0));
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
    r = read(s, b, sizeof b);
    OUT("nonblock read: %zd %s", r, ename(r < 0 ? errno : 0));
    r = send(c, "", 0, 0);
    OUT("send 0: %zd", r);
    /* MSG_WAITALL across separate writes */
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) & ~O_NONBLOCK);
    pid_t pid = fork();
    if (pid == 0) {
        for (int i = 0; i < 3; i++) { usleep(20000); send(c, "abcdefghij", 10, 0); }
        _exit(0);
    }
    r = recv(s, b, 30, MSG_WAITALL);
    OUT("waitall: %zd '%.*s'", r, (int)r, b);
    waitpid(pid, NULL, 0);
    /* readv/writev, sendmsg/recvmsg with several iovecs */
    struct iovec wv[3] = {{"one-", 4}, {"two-", 4}, {"three", 5}};
    r = writev(c, wv, 3);
    OUT("writev: %zd", r);
    char x1[3], x2[4], x3[20];
    struct iovec rv[3] = {{x1, 3}, {x2, 4}, {x3, 20}};
    wait_readable(s);
    r = readv(s, rv, 3);
    OUT("readv: %zd '%.3s' '%.4s' '%.*s'", r, x1, x2, (int)(r > 7 ? r - 7 : 0), x3);
    struct msghdr mh = {0};
    mh.msg_iov = wv; mh.msg_iovlen = 3;
    r = sendmsg(c, &mh, MSG_NOSIGNAL);
    OUT("sendmsg: %zd", r);
    struct msghdr rh = {0};
    struct sockaddr_in from; rh.msg_name = &from; rh.msg_namelen = sizeof from;
    struct iovec rv2[3] = {{x1, 3}, {x2, 4}, {x3, 6}};
    rh.msg_iov = rv2; rh.msg_iovlen = 3;
    wait_readable(s);
    r = recvmsg(s, &rh, MSG_WAITALL);
    OUT("recvmsg: %zd namelen %u flags %d", r, (unsigned)rh.msg_namelen, rh.msg_flags);
    struct sockaddr_in sa; socklen_t sl = sizeof sa;
    send(c, "xyz", 3, 0);
    wait_readable(s);
    r = recvfrom(s, b, sizeof b, 0, (void *)&sa, &sl);
    OUT("recvfrom: %zd addrlen %u", r, (unsigned)sl);
    r = sendto(c, "q", 1, 0, NULL, 0);
    OUT("sendto: %zd", r);
    r = recv(s, b, 1, 0);
    OUT("recv after sendto: %zd", r);
    close(c); close(s);
}

static void t_poll(void) {
    int c, s; pair(&c, &s);
    OUT("poll empty: %d", readable(s));
    struct pollfd w = {.fd = c, .events = POLLOUT};
    OUT("poll writable: %d %d", poll(&w, 1, 0), !!(w.revents & POLLOUT));
    send(c, "0123456789", 10, 0);
    wait_readable(s);
    OUT("poll after send: %d", readable(s));
    char b[4];
    recv(s, b, 4, 0);
    OUT("poll after partial read: %d", readable(s));
    char bb[16];
    recv(s, bb, sizeof bb, 0);
    OUT("poll after full read: %d", readable(s));
    fd_set rs; FD_ZERO(&rs); FD_SET(s, &rs);
    struct timeval tv = {0, 0};
    OUT("select empty: %d", select(s + 1, &rs, NULL, NULL, &tv));
    send(c, "z", 1, 0);
    FD_ZERO(&rs); FD_SET(s, &rs);
    tv.tv_sec = 10;
    int n = select(s + 1, &rs, NULL, NULL, &tv);
    OUT("select data: %d %d", n, FD_ISSET(s, &rs) ? 1 : 0);
    recv(s, bb, sizeof bb, 0);
    /* epoll level-triggered */
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.fd = s}, out[4];
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    OUT("epoll lt empty: %d", epoll_wait(ep, out, 4, 0));
    send(c, "abcdef", 6, 0);
    n = epoll_wait(ep, out, 4, 10000);
    OUT("epoll lt data: %d %x", n, n > 0 ? out[0].events : 0);
    OUT("epoll lt again: %d", epoll_wait(ep, out, 4, 0));
    recv(s, bb, sizeof bb, 0);
    OUT("epoll lt drained: %d", epoll_wait(ep, out, 4, 0));
    /* edge-triggered, read until EAGAIN as the contract requires */
    ev.events = EPOLLIN | EPOLLET | EPOLLRDHUP;
    epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev);
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
    OUT("epoll et empty: %d", epoll_wait(ep, out, 4, 0));
    for (int round = 0; round < 3; round++) {
        send(c, "0123456789", 10, 0);
        n = epoll_wait(ep, out, 4, 10000);
        int total = 0; ssize_t r;
        while ((r = recv(s, bb, 3, 0)) > 0) total += r;
        OUT("epoll et round %d: %d %x read %d then %s", round, n, n > 0 ? out[0].events : 0, total, ename(errno));
        OUT("epoll et quiet %d: %d", round, epoll_wait(ep, out, 4, 0));
    }
    /* half close: EPOLLRDHUP, data first then EOF */
    send(c, "bye", 3, 0);
    shutdown(c, SHUT_WR);
    usleep(50000);
    n = epoll_wait(ep, out, 4, 10000);
    OUT("epoll rdhup: %d %x", n, n > 0 ? out[0].events : 0);
    ssize_t r = recv(s, bb, sizeof bb, 0);
    OUT("after rdhup: %zd '%.*s'", r, (int)(r > 0 ? r : 0), bb);
    r = recv(s, bb, sizeof bb, 0);
    OUT("then: %zd", r);
    /* the other direction still works after the peer's SHUT_WR */
    r = send(s, "reply", 5, 0);
    OUT("reply on half-closed: %zd", r);
    wait_readable(c);
    r = recv(c, bb, sizeof bb, 0);
    OUT("reply received: %zd '%.*s'", r, (int)(r > 0 ? r : 0), bb);
    r = send(c, "x", 1, MSG_NOSIGNAL);
    OUT("send after own shut_wr: %zd %s", r, ename(r < 0 ? errno : 0));
    shutdown(s, SHUT_WR);
    usleep(50000);
    struct pollfd hp = {.fd = c, .events = POLLIN | POLLRDHUP};
    poll(&hp, 1, 10000);
    OUT("both shut (client): in %d rdhup %d hup %d", !!(hp.revents & POLLIN), !!(hp.revents & POLLRDHUP), !!(hp.revents & POLLHUP));
    n = epoll_wait(ep, out, 4, 1000);
    OUT("both shut (server epoll): %d hup %d", n, n > 0 ? !!(out[0].events & EPOLLHUP) : 0);
    close(ep); close(c); close(s);
}

static volatile sig_atomic_t pipes;
static void on_pipe(int sig) { (void)sig; pipes++; }

static void t_close(void) {
    int c, s; char b[64]; ssize_t r;
    /* closed with unread data: the peer sees a reset */
    pair(&c, &s);
    send(c, "unread", 6, 0);
    wait_readable(s);
    close(s);
    usleep(50000);
    r = recv(c, b, sizeof b, 0);
    OUT("peer closed with unread data: %zd %s", r, ename(r < 0 ? errno : 0));
    close(c);
    /* writing to a closed peer: first write accepted, then EPIPE + SIGPIPE */
    pair(&c, &s);
    close(s);
    usleep(50000);
    r = recv(c, b, sizeof b, 0);
    OUT("read after peer close: %zd", r);
    signal(SIGPIPE, on_pipe);
    r = write(c, "a", 1);
    OUT("first write to closed peer: %zd", r);
    usleep(50000);
    r = write(c, "b", 1);
    int e = errno;
    OUT("second write: %zd %s sigpipe %d", r, ename(r < 0 ? e : 0), (int)pipes);
    r = send(c, "c", 1, MSG_NOSIGNAL);
    e = errno;
    OUT("send nosignal: %zd %s sigpipe %d", r, ename(r < 0 ? e : 0), (int)pipes);
    signal(SIGPIPE, SIG_DFL);
    close(c);
}

static void t_dup_fork(void) {
    int c, s; char b[64]; ssize_t r;
    pair(&c, &s);
    int d = dup(c);
    send(d, "via dup", 7, 0);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("dup: %zd '%.*s'", r, (int)r, b);
    close(c);
    send(d, "after close", 11, 0);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("dup after close of original: %zd", r);
    int d2 = fcntl(d, F_DUPFD_CLOEXEC, 100);
    int other = socket(AF_INET, SOCK_STREAM, 0);
    dup2(other, d);   /* closes d: d2 still names the connection */
    close(other);
    send(d2, "d2", 2, 0);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("fcntl dupfd: %zd", r);
    r = send(d, "x", 1, MSG_NOSIGNAL);
    OUT("dup2 replaced: %zd %s", r, ename(r < 0 ? errno : 0));
    int d3 = dup3(d2, 200, O_CLOEXEC);
    close(d2);
    send(d3, "d3", 2, 0);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("dup3: %zd", r);
    close(d3);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("eof after last dup closed: %zd", r);
    close(d); close(s);

    /* fork: both processes use the socket; the child's exit is not a close */
    pair(&c, &s);
    pid_t pid = fork();
    if (pid == 0) {
        char cb[16];
        ssize_t k = rd_all(c, cb, 4);
        wr_all(c, cb, k);         /* echo */
        wr_all(c, "child", 5);
        _exit(0);
    }
    wr_all(s, "ping", 4);
    r = rd_all(s, b, 9);
    OUT("fork echo: %zd '%.*s'", r, (int)r, b);
    waitpid(pid, NULL, 0);
    send(c, "parent", 6, 0);   /* the parent still holds the client end */
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("after child exit: %zd", r);
    close(c);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("eof after parent close: %zd", r);
    close(s);

    /* peer process killed: EOF */
    pair(&c, &s);
    pid = fork();
    if (pid == 0) {
        close(s);
        char cb[8];
        rd_all(c, cb, 3);
        wr_all(c, "r", 1);
        pause();
        _exit(0);
    }
    close(c);
    wr_all(s, "abc", 3);
    rd_all(s, b, 1);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("peer killed: %zd %s", r, ename(r < 0 ? errno : 0));
    close(s);
}

/* The errors TCP reports when a peer dies or resets, and in what order. */
static void t_resets(void) {
    int c, s; char b[64]; ssize_t r; int e;
    pipes = 0;
    signal(SIGPIPE, on_pipe);
    /* a reader killed during a bulk send: ECONNRESET, then EPIPE + SIGPIPE
     * (TCP: the dying reader's unread data makes its close a RST). The
     * reader reads 256 KiB and stops; a helper kills it while the writer
     * is blocked on full buffers. */
    pair(&c, &s);
    pid_t pid = fork();
    if (pid == 0) {
        close(s);
        static char sink[1 << 18];
        rd_all(c, sink, sizeof sink);
        pause();
        _exit(0);
    }
    close(c);
    pid_t killer = fork();
    if (killer == 0) { usleep(300000); kill(pid, SIGKILL); _exit(0); }
    static char chunk[1 << 16];
    e = 0;
    for (int i = 0; i < 16384; i++) {
        r = write(s, chunk, sizeof chunk);
        if (r < 0) { e = errno; break; }
    }
    waitpid(pid, NULL, 0);
    waitpid(killer, NULL, 0);
    OUT("bulk send to a killed reader: %s sigpipe %d", ename(e), (int)pipes);
    r = write(s, "y", 1);
    e = errno;
    OUT("next write: %zd %s sigpipe %d", r, ename(r < 0 ? e : 0), (int)pipes);
    r = recv(s, b, sizeof b, MSG_DONTWAIT);
    OUT("read after the reset: %zd %s", r, ename(r < 0 ? errno : 0));
    int soerr = -1; socklen_t sl = sizeof soerr;
    getsockopt(s, SOL_SOCKET, SO_ERROR, &soerr, &sl);
    OUT("SO_ERROR after: %s", ename(soerr));
    close(s);

    /* a peer killed with our data unread: the reader of the other
     * direction sees ECONNRESET, with POLLERR and POLLHUP */
    pair(&c, &s);
    pid = fork();
    if (pid == 0) { close(s); wr_all(c, "r", 1); pause(); _exit(0); }
    close(c);
    rd_all(s, b, 1);
    wr_all(s, "unread", 6);
    usleep(50000);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    wait_readable(s);
    struct pollfd p = {.fd = s, .events = POLLIN | POLLOUT | POLLRDHUP};
    poll(&p, 1, 1000);
    OUT("poll after the reset: in %d out %d err %d hup %d rdhup %d", !!(p.revents & POLLIN),
        !!(p.revents & POLLOUT), !!(p.revents & POLLERR), !!(p.revents & POLLHUP),
        !!(p.revents & POLLRDHUP));
    soerr = -1; sl = sizeof soerr;
    getsockopt(s, SOL_SOCKET, SO_ERROR, &soerr, &sl);
    OUT("SO_ERROR: %s", ename(soerr));
    r = recv(s, b, sizeof b, 0);
    OUT("recv after SO_ERROR took it: %zd %s", r, ename(r < 0 ? errno : 0));
    r = send(s, "z", 1, MSG_NOSIGNAL);
    OUT("send after: %zd %s", r, ename(r < 0 ? errno : 0));
    close(s);

    /* the same without SO_ERROR: the receive reports the reset */
    pair(&c, &s);
    pid = fork();
    if (pid == 0) { close(s); wr_all(c, "r", 1); pause(); _exit(0); }
    close(c);
    rd_all(s, b, 1);
    wr_all(s, "unread", 6);
    usleep(50000);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("recv from a killed peer that had our data: %zd %s", r, ename(r < 0 ? errno : 0));
    r = recv(s, b, sizeof b, 0);
    OUT("then: %zd %s", r, ename(r < 0 ? errno : 0));
    close(s);
    signal(SIGPIPE, SIG_DFL);
}

static void t_names(void) {
    int c, s; pair(&c, &s);
    struct sockaddr_in a1, a2, b1, b2; socklen_t l = sizeof a1;
    getsockname(c, (void *)&a1, &l); l = sizeof a2; getpeername(s, (void *)&a2, &l);
    l = sizeof b1; getpeername(c, (void *)&b1, &l); l = sizeof b2; getsockname(s, (void *)&b2, &l);
    OUT("names: client==server's peer %d, server==client's peer %d",
        a1.sin_port == a2.sin_port && a1.sin_addr.s_addr == a2.sin_addr.s_addr,
        b1.sin_port == b2.sin_port && b1.sin_addr.s_addr == b2.sin_addr.s_addr);
    int v = 0; socklen_t vl = sizeof v;
    getsockopt(c, SOL_SOCKET, SO_TYPE, &v, &vl);
    OUT("so_type stream %d", v == SOCK_STREAM);
    vl = sizeof v; getsockopt(c, SOL_SOCKET, SO_ERROR, &v, &vl);
    OUT("so_error %d", v);
    v = 1; setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &v, sizeof v);
    v = 0; vl = sizeof v; getsockopt(c, IPPROTO_TCP, TCP_NODELAY, &v, &vl);
    OUT("nodelay %d", v != 0);
    /* The accepted end is accelerated from accept on: its Nagle and cork
       settings must read back as the program set them (the library runs the
       real socket with Nagle and the cork off). */
    v = 7; vl = sizeof v; getsockopt(s, IPPROTO_TCP, TCP_NODELAY, &v, &vl);
    OUT("server nodelay default %d len %u", v, (unsigned)vl);
    v = 1; int rr = setsockopt(s, IPPROTO_TCP, TCP_CORK, &v, sizeof v);
    v = 0; vl = sizeof v; getsockopt(s, IPPROTO_TCP, TCP_CORK, &v, &vl);
    OUT("cork set %d get %d", rr, v);
    v = 0; setsockopt(s, IPPROTO_TCP, TCP_CORK, &v, sizeof v);
    v = 9; vl = sizeof v; getsockopt(s, IPPROTO_TCP, TCP_CORK, &v, &vl);
    OUT("cork cleared %d", v);
    v = 5; setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &v, sizeof v);
    unsigned char one = 0xff; vl = 1; rr = getsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, &vl);
    OUT("nodelay short get %d val %u len %u", rr, one, (unsigned)vl);
    short sh = 1; rr = setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &sh, sizeof sh);
    OUT("nodelay short set %d %s", rr, ename(rr < 0 ? errno : 0));
    struct timeval tv = {0, 100000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char b[8];
    ssize_t r = recv(s, b, sizeof b, 0);
    OUT("rcvtimeo: %zd %s", r, ename(r < 0 ? errno : 0));
    close(c); close(s);
}

static void t_nonblock_full(void) {
    int c, s; pair(&c, &s);
    fcntl(c, F_SETFL, fcntl(c, F_GETFL) | O_NONBLOCK);
    char chunk[65536]; memset(chunk, 'q', sizeof chunk);
    size_t total = 0; ssize_t r; int spins = 0;
    while ((r = send(c, chunk, sizeof chunk, 0)) != -1 || errno != EAGAIN) {
        if (r > 0) total += r;
        if (++spins > 100000) break;
    }
    OUT("nonblocking writer stopped with %s", ename(errno));
    /* everything accepted arrives, exactly */
    size_t got = 0; char in[65536];
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
    while (got < total) {
        r = recv(s, in, sizeof in, 0);
        if (r > 0) got += r;
        else if (r < 0 && errno == EAGAIN) { struct pollfd p = {s, POLLIN, 0}; poll(&p, 1, 1000); }
        else break;
    }
    OUT("reader got everything accepted: %d", got == total);
    /* writer becomes writable again and can continue */
    struct pollfd p = {.fd = c, .events = POLLOUT};
    OUT("writable again: %d", poll(&p, 1, 10000) == 1);
    r = send(c, "tail", 4, 0);
    OUT("send after drain: %zd", r);
    close(c); close(s);
}

struct th { int fd; int id; int ok; };
static void *echo_client(void *arg) {
    struct th *t = arg;
    unsigned char out[1500], in[1500];
    t->ok = 1;
    for (int i = 0; i < 200; i++) {
        size_t n = 1 + (i * 37 + t->id * 11) % sizeof out;
        for (size_t k = 0; k < n; k++) out[k] = (unsigned char)(k ^ i ^ t->id);
        wr_all(t->fd, out, n);
        if (rd_all(t->fd, in, n) != n || memcmp(in, out, n)) { t->ok = 0; break; }
    }
    return NULL;
}
static void *echo_server(void *arg) {
    struct th *t = arg;
    char b[4096]; ssize_t r;
    while ((r = read(t->fd, b, sizeof b)) > 0) wr_all(t->fd, b, r);
    return NULL;
}

static void t_threads(void) {
    enum { N = 8 };
    struct th cl[N], sv[N]; pthread_t tc[N], ts[N];
    for (int i = 0; i < N; i++) {
        pair(&cl[i].fd, &sv[i].fd);
        cl[i].id = sv[i].id = i;
        pthread_create(&ts[i], NULL, echo_server, &sv[i]);
        pthread_create(&tc[i], NULL, echo_client, &cl[i]);
    }
    int ok = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(tc[i], NULL);
        shutdown(cl[i].fd, SHUT_WR);
        pthread_join(ts[i], NULL);
        ok += cl[i].ok;
        close(cl[i].fd); close(sv[i].fd);
    }
    OUT("threads: %d/%d echo streams intact", ok, N);
    /* two threads writing and reading the same socket concurrently */
    int c, s; pair(&c, &s);
    struct th a = {c, 1, 0}, b = {s, 1, 0};
    pthread_t pa, pb;
    pthread_create(&pb, NULL, echo_server, &b);
    pthread_create(&pa, NULL, echo_client, &a);
    pthread_join(pa, NULL);
    shutdown(c, SHUT_WR);
    pthread_join(pb, NULL);
    OUT("duplex thread stream: %d", a.ok);
    close(c); close(s);
}

static void t_sendfile(void) {
    char path[] = "/tmp/fido-net-sfXXXXXX";
    int f = mkstemp(path);
    unlink(path);
    size_t n = 1 << 20;
    unsigned char *buf = malloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 13 + 5);
    wr_all(f, buf, n);
    int c, s; pair(&c, &s);
    pid_t pid = fork();
    if (pid == 0) {
        close(s);
        off_t off = 4096;
        size_t left = n - 4096;
        while (left) {
            ssize_t r = sendfile(c, f, &off, left);
            if (r <= 0) _exit(1);
            left -= r;
        }
        lseek(f, 0, SEEK_SET);
        ssize_t r = sendfile(c, f, NULL, 100);
        _exit(r == 100 && lseek(f, 0, SEEK_CUR) == 100 ? 0 : 1);
    }
    close(c);
    unsigned char *in = malloc(n);
    size_t got = rd_all(s, in, n);
    int st; waitpid(pid, &st, 0);
    OUT("sendfile: got %zu, offset-part equal %d, cursor-part equal %d, child ok %d", got,
        !memcmp(in, buf + 4096, n - 4096), !memcmp(in + n - 4096, buf, 100), WIFEXITED(st) && WEXITSTATUS(st) == 0);
    close(s); close(f); free(buf); free(in);
}

/* sendmmsg/recvmmsg on a stream socket: each message's bytes in order,
 * each receive taking up to its buffer. */
static void t_mmsg(void) {
    int c, s; pair(&c, &s);
    char a[] = "first-", b[] = "second-", d[] = "third";
    struct iovec v[3] = {{a, 6}, {b, 7}, {d, 5}};
    struct mmsghdr m[3];
    memset(m, 0, sizeof m);
    for (int i = 0; i < 3; i++) { m[i].msg_hdr.msg_iov = &v[i]; m[i].msg_hdr.msg_iovlen = 1; }
    int n = sendmmsg(c, m, 3, 0);
    OUT("sendmmsg: %d lens %u %u %u", n, m[0].msg_len, m[1].msg_len, m[2].msg_len);
    wait_readable(s);
    char x[3][8];
    struct iovec w[3] = {{x[0], 6}, {x[1], 7}, {x[2], 8}};
    memset(m, 0, sizeof m);
    for (int i = 0; i < 3; i++) { m[i].msg_hdr.msg_iov = &w[i]; m[i].msg_hdr.msg_iovlen = 1; }
    n = recvmmsg(s, m, 3, MSG_DONTWAIT, NULL);
    OUT("recvmmsg: %d '%.*s' '%.*s' '%.*s'", n, (int)m[0].msg_len, x[0], (int)m[1].msg_len, x[1],
        n > 2 ? (int)m[2].msg_len : 0, x[2]);
    n = recvmmsg(s, m, 3, MSG_DONTWAIT, NULL);
    OUT("recvmmsg empty: %d %s", n, ename(n < 0 ? errno : 0));
    wr_all(c, "more", 4);
    wait_readable(s);
    n = recvmmsg(s, m, 3, MSG_WAITFORONE, NULL);
    OUT("recvmmsg waitforone: %d '%.*s'", n, (int)m[0].msg_len, x[0]);
    close(c); close(s);
}

/* Sockets wrapped in stdio streams: glibc reads and writes them with its
 * own internal calls, mixed here with write(2) on the same descriptor. */
static void t_stdio(void) {
    int c, s; pair(&c, &s);
    FILE *fc = fdopen(c, "r+"), *fs = fdopen(s, "r+");
    char l[64];
    fprintf(fc, "line from client\n");
    fflush(fc);
    if (!fgets(l, sizeof l, fs)) strcpy(l, "none\n");
    OUT("stdio server got: %.*s", (int)strcspn(l, "\n"), l);
    wr_all(s, "reply by write\n", 15);
    if (!fgets(l, sizeof l, fc)) strcpy(l, "none\n");
    OUT("stdio client got: %.*s", (int)strcspn(l, "\n"), l);
    fclose(fc);
    OUT("stdio eof: %s", fgets(l, sizeof l, fs) ? "data" : "eof");
    fclose(fs);
}

/* The data path through syscall(2), as programs with their own thin
 * wrappers make it. */
static void t_raw_calls(void) {
    int c, s; pair(&c, &s);
    char b[32];
    long w = syscall(SYS_write, c, "by SYS_write", 12);
    wait_readable(s);
    long r = syscall(SYS_read, s, b, sizeof b);
    OUT("SYS_write/SYS_read: %ld %ld '%.*s'", w, r, (int)(r > 0 ? r : 0), b);
    w = syscall(SYS_sendto, s, "by SYS_sendto", 13, 0, NULL, 0);
    wait_readable(c);
    r = syscall(SYS_recvfrom, c, b, sizeof b, 0, NULL, NULL);
    OUT("SYS_sendto/SYS_recvfrom: %ld %ld '%.*s'", w, r, (int)(r > 0 ? r : 0), b);
    r = syscall(SYS_recvfrom, c, b, sizeof b, MSG_DONTWAIT, NULL, NULL);
    OUT("SYS_recvfrom empty: %ld %s", r, ename(r < 0 ? errno : 0));
    close(c); close(s);
}

static void t_splice(void) {
    int c, s, p[2]; char b[64]; ssize_t r;
    pair(&c, &s);
    if (pipe(p)) DIE("pipe");
    wr_all(p[1], "spliced-in", 10);
    r = splice(p[0], NULL, c, NULL, 10, 0);
    OUT("splice pipe->socket: %zd", r);
    wait_readable(s);
    r = recv(s, b, sizeof b, 0);
    OUT("received: %zd '%.*s'", r, (int)(r > 0 ? r : 0), b);
    send(s, "spliced-out", 11, 0);
    wait_readable(c);
    r = splice(c, NULL, p[1], NULL, 64, 0);
    OUT("splice socket->pipe: %zd", r);
    r = read(p[0], b, sizeof b);
    OUT("from pipe: %zd '%.*s'", r, (int)(r > 0 ? r : 0), b);
    r = recv(c, b, sizeof b, MSG_DONTWAIT);
    OUT("socket drained: %zd", r);
    close(p[0]); close(p[1]); close(c); close(s);
}


/* Waiting: what poll, select and epoll owe a program whatever the library does
 * to compute readiness (lazy arming): interruption by a signal, two threads
 * waiting for one socket, one-shot registrations, an epoll set shared with a
 * forked child, select's time left, an epoll set nested in another. */
static volatile sig_atomic_t alarms;
static void on_alarm(int sig) { (void)sig; alarms++; }
static void alarm_in_ms(int ms) {
    struct itimerval it = {{0, 0}, {0, ms * 1000}};
    setitimer(ITIMER_REAL, &it, NULL);
}
struct waiter { int fd; int ep; int woke; };
static void *epoll_waiter(void *arg) {
    struct waiter *w = arg; struct epoll_event out[2];
    w->woke = epoll_wait(w->ep, out, 2, 10000) == 1 && (out[0].events & EPOLLIN);
    return NULL;
}
static void *poll_waiter(void *arg) {
    struct waiter *w = arg;
    struct pollfd p = {.fd = w->fd, .events = POLLIN};
    w->woke = poll(&p, 1, 10000) == 1 && (p.revents & POLLIN);
    return NULL;
}
static void t_waits(void) {
    int c, s; pair(&c, &s);
    char bb[64];
    struct sigaction sa = {0};
    sa.sa_handler = on_alarm; /* no SA_RESTART: waits must say EINTR */
    sigaction(SIGALRM, &sa, NULL);
    struct pollfd p = {.fd = s, .events = POLLIN};
    alarm_in_ms(30);
    int r = poll(&p, 1, 10000);
    OUT("poll interrupted: %d %s alarms %d", r, ename(r < 0 ? errno : 0), (int)alarms);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 77}, out[4];
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    alarm_in_ms(30);
    r = epoll_wait(ep, out, 4, 10000);
    OUT("epoll interrupted: %d %s alarms %d", r, ename(r < 0 ? errno : 0), (int)alarms);
    fd_set rs; FD_ZERO(&rs); FD_SET(s, &rs);
    struct timeval tv = {10, 0};
    alarm_in_ms(30);
    r = select(s + 1, &rs, NULL, NULL, &tv);
    OUT("select interrupted: %d %s alarms %d", r, ename(r < 0 ? errno : 0), (int)alarms);
    /* ppoll with SIGALRM blocked for the wait: not interrupted, times out */
    sigset_t mask; sigemptyset(&mask); sigaddset(&mask, SIGALRM);
    sigset_t old; sigprocmask(SIG_BLOCK, &mask, &old);
    sigset_t during = old; sigaddset(&during, SIGALRM);
    struct timespec ts = {0, 100000000};
    alarm_in_ms(10);
    r = ppoll(&p, 1, &ts, &during);
    OUT("ppoll with alarm blocked: %d", r);
    sigprocmask(SIG_SETMASK, &old, NULL); /* the pending alarm runs now */
    OUT("alarm after ppoll: %d", (int)alarms);
    /* a bad timeout is the kernel's EINVAL */
    struct timespec bad = {0, 2000000000L};
    r = ppoll(&p, 1, &bad, NULL);
    OUT("ppoll bad timeout: %d %s", r, ename(r < 0 ? errno : 0));
    /* select reports the time left */
    FD_ZERO(&rs); FD_SET(s, &rs);
    tv.tv_sec = 0; tv.tv_usec = 50000;
    r = select(s + 1, &rs, NULL, NULL, &tv);
    OUT("select timeout: %d left %ld.%06ld", r, (long)tv.tv_sec, (long)tv.tv_usec);
    /* data while waiting; the event carries the registered data */
    send(c, "hello", 5, 0);
    r = epoll_wait(ep, out, 4, 10000);
    OUT("epoll data: %d %llu %x", r, r > 0 ? (unsigned long long)out[0].data.u64 : 0ULL, r > 0 ? out[0].events : 0);
    recv(s, bb, sizeof bb, 0);
    /* two threads waiting for one socket both wake */
    struct waiter we = {s, ep, 0}, wp = {s, -1, 0};
    pthread_t te, tp;
    pthread_create(&te, NULL, epoll_waiter, &we);
    pthread_create(&tp, NULL, poll_waiter, &wp);
    usleep(50000);
    send(c, "x", 1, 0);
    pthread_join(te, NULL); pthread_join(tp, NULL);
    OUT("two waiters woke: epoll %d poll %d", we.woke, wp.woke);
    recv(s, bb, sizeof bb, 0);
    /* one-shot: reported once, then silent until re-armed */
    ev.events = EPOLLIN | EPOLLONESHOT;
    epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev);
    send(c, "1", 1, 0);
    r = epoll_wait(ep, out, 4, 10000);
    OUT("oneshot first: %d", r);
    OUT("oneshot silent: %d", epoll_wait(ep, out, 4, 100));
    epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev);
    OUT("oneshot re-armed: %d", epoll_wait(ep, out, 4, 10000));
    recv(s, bb, sizeof bb, 0);
    ev.events = EPOLLIN;
    epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev);
    /* an epoll set shared with a forked child that waits on it */
    pid_t pid = fork();
    if (pid == 0) {
        int n = epoll_wait(ep, out, 4, 10000);
        _exit(n == 1 && out[0].data.u64 == 77 ? 0 : 1);
    }
    usleep(50000);
    send(c, "forked", 6, 0);
    int st = 0; waitpid(pid, &st, 0);
    OUT("child woke on shared epoll: %d", WIFEXITED(st) && WEXITSTATUS(st) == 0);
    recv(s, bb, sizeof bb, 0);
    close(ep); close(c); close(s);
    /* an epoll set nested in another: the outer set sees the inner's readiness */
    pair(&c, &s);
    int outer = epoll_create1(0), inner = epoll_create1(0);
    ev.events = EPOLLIN; ev.data.u64 = 5;
    epoll_ctl(inner, EPOLL_CTL_ADD, s, &ev);
    ev.data.u64 = 9;
    epoll_ctl(outer, EPOLL_CTL_ADD, inner, &ev);
    OUT("nested quiet: %d", epoll_wait(outer, out, 4, 0));
    send(c, "nested", 6, 0);
    r = epoll_wait(outer, out, 4, 10000);
    OUT("nested outer: %d %llu", r, r > 0 ? (unsigned long long)out[0].data.u64 : 0ULL);
    r = epoll_wait(inner, out, 4, 0);
    OUT("nested inner: %d %llu", r, r > 0 ? (unsigned long long)out[0].data.u64 : 0ULL);
    r = recv(s, bb, sizeof bb, 0);
    OUT("nested read: %d", r);
    close(outer); close(inner); close(c); close(s);
    signal(SIGALRM, SIG_DFL);
}


/* A client connecting to the unspecified address (the kernel makes it
 * loopback), as sockperf does by default. */
static void t_any(void) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(l, (void *)&a, sizeof a) || listen(l, 4)) DIE("bind/listen");
    socklen_t len = sizeof a;
    getsockname(l, (void *)&a, &len);
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (void *)&a, sizeof a)) DIE("connect any");
    int s = accept(l, NULL, NULL);
    send(c, "any", 3, 0);
    char b[8]; ssize_t r = recv(s, b, sizeof b, 0);
    OUT("connect to 0.0.0.0: %zd '%.*s'", r, (int)(r > 0 ? r : 0), b);
    close(c); close(s); close(l);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *only = argc > 1 ? argv[1] : "";
#define RUN(t) if (!*only || strstr(#t, only)) t()
    RUN(t_basic);
    RUN(t_flags);
    RUN(t_poll);
    RUN(t_close);
    RUN(t_dup_fork);
    RUN(t_resets);
    RUN(t_names);
    RUN(t_nonblock_full);
    RUN(t_threads);
    RUN(t_sendfile);
    RUN(t_splice);
    RUN(t_mmsg);
    RUN(t_stdio);
    RUN(t_raw_calls);
    RUN(t_any);
    RUN(t_waits); /* last: its nested epoll set turns lazy arming off */
    OUT("done");
    return 0;
}
