/* fido-blk C ABI: a client of a block device served by a Fido storage domain
 * (`fido blk serve NAME ...`; docs/BLK.md). See include/fido.h for conventions.
 *
 * Every call blocks until the storage domain answered. Offsets and lengths
 * are multiples of the device's logical block (fido_blk_info.logical_block)
 * and end within its size; longer transfers are split at max_transfer.
 * fido_blk_read copies the data out of the storage domain's reply buffer
 * into yours; fido_blk_write copies yours once into this domain's arena (the
 * storage domain then reads that in place, no further copy). Both copies are
 * counted in the domain's bytes_copied (`fido status`).
 *
 * Return values: 0 on success, a negative errno on failure:
 *   -EIO, -ENOSPC, -EROFS, -EOPNOTSUPP ...  the storage domain's answer for the request
 *   -EINVAL     a bad argument (null pointer, misaligned, out of range)
 *   -ENOTCONN   the storage domain went away before answering (the request
 *               may or may not have been done); the next call connects again
 *   -ENOENT     no such block device (nobody offers blk:NAME)
 *   -ETIMEDOUT  no answer within 60 s;  -EPROTO  the storage domain broke the protocol
 * fido_blk_strerror() names any of them.
 *
 * Thread safety: a handle may be used from several threads; calls on one
 * handle take turns. */
#ifndef FIDO_BLK_H
#define FIDO_BLK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fido_blk fido_blk;

/* fido_blk_info.flags */
#define FIDO_BLK_READ_ONLY 1u
#define FIDO_BLK_FLUSH 2u
#define FIDO_BLK_FUA 4u
#define FIDO_BLK_DISCARD 8u
#define FIDO_BLK_WRITE_ZEROES 16u
#define FIDO_BLK_CAN_MULTI_CONN 32u

/* The device, as its storage domain describes it (the wire INFO). */
typedef struct fido_blk_info {
    uint64_t size;          /* bytes */
    uint32_t logical_block; /* 512 or 4096 */
    uint32_t max_transfer;  /* the largest single READ/WRITE in bytes */
    uint32_t flags;         /* FIDO_BLK_* */
    uint32_t queue_depth;   /* requests the storage domain keeps in flight per connection */
} fido_blk_info;

/* Joins the broker at broker_path (NULL: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock,
 * /run/fido/broker.sock) as a domain called domain_name and connects to block device
 * `device` (service blk:<device>). */
int fido_blk_connect(const char *broker_path, const char *domain_name, const char *device, fido_blk **out);
/* Closes the connection and leaves; NULL is ignored. */
void fido_blk_close(fido_blk *blk);
/* The device's INFO. */
int fido_blk_get_info(fido_blk *blk, fido_blk_info *out);

/* Reads len bytes at offset into buf. */
int fido_blk_read(fido_blk *blk, uint64_t offset, void *buf, size_t len);
/* Writes len bytes of buf at offset; fua != 0: durable when this returns. */
int fido_blk_write(fido_blk *blk, uint64_t offset, const void *buf, size_t len, int fua);
/* Makes every write that returned before it durable. */
int fido_blk_flush(fido_blk *blk);
/* The range may be freed; it reads back as zeros. */
int fido_blk_discard(fido_blk *blk, uint64_t offset, uint64_t len);
/* The range reads back as zeros; no_unmap != 0 keeps it allocated. */
int fido_blk_write_zeroes(fido_blk *blk, uint64_t offset, uint64_t len, int no_unmap);

/* A static description of a return value. */
const char *fido_blk_strerror(int code);

#ifdef __cplusplus
}
#endif

#endif
