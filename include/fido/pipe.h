/* vPipe C ABI: see include/fido.h for conventions and docs/PIPE.md for the model.
 *
 * The broker moves the bytes between two descriptors the application hands it
 * once (SCM_RIGHTS): file -> socket, socket -> socket, socket -> file,
 * file -> file. "socket" means any stream: a stream socket (TCP, Unix) or a
 * pipe/FIFO; "file" a regular file, always read/written at explicit offsets
 * (the file position shared with the caller is never used or moved). The
 * caller keeps its descriptors: the broker works on duplicates, released when
 * the pipe is destroyed.
 *
 * Return values: 0 on success, a negative errno on failure:
 *   -EBADF   a descriptor was refused (closed, wrong type, read-only sink, write-only
 *            source, O_APPEND sink, operation not matching the pipe's descriptors)
 *   -EDQUOT  the domain's pipe quota is spent;  -EPERM  denied by the policy
 *   -EBUSY   an operation already runs on this pipe;  -ENOENT  no such pipe/domain
 *   -ECANCELED  cancelled;  -ENOTCONN  no broker (or it went away)
 *   -EPIPE, -ECONNRESET, -EIO ...  the transfer failed (the errno of the system call)
 *   -EINVAL  a bad argument (null pointer, offset + length beyond 2^63)
 * fido_pipe_strerror() names any of them.
 *
 * Results are exact: a fido_pipe_result is filled on success AND on a failed
 * or cancelled transfer (bytes written to the sink, bytes taken from the
 * source, end of input reached). Thread safety: every handle may be used from
 * several threads; one operation runs on a pipe at a time. */
#ifndef FIDO_PIPE_H
#define FIDO_PIPE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A domain joined to the broker for pipe work (its own heartbeat thread). */
typedef struct fido_pipe_client fido_pipe_client;
/* A registered pipe: a source and a sink the broker holds. */
typedef struct fido_pipe fido_pipe;
/* An operation under way (asynchronous use). */
typedef struct fido_pipe_op fido_pipe_op;

/* A length meaning "until the source ends" (2^62, the largest length accepted). */
#define FIDO_PIPE_UNTIL_EOF (UINT64_C(1) << 62)

typedef enum fido_pipe_kind {
    FIDO_PIPE_FILE_TO_SOCKET = 1,   /* in_off, len          */
    FIDO_PIPE_SOCKET_TO_SOCKET = 2, /* len                  */
    FIDO_PIPE_SOCKET_TO_FILE = 3,   /* len, out_off         */
    FIDO_PIPE_FILE_TO_FILE = 4      /* in_off, len, out_off */
} fido_pipe_kind;

typedef struct fido_pipe_result {
    uint64_t moved;    /* bytes written to the sink */
    uint64_t consumed; /* bytes taken from the source (> moved only after a failure/cancel) */
    int32_t eof;       /* 1: the source ended before len bytes */
    int32_t error;     /* 0, or the same negative errno the call returned */
} fido_pipe_result;

/* Joins the broker at broker_path (NULL: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock,
 * /run/fido/broker.sock) as a domain called name. */
int fido_pipe_client_connect(const char *broker_path, const char *name, fido_pipe_client **out);
/* Releases the handle; the domain leaves once its pipes and operations are freed too. */
void fido_pipe_client_close(fido_pipe_client *client);
/* The domain id (as shown by `fido status`). */
uint64_t fido_pipe_client_domain(const fido_pipe_client *client);
/* Sets the pipe weight (1..10000) of live domains named by id or name (root or the broker's uid). */
int fido_pipe_set_weight(fido_pipe_client *client, const char *domain, uint32_t weight);

/* Registers a pipe from in_fd to out_fd. */
int fido_pipe_create(fido_pipe_client *client, int in_fd, int out_fd, fido_pipe **out);
/* Cancels what runs on the pipe and frees it (also on error). */
int fido_pipe_destroy(fido_pipe *pipe);
/* Cancels the running operation (it then ends with -ECANCELED); the pipe stays usable. */
int fido_pipe_cancel(fido_pipe *pipe);

/* Blocking operations on a pipe. res may be NULL. */
int fido_pipe_file_to_socket(fido_pipe *pipe, uint64_t off, uint64_t len, fido_pipe_result *res);
int fido_pipe_socket_to_socket(fido_pipe *pipe, uint64_t len, fido_pipe_result *res);
int fido_pipe_socket_to_file(fido_pipe *pipe, uint64_t off, uint64_t len, fido_pipe_result *res);
int fido_pipe_file_to_file(fido_pipe *pipe, uint64_t in_off, uint64_t len, uint64_t out_off,
                           fido_pipe_result *res);

/* One-shot blocking operations without a handle. */
int fido_pipe_once(fido_pipe_client *client, int in_fd, int out_fd, fido_pipe_kind kind,
                   uint64_t in_off, uint64_t len, uint64_t out_off, fido_pipe_result *res);

/* Asynchronous: start an operation on a pipe, or a one-shot one. */
int fido_pipe_start(fido_pipe *pipe, fido_pipe_kind kind, uint64_t in_off, uint64_t len,
                    uint64_t out_off, fido_pipe_op **out);
int fido_pipe_start_once(fido_pipe_client *client, int in_fd, int out_fd, fido_pipe_kind kind,
                         uint64_t in_off, uint64_t len, uint64_t out_off, fido_pipe_op **out);
/* An eventfd that becomes (and stays) readable when the operation ended: for poll/epoll.
 * Owned by the op; valid until fido_pipe_op_free. Returns the fd or a negative errno. */
int fido_pipe_op_fd(fido_pipe_op *op);
/* 0 and *res filled (also on a failed transfer: the return value is then its errno) once ended;
 * -EAGAIN while it runs. The result can be taken once. */
int fido_pipe_op_poll(fido_pipe_op *op, fido_pipe_result *res);
/* Blocks until the operation ends; returns like the blocking calls. */
int fido_pipe_op_wait(fido_pipe_op *op, fido_pipe_result *res);
/* Frees the op (does not cancel the transfer: use fido_pipe_cancel). */
void fido_pipe_op_free(fido_pipe_op *op);

/* A static description of a return code. */
const char *fido_pipe_strerror(int code);

#ifdef __cplusplus
}
#endif

#endif /* FIDO_PIPE_H */
