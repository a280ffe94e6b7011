/* How fast a guest moves memory: memset and memcpy of 64 B, 4 KiB and 64 KiB
 * buffers, each timed over many calls. Used to choose the CPU model of TCG
 * guests (fido_vm::qemu::TCG_CPU, docs/VM.md §4.1): with ERMS, glibc uses
 * `rep stosb`/`rep movsb`, which TCG runs one byte at a time.
 *
 *   gcc -O2 -static -o /tmp/memops scripts/guest-memops.c
 *   scripts/vm-image.sh --out /tmp/memops-img --add /tmp/memops:/bin/memops
 *   for cpu in max max,erms=off,fsrm=off; do
 *     qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu $cpu -m 512 \
 *       -nographic -no-reboot -kernel /tmp/memops-img/kernel \
 *       -initrd /tmp/memops-img/initrd.img \
 *       -append "$(cat /tmp/memops-img/cmdline) fido.run=/bin/memops"
 *   done
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint8_t src[1 << 20];

/* noinline: one real call per iteration, as a program makes. */
__attribute__((noinline)) static void do_memset(uint8_t *b, size_t n, uint64_t i) { memset(b, (int)(i & 0xff), n); }
__attribute__((noinline)) static void do_memcpy(uint8_t *b, size_t n, uint64_t i) { memcpy(b, src + (i & 0xff), n); }

int main(void) {
    static const size_t sizes[] = {64, 4096, 65536};
    uint8_t *b = aligned_alloc(4096, 1 << 20);
    if (!b) return 1;
    const struct { const char *name; void (*f)(uint8_t *, size_t, uint64_t); } ops[] = {
        {"memset", do_memset}, {"memcpy", do_memcpy}};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        size_t n = sizes[s], iters = (64u << 20) / n;
        if (iters > 200000) iters = 200000;
        for (size_t k = 0; k < 2; k++) {
            double t = now();
            for (size_t i = 0; i < iters; i++) ops[k].f(b, n, i);
            double dt = now() - t;
            printf("%s %6zu B: %8.1f MB/s %8.2f us/call\n", ops[k].name, n, iters * n / dt / 1e6, dt / iters * 1e6);
        }
    }
    printf("checksum %u\n", (unsigned)b[100]);
    return 0;
}
