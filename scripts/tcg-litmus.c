/* The store-buffering litmus test between a VM guest and a host process over
 * shared memory (an ivshmem-plain BAR in the guest, the same file on the
 * host). Each side stores to its own word, fences, then loads the other's:
 *
 *   host:  X = i; mfence; r1 = Y        guest:  Y = i; mfence; r2 = X
 *
 * With the fences, r1 < i && r2 < i (both loads missed both stores) is
 * forbidden on x86. Fido's ring protocol (a sleep word against a slot mark)
 * is this pattern. QEMU 7.2's TCG drops a guest's fences when the machine has
 * one possible vCPU (max_cpus == 1: no CF_PARALLEL), so the forbidden outcome
 * appears; `-smp 1,maxcpus=2` keeps them (fido_vm::qemu::tcg_smp, docs/VM.md
 * §3). `nofence` leaves the fences out on both sides: the outcome must then
 * show, which proves the harness can see it at all.
 *
 *   tcg-litmus guest ROUNDS [nofence]        (in the guest: finds the ivshmem BAR)
 *   tcg-litmus host FILE ROUNDS [nofence]
 *
 * Start both; they meet on the shared words, run ROUNDS rounds and the host
 * prints "forbidden N of ROUNDS". Exit status 0 unless something failed.
 * Built (gcc -O2 -static) and run by crates/fido-vm/tests/tcg_memory_model.rs. */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define LINE 64
struct shared {
    volatile uint64_t host_arrived __attribute__((aligned(LINE)));
    volatile uint64_t guest_arrived __attribute__((aligned(LINE)));
    volatile uint64_t x __attribute__((aligned(LINE)));
    volatile uint64_t y __attribute__((aligned(LINE)));
    volatile uint64_t guest_seen_round __attribute__((aligned(LINE)));
    volatile uint64_t guest_seen __attribute__((aligned(LINE)));
};

static void fence(int on) {
    if (on) __atomic_thread_fence(__ATOMIC_SEQ_CST); /* mfence on x86-64 */
}

/* The two stores must land within a store buffer's drain time of each other.
 * The guest waits a fixed pause plus a little jitter before its store; the
 * host's pause adapts: a round in which only the host saw the other's store
 * means the host came late (shorten), one in which only the guest did means
 * it came early (lengthen). That keeps the stores at the edge where they
 * race, whatever the speeds of the two sides on this machine. */
static uint64_t rng = 88172645463325252ull;
static unsigned next_random(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (unsigned)rng;
}
static void pause_turns(unsigned n) {
    for (; n; n--) __asm__ volatile("" ::: "memory");
}
#define GUEST_PAUSE 256
#define HOST_PAUSE_MAX 65536

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Spins until *word >= want; gives up (returns -1) after 30 s. */
static int await(volatile uint64_t *word, uint64_t want) {
    double start = 0;
    for (unsigned n = 0; *word < want; n++) {
        if ((n & 0xfffff) == 0) {
            double t = now();
            if (start == 0) start = t;
            else if (t - start > 30) return -1;
        }
        __builtin_ia32_pause();
    }
    return 0;
}

static struct shared *map(const char *path) {
    int fd = open(path, O_RDWR);
    if (fd < 0) { perror(path); return NULL; }
    void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) { perror("mmap"); return NULL; }
    return p;
}

/* The BAR 2 of the first ivshmem device (1af4:1110) in sysfs. */
static int find_ivshmem(char *out, size_t len) {
    DIR *d = opendir("/sys/bus/pci/devices");
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        char path[512], id[32] = {0};
        snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/vendor", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        if (!fgets(id, sizeof id, f)) id[0] = 0;
        fclose(f);
        if (strncmp(id, "0x1af4", 6)) continue;
        snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/device", e->d_name);
        f = fopen(path, "r");
        if (!f) continue;
        if (!fgets(id, sizeof id, f)) id[0] = 0;
        fclose(f);
        if (strncmp(id, "0x1110", 6)) continue;
        snprintf(out, len, "/sys/bus/pci/devices/%s/resource2", e->d_name);
        closedir(d);
        return 0;
    }
    closedir(d);
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: tcg-litmus guest N [nofence] | host FILE N [nofence]\n");
        return 2;
    }
    int host = !strcmp(argv[1], "host");
    if (host && argc < 4) return 2;
    const char *n_arg = host ? argv[3] : argv[2];
    const char *mode = argc > (host ? 4 : 3) ? argv[host ? 4 : 3] : "";
    int fenced = strcmp(mode, "nofence") != 0;
    uint64_t rounds = strtoull(n_arg, NULL, 10);
    char bar[512];
    if (!host && find_ivshmem(bar, sizeof bar)) {
        fprintf(stderr, "tcg-litmus: no ivshmem device\n");
        return 1;
    }
    struct shared *s = map(host ? argv[2] : bar);
    if (!s) return 1;
    uint64_t forbidden = 0;
    unsigned host_pause = GUEST_PAUSE;
    for (uint64_t i = 1; i <= rounds; i++) {
        if (host) {
            s->host_arrived = i;
            if (await(&s->guest_arrived, i)) goto lost;
            pause_turns(host_pause + (next_random() & 63));
            s->x = i;
            fence(fenced);
            uint64_t r1 = s->y;
            if (await(&s->guest_seen_round, i)) goto lost;
            uint64_t r2 = s->guest_seen;
            if (r1 < i && r2 < i) forbidden++;
            else if (r1 == i && r2 < i && host_pause > 0) host_pause--;
            else if (r2 == i && r1 < i && host_pause < HOST_PAUSE_MAX) host_pause++;
        } else {
            s->guest_arrived = i;
            if (await(&s->host_arrived, i)) goto lost;
            pause_turns(GUEST_PAUSE + (next_random() & 15));
            s->y = i;
            fence(fenced);
            uint64_t r2 = s->x;
            s->guest_seen = r2;
            s->guest_seen_round = i; /* stores stay in order (x86 TSO) */
        }
    }
    if (host) printf("forbidden %llu of %llu\n", (unsigned long long)forbidden, (unsigned long long)rounds);
    else printf("guest done %llu\n", (unsigned long long)rounds);
    return 0;
lost:
    fprintf(stderr, "tcg-litmus: the other side stopped answering\n");
    return 1;
}
