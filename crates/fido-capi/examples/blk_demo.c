/* fido-blk from C: connect to block device NAME, check INFO, write, read back,
 * flush, write-zeroes, discard, and see a bad request refused.
 *
 *   fido blk serve disk0 --ram 16M &
 *   ./blk_demo disk0            (broker: $FIDO_BROKER or the default socket)
 *
 * Prints "blk ok" and exits 0 when every check passed. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fido.h"

#define CHECK(call)                                                                   \
    do {                                                                              \
        int rc_ = (call);                                                             \
        if (rc_ != 0) {                                                               \
            fprintf(stderr, "%s: %d (%s)\n", #call, rc_, fido_blk_strerror(rc_));     \
            return 1;                                                                 \
        }                                                                             \
    } while (0)

static int all_zero(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != 0) return 0;
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DEVICE\n", argv[0]);
        return 2;
    }
    fido_blk *blk = NULL;
    CHECK(fido_blk_connect(NULL, "blk-c-demo", argv[1], &blk));
    fido_blk_info info;
    CHECK(fido_blk_get_info(blk, &info));
    printf("size %llu block %u max_transfer %u flags %#x\n", (unsigned long long)info.size,
           info.logical_block, info.max_transfer, info.flags);
    if (info.size < (1u << 20) || (info.flags & FIDO_BLK_READ_ONLY)) {
        fprintf(stderr, "need a writable device of at least 1 MiB\n");
        return 1;
    }

    /* 256 KiB of a pattern at 64 KiB, durable on return. */
    size_t len = 256 << 10;
    unsigned char *out = malloc(len), *in = malloc(len);
    if (!out || !in) return 1;
    for (size_t i = 0; i < len; i++) out[i] = (unsigned char)(i * 31 + 7);
    CHECK(fido_blk_write(blk, 64 << 10, out, len, 1));
    memset(in, 0, len);
    CHECK(fido_blk_read(blk, 64 << 10, in, len));
    if (memcmp(in, out, len) != 0) {
        fprintf(stderr, "read back differs\n");
        return 1;
    }
    CHECK(fido_blk_flush(blk));

    /* Zero the first 64 KiB of it, discard the next 64 KiB: both read as zeros. */
    CHECK(fido_blk_write_zeroes(blk, 64 << 10, 64 << 10, 0));
    CHECK(fido_blk_discard(blk, 128 << 10, 64 << 10));
    CHECK(fido_blk_read(blk, 64 << 10, in, len));
    if (!all_zero(in, 128 << 10) || memcmp(in + (128 << 10), out + (128 << 10), 128 << 10) != 0) {
        fprintf(stderr, "write-zeroes/discard result wrong\n");
        return 1;
    }

    /* A misaligned read is refused by the storage domain, and the handle stays usable. */
    int rc = fido_blk_read(blk, 100, in, 512);
    if (rc != -EINVAL) {
        fprintf(stderr, "misaligned read returned %d (%s), not -EINVAL\n", rc, fido_blk_strerror(rc));
        return 1;
    }
    rc = fido_blk_read(blk, info.size, in, 512);
    if (rc != -EINVAL) {
        fprintf(stderr, "read past the end returned %d, not -EINVAL\n", rc);
        return 1;
    }
    CHECK(fido_blk_read(blk, 192 << 10, in, 4096));
    if (memcmp(in, out + (128 << 10), 4096) != 0) return 1;

    free(out);
    free(in);
    fido_blk_close(blk);
    printf("blk ok\n");
    return 0;
}
