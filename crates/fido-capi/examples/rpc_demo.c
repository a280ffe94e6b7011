/* VMRPC from C: `rpc_demo server SERVICE` serves three methods,
 * `rpc_demo client SERVICE` calls them and checks every result.
 * Both join the broker at $FIDO_BROKER. Built and run by
 * crates/fido-capi/tests/c_rpc.rs. */
#include <fido.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <ctype.h>

enum { M_SUM = 0, M_UPPER = 1, M_FAIL = 2 };

struct sum_args { fido_rpc_ref values; uint64_t count; }; /* u32 values */
struct upper_args { fido_rpc_ref text; };

static int h_sum(void *user, fido_rpc_ctx *call, const void *args, size_t len) {
    (void)user;
    struct sum_args a;
    if (len != sizeof a) return -1;
    memcpy(&a, args, sizeof a); /* copy the header out once, then check it */
    if (a.values.len != a.count * sizeof(uint32_t)) return -1;
    const uint32_t *v = fido_rpc_call_resolve(call, a.values);
    if (a.count && !v) return -1; /* outside the caller's grant */
    uint64_t s = 0;
    for (uint64_t i = 0; i < a.count; i++) s += v[i];
    return fido_rpc_call_reply(call, &s, sizeof s);
}

static int h_upper(void *user, fido_rpc_ctx *call, const void *args, size_t len) {
    (void)user;
    struct upper_args a;
    if (len != sizeof a) return -1;
    memcpy(&a, args, sizeof a);
    const char *in = fido_rpc_call_resolve(call, a.text);
    if (!in) return -1;
    fido_rpc_ref out;
    char *o = fido_rpc_call_alloc(call, a.text.len, &out);
    if (!o) return -1;
    for (uint64_t i = 0; i < a.text.len; i++) o[i] = (char)toupper((unsigned char)in[i]);
    return fido_rpc_call_reply(call, &out, sizeof out);
}

static int h_fail(void *user, fido_rpc_ctx *call, const void *args, size_t len) {
    (void)user; (void)call; (void)args; (void)len;
    return 7; /* an application error */
}

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "check failed line %d: %s\n", __LINE__, #c); return 1; } } while (0)

static int client(const char *service) {
    fido_rpc_heap *heap;
    int rc = fido_rpc_heap_setup("c-client", 16 << 20, &heap);
    CHECK(rc == 0);
    fido_rpc_client *cl = NULL;
    for (int i = 0; i < 500; i++) { /* the server may not be up yet */
        rc = fido_rpc_bind(heap, service, &cl);
        if (rc == 0) break;
        usleep(20000);
    }
    if (rc != 0) { fprintf(stderr, "bind: %s\n", fido_rpc_strerror(rc)); return 1; }

    /* sum: an array in the heap, passed by reference */
    uint64_t n = 100000;
    uint32_t *vals = fido_rpc_malloc(heap, n * sizeof(uint32_t));
    CHECK(vals);
    uint64_t want = 0;
    for (uint64_t i = 0; i < n; i++) { vals[i] = (uint32_t)(i * 7); want += i * 7; }
    struct sum_args sa = { fido_rpc_ref_of(heap, vals, n * sizeof(uint32_t)), n };
    CHECK(sa.values.addr != 0);
    fido_rpc_reply *r;
    rc = fido_rpc_call(cl, M_SUM, &sa, sizeof sa, 0, &r);
    CHECK(rc == 0);
    size_t len;
    const uint64_t *got = fido_rpc_reply_data(r, &len);
    CHECK(len == sizeof(uint64_t) && *got == want);
    fido_rpc_reply_free(r);
    fido_rpc_free(heap, vals);

    /* upper: a string in, a string in the server's heap out */
    const char *msg = "hello from c";
    char *text = fido_rpc_malloc(heap, strlen(msg));
    memcpy(text, msg, strlen(msg));
    struct upper_args ua = { fido_rpc_ref_of(heap, text, strlen(msg)) };
    rc = fido_rpc_call(cl, M_UPPER, &ua, sizeof ua, 5000, &r);
    CHECK(rc == 0);
    const fido_rpc_ref *out = fido_rpc_reply_data(r, &len);
    CHECK(len == sizeof(fido_rpc_ref) && out->len == strlen(msg));
    const char *up = fido_rpc_reply_resolve(r, *out);
    CHECK(up && memcmp(up, "HELLO FROM C", out->len) == 0);
    /* a reference outside the server's grant is refused */
    fido_rpc_ref bogus = { 16, 4 };
    CHECK(fido_rpc_reply_resolve(r, bogus) == NULL);
    fido_rpc_reply_free(r);

    /* a reference outside our grant: the server refuses it */
    struct upper_args bad = { { 4096, 8 } };
    rc = fido_rpc_call(cl, M_UPPER, &bad, sizeof bad, 0, &r);
    CHECK(rc == FIDO_EPROTO);
    /* an application error */
    rc = fido_rpc_call(cl, M_FAIL, NULL, 0, 0, &r);
    CHECK(rc == 7);
    /* an unknown method */
    rc = fido_rpc_call(cl, 99, NULL, 0, 0, &r);
    CHECK(rc == FIDO_EPROTO);

    fido_rpc_free(heap, text);
    fido_rpc_unbind(cl);
    fido_rpc_heap_destroy(heap);
    printf("client ok\n");
    return 0;
}

static int server(const char *service) {
    fido_rpc_heap *heap;
    int rc = fido_rpc_heap_setup("c-server", 16 << 20, &heap);
    CHECK(rc == 0);
    static const fido_rpc_handler table[] = { h_sum, h_upper, h_fail };
    fido_rpc_server *srv;
    rc = fido_rpc_serve(heap, service, table, 3, NULL, 2, &srv);
    CHECK(rc == 0);
    printf("serving\n");
    fflush(stdout);
    /* until stdin closes (the test holds it open) */
    char buf[16];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {}
    fido_rpc_server_stop(srv);
    fido_rpc_heap_destroy(heap);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s server|client SERVICE\n", argv[0]); return 2; }
    if (strcmp(argv[1], "server") == 0) return server(argv[2]);
    if (strcmp(argv[1], "client") == 0) return client(argv[2]);
    return 2;
}
