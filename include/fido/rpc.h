/* VMRPC C ABI: see include/fido.h for conventions.
 *
 * As small as the VMRPC paper's: set up and destroy an RPC heap, malloc/free
 * in it, bind to a service, call a method by index, serve a table of handlers.
 *
 * An RPC heap is a Fido domain: joining the broker at $FIDO_BROKER (or the
 * default socket) gives it a sealed arena that peers map read-only. Memory
 * from fido_rpc_malloc is passed by reference (fido_rpc_ref: a global pointer
 * and a length) inside a call's argument blob; the server checks each
 * reference against the caller's grant before it reads the bytes, in place.
 * Nothing is serialized. Results come back the same way: a reply's root, and
 * references into the server's heap resolved with fido_rpc_reply_resolve,
 * valid until fido_rpc_reply_free.
 *
 * Return codes: 0 success, negative FIDO_E* codes (fido_rpc_strerror names
 * them); fido_rpc_call returns a positive value when the handler returned
 * that application error code. */
#ifndef FIDO_RPC_H
#define FIDO_RPC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FIDO_OK 0
#define FIDO_EINVAL (-22)      /* a bad argument */
#define FIDO_ENOMEM (-12)      /* the heap is full */
#define FIDO_ENOENT (-2)       /* no such service, or no broker */
#define FIDO_ECONNRESET (-104) /* the server died or closed: rebind (or just call again) */
#define FIDO_ETIMEDOUT (-110)  /* the call's deadline passed (the server was told) */
#define FIDO_EPROTO (-71)      /* a server fault: bad reference, unknown method, handler failure */
#define FIDO_ECANCELED (-125)
#define FIDO_EIO (-5)
#define FIDO_EPANIC (-131)     /* an internal error was caught */

typedef struct fido_rpc_heap fido_rpc_heap;
typedef struct fido_rpc_client fido_rpc_client;
typedef struct fido_rpc_reply fido_rpc_reply;
typedef struct fido_rpc_ctx fido_rpc_ctx;
typedef struct fido_rpc_server fido_rpc_server;

/* A global pointer and a length in some domain's RPC heap. */
typedef struct fido_rpc_ref {
    uint64_t addr;
    uint64_t len;
} fido_rpc_ref;

const char *fido_rpc_strerror(int code);

/* Heap: join the broker as domain `name` with a heap of `heap_len` bytes. */
int fido_rpc_heap_setup(const char *name, size_t heap_len, fido_rpc_heap **out);
void fido_rpc_heap_destroy(fido_rpc_heap *heap);
void *fido_rpc_malloc(fido_rpc_heap *heap, size_t len); /* 64-byte aligned, or NULL */
void fido_rpc_free(fido_rpc_heap *heap, void *p);
/* The reference of `len` bytes at `p` (inside one fido_rpc_malloc block), or {0,0}. */
fido_rpc_ref fido_rpc_ref_of(fido_rpc_heap *heap, const void *p, size_t len);

/* Client. A client may be used from several threads; calls run concurrently. */
int fido_rpc_bind(fido_rpc_heap *heap, const char *service, fido_rpc_client **out);
void fido_rpc_unbind(fido_rpc_client *client);
/* Calls method `index` with the argument blob `args` (copied; may contain
 * fido_rpc_refs). timeout_ms 0 = no deadline. Referenced heap memory must stay
 * allocated until the call returns. On 0, *out is the reply. */
int fido_rpc_call(fido_rpc_client *client, uint32_t index, const void *args, size_t args_len,
                  uint32_t timeout_ms, fido_rpc_reply **out);
const void *fido_rpc_reply_data(const fido_rpc_reply *reply, size_t *len);
/* Server memory the reply refers to, checked against the server's grant; NULL if not. */
const void *fido_rpc_reply_resolve(const fido_rpc_reply *reply, fido_rpc_ref ref);
void fido_rpc_reply_free(fido_rpc_reply *reply);

/* Server. A handler returns 0 (and replied with fido_rpc_call_reply, or the
 * result is empty), a positive application error code, or a negative value
 * (the caller gets FIDO_EPROTO). Handlers run on `workers` threads per
 * connection, possibly concurrently, all with the same `user`. */
typedef int (*fido_rpc_handler)(void *user, fido_rpc_ctx *call, const void *args, size_t args_len);
/* Caller memory `ref` points to (read-only, checked), or NULL. Valid during the handler. */
const void *fido_rpc_call_resolve(fido_rpc_ctx *call, fido_rpc_ref ref);
/* `len` bytes in the server's heap sent with the reply; *ref is their reference. */
void *fido_rpc_call_alloc(fido_rpc_ctx *call, size_t len, fido_rpc_ref *ref);
int fido_rpc_call_reply(fido_rpc_ctx *call, const void *result, size_t len);
int fido_rpc_call_cancelled(fido_rpc_ctx *call); /* 1: cancelled, deadline passed or caller gone */
int fido_rpc_serve(fido_rpc_heap *heap, const char *service, const fido_rpc_handler *table, uint32_t count,
                   void *user, uint32_t workers, fido_rpc_server **out);
void fido_rpc_server_stop(fido_rpc_server *server);

#ifdef __cplusplus
}
#endif
#endif /* FIDO_RPC_H */
