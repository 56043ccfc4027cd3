/* Disk writer and verifier.
 *
 * A file of fixed-size blocks, each a pure function of (block index, version). The writer
 * rewrites random blocks with O_DIRECT|O_DSYNC at a chosen rate and records each write's
 * latency; the verifier reads every block back, bypassing the page cache, and compares it with
 * the version the table says the guest saw acknowledged. A reader (`disk read hot=MIB`) reads
 * random blocks of the file's first MIB back to back (O_DIRECT, one at a time) and counts
 * them: the guest's read throughput on a hot set, with and without a migration, and per second
 * of the guest's time (`disk read-counts`), so a host can tell which phase of a move cost it.
 */
#define _GNU_SOURCE
#include "guest.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define BLOCK_BYTES 4096u
/* Latency histogram: 1 µs buckets up to 100 ms, then one overflow bucket. */
/* Write latency histogram: 10 us buckets up to 1 s; slower writes land in the last one. */
#define LAT_BUCKETS 100001u
#define LAT_BUCKET_US 10u
/* A disk operation outstanding this long is reported once, with the kernel's view of the disk. */
#define STALL_S 20
/* The reader's per-second counts: ten minutes, 50 to a reply line. */
#define READ_SECONDS 600u
#define READ_COUNTS_PER_LINE 50u

/* The operations the stall watcher watches, one per thread that does them. */
enum { OP_WRITE, OP_READ, OP_VERIFY, OPS };
static const char *const op_name[OPS] = { "write", "hot-set read", "verifier's read" };

static struct {
    pthread_mutex_t lock;
    pthread_t thread;
    int fd;
    int running;
    uint64_t blocks;
    uint32_t *version;
    double rate_mib_s;
    uint64_t writes;
    /* writes counted in the histogram (since the start or the last stats reset) */
    uint64_t lat_writes;
    uint64_t *lat_us;
    uint64_t lat_max_us;
    uint64_t rng;
    /* the writer's file, which the reader reads */
    char path[256];
    /* the hot-set reader: its blocks (0: none), reads since the last stats reset (atomic: the
     * reader never takes `lock`, which the writer holds across its writes), and when that reset
     * was */
    pthread_t reader_thread;
    uint64_t hot_blocks;
    uint64_t reads;
    double reads_since;
    /* the reads in each second since that reset (atomic: the reader adds, a reset clears) */
    uint32_t reads_by_s[READ_SECONDS];
    /* for the stall report: when each operation in progress started (µs of now_s(), 0: none;
     * atomic: the watcher reads them while the writer or the verifier holds `lock`), and the
     * threads' ids */
    uint64_t op_started_us[OPS];
    pid_t writer_tid;
    pid_t reader_tid;
    pid_t verifier_tid;
} disk = { .lock = PTHREAD_MUTEX_INITIALIZER, .fd = -1 };

/* pread or pwrite of one block, its start visible to the stall watcher as operation `op`. */
static ssize_t watched_io(int op, int fd, void *buf, off_t at)
{
    __atomic_store_n(&disk.op_started_us[op], (uint64_t)(now_s() * 1e6), __ATOMIC_RELAXED);
    ssize_t n = op == OP_WRITE ? pwrite(fd, buf, BLOCK_BYTES, at) : pread(fd, buf, BLOCK_BYTES, at);
    __atomic_store_n(&disk.op_started_us[op], 0, __ATOMIC_RELAXED);
    return n;
}

static void *reader(void *arg)
{
    int fd = (int)(intptr_t)arg;
    uint8_t *buf;
    if (posix_memalign((void **)&buf, BLOCK_BYTES, BLOCK_BYTES) != 0) {
        close(fd);
        return NULL;
    }
    uint64_t rng = 0x2545f4914f6cdd1dull ^ (uint64_t)(now_s() * 1e6);
    /* `hot_blocks` is set once, before this thread starts; the reader runs until the guest
     * powers off. */
    const uint64_t hot = disk.hot_blocks;
    __atomic_store_n(&disk.reader_tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELAXED);
    for (;;) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        ssize_t n = watched_io(OP_READ, fd, buf, (off_t)((rng % hot) * BLOCK_BYTES));
        if (n == (ssize_t)BLOCK_BYTES) {
            __atomic_fetch_add(&disk.reads, 1, __ATOMIC_RELAXED);
            double since;
            __atomic_load(&disk.reads_since, &since, __ATOMIC_RELAXED);
            double s = now_s() - since;
            if (s >= 0 && s < READ_SECONDS)
                __atomic_fetch_add(&disk.reads_by_s[(size_t)s], 1, __ATOMIC_RELAXED);
        } else
            sleep_ms(1); /* a failing disk must not take the whole vCPU */
    }
    return NULL;
}

/* Restarts the per-second counts at second 0 of now (the caller holds `lock`). A start in the
 * future first, so that a read counted meanwhile falls before second 0 and is left out
 * instead of landing, after the clearing, in a second of the new count. */
static void disk_reset_read_counts(void)
{
    double later = now_s() + 2.0 * READ_SECONDS;
    __atomic_store(&disk.reads_since, &later, __ATOMIC_SEQ_CST);
    for (size_t i = 0; i < READ_SECONDS; i++)
        __atomic_store_n(&disk.reads_by_s[i], 0, __ATOMIC_RELAXED);
    double now = now_s();
    __atomic_store(&disk.reads_since, &now, __ATOMIC_SEQ_CST);
}

int disk_read(uint64_t hot_mib, char *err, size_t errlen)
{
    pthread_mutex_lock(&disk.lock);
    if (disk.fd < 0 || disk.hot_blocks > 0) {
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, disk.fd < 0 ? "no disk workload; use disk start first"
                                          : "the reader already runs");
        return -1;
    }
    uint64_t file_mib = disk.blocks * BLOCK_BYTES >> 20;
    if (hot_mib == 0 || hot_mib > file_mib) {
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, "hot=%llu MiB must be at least 1 and at most the file's %llu MiB",
                 (unsigned long long)hot_mib, (unsigned long long)file_mib);
        return -1;
    }
    int fd = open(disk.path, O_RDONLY | O_DIRECT);
    if (fd < 0) {
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, "open %s: %s", disk.path, strerror(errno));
        return -1;
    }
    disk.hot_blocks = hot_mib * 1024 * 1024 / BLOCK_BYTES;
    __atomic_store_n(&disk.reads, 0, __ATOMIC_RELAXED);
    disk_reset_read_counts();
    int rc = pthread_create(&disk.reader_thread, NULL, reader, (void *)(intptr_t)fd);
    if (rc != 0) {
        disk.hot_blocks = 0;
        close(fd);
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, "pthread_create: %s", strerror(rc));
        return -1;
    }
    pthread_detach(disk.reader_thread);
    pthread_mutex_unlock(&disk.lock);
    return 0;
}

static void block_content(uint8_t *buf, uint64_t idx, uint32_t version)
{
    fill_textlike(buf, BLOCK_BYTES, (idx << 32) ^ version ^ 0xd15cull);
    memcpy(buf, &idx, 8);
    memcpy(buf + 8, &version, 4);
}

static void *writer(void *arg)
{
    (void)arg;
    uint8_t *buf;
    if (posix_memalign((void **)&buf, BLOCK_BYTES, BLOCK_BYTES) != 0)
        return NULL;
    __atomic_store_n(&disk.writer_tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELAXED);
    double credit = 0, last = now_s();
    for (;;) {
        pthread_mutex_lock(&disk.lock);
        if (!disk.running) {
            pthread_mutex_unlock(&disk.lock);
            free(buf);
            return NULL;
        }
        double rate = disk.rate_mib_s;
        double t = now_s();
        credit += (t - last) * rate * (1024.0 * 1024.0 / BLOCK_BYTES);
        last = t;
        if (credit > 64)
            credit = 64;
        if (rate <= 0 || credit < 1) {
            pthread_mutex_unlock(&disk.lock);
            sleep_ms(1);
            continue;
        }
        credit -= 1;
        disk.rng ^= disk.rng << 13;
        disk.rng ^= disk.rng >> 7;
        disk.rng ^= disk.rng << 17;
        uint64_t idx = disk.rng % disk.blocks;
        uint32_t v = disk.version[idx] + 1;
        block_content(buf, idx, v);
        double t0 = now_s();
        ssize_t n = watched_io(OP_WRITE, disk.fd, buf, (off_t)(idx * BLOCK_BYTES));
        double t1 = now_s();
        if (n == (ssize_t)BLOCK_BYTES) {
            /* only an acknowledged write moves the expected version */
            disk.version[idx] = v;
            disk.writes++;
            uint64_t us = (uint64_t)((t1 - t0) * 1e6);
            uint64_t b = us / LAT_BUCKET_US;
            disk.lat_us[b < LAT_BUCKETS - 1 ? b : LAT_BUCKETS - 1]++;
            disk.lat_writes++;
            if (us > disk.lat_max_us)
                disk.lat_max_us = us;
        }
        pthread_mutex_unlock(&disk.lock);
    }
}

/* Each line of `path` as "D <path>: <line>" (at most `max` lines). */
static void report_file(const char *path, int max)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        tty_line("D %s: %s", path, strerror(errno));
        return;
    }
    char line[400];
    for (int n = 0; n < max && fgets(line, sizeof line, f); n++) {
        line[strcspn(line, "\n")] = 0;
        tty_line("D %s: %s", path, line);
    }
    fclose(f);
}

/* Every readable file of a blk-mq debugfs directory, and of its hctx and scheduler dirs. */
static void report_blk_debugfs(const char *dir, int depth)
{
    DIR *d = opendir(dir);
    if (!d) {
        tty_line("D %s: %s", dir, strerror(errno));
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0)
            continue;
        if (S_ISDIR(st.st_mode)) {
            /* hctxN, sched; a cpuN directory is one software queue */
            if (depth == 0)
                report_blk_debugfs(path, 1);
        } else if (st.st_mode & S_IRUSR) {
            report_file(path, 64);
        }
    }
    closedir(d);
}

/* The kernel stack of every task in uninterruptible sleep (state D), as "D <tid> <comm>: ...":
 * what the stuck write waits for (the block layer, the journal, a flush), kernel threads
 * included. Read from /proc rather than asked of sysrq, whose header goes to the console
 * directly, past the lines the serial protocol keeps whole. */
static void report_blocked_tasks(void)
{
    DIR *procs = opendir("/proc");
    if (!procs) {
        tty_line("D /proc: %s", strerror(errno));
        return;
    }
    struct dirent *p;
    while ((p = readdir(procs))) {
        if (p->d_name[0] < '1' || p->d_name[0] > '9')
            continue;
        char dir[64];
        snprintf(dir, sizeof dir, "/proc/%.16s/task", p->d_name);
        DIR *tasks = opendir(dir);
        if (!tasks)
            continue;
        struct dirent *t;
        while ((t = readdir(tasks))) {
            if (t->d_name[0] == '.')
                continue;
            char path[128], stat[512];
            snprintf(path, sizeof path, "%s/%.16s/stat", dir, t->d_name);
            FILE *f = fopen(path, "r");
            if (!f)
                continue;
            size_t n = fread(stat, 1, sizeof stat - 1, f);
            fclose(f);
            stat[n] = 0;
            /* "tid (comm) S ...": the state follows the last ')' */
            char *close = strrchr(stat, ')');
            char *open = strchr(stat, '(');
            if (!close || !open || close[1] != ' ' || close[2] != 'D')
                continue;
            *close = 0;
            tty_line("D blocked task %s (%s)", t->d_name, open + 1);
            snprintf(path, sizeof path, "%s/%.16s/stack", dir, t->d_name);
            report_file(path, 32);
        }
        closedir(tasks);
    }
    closedir(procs);
}

/* A disk operation that never completes hangs the guest's disk verifier and tells nothing;
 * this says where the kernel holds it: the disk's requests in flight, blk-mq's queues, the
 * workload's threads' kernel stacks and every blocked task. */
static void report_stall(const char *op, double waited_s)
{
    tty_line("D stall: a disk %s has waited %.0f s; the kernel's view follows", op, waited_s);
    struct stat st;
    char base[128] = "", path[512];
    if (fstat(disk.fd, &st) == 0) {
        snprintf(base, sizeof base, "/sys/dev/block/%u:%u", major(st.st_dev), minor(st.st_dev));
        snprintf(path, sizeof path, "%s/inflight", base);
        report_file(path, 4);
        snprintf(path, sizeof path, "%s/stat", base);
        report_file(path, 4);
    }
    char link[256];
    ssize_t n = base[0] ? readlink(base, link, sizeof link - 1) : -1;
    if (n > 0) {
        link[n] = 0;
        const char *name = strrchr(link, '/');
        name = name ? name + 1 : link;
        if (mount("debugfs", "/sys/kernel/debug", "debugfs", 0, NULL) != 0 && errno != EBUSY)
            tty_line("D mount debugfs: %s", strerror(errno));
        snprintf(path, sizeof path, "/sys/kernel/debug/block/%s", name);
        report_blk_debugfs(path, 0);
    }
    pid_t tids[3] = { __atomic_load_n(&disk.writer_tid, __ATOMIC_RELAXED),
                      __atomic_load_n(&disk.reader_tid, __ATOMIC_RELAXED),
                      __atomic_load_n(&disk.verifier_tid, __ATOMIC_RELAXED) };
    for (int i = 0; i < 3; i++) {
        if (tids[i] <= 0)
            continue;
        snprintf(path, sizeof path, "/proc/self/task/%d/stack", (int)tids[i]);
        report_file(path, 64);
    }
    report_blocked_tasks();
    tty_line("D stall: end of report");
}

static void *stall_watch(void *arg)
{
    (void)arg;
    uint64_t reported[OPS] = { 0 };
    for (;;) {
        sleep_ms(1000);
        for (int op = 0; op < OPS; op++) {
            uint64_t started = __atomic_load_n(&disk.op_started_us[op], __ATOMIC_RELAXED);
            if (started == 0 || started == reported[op])
                continue;
            double waited = now_s() - (double)started / 1e6;
            if (waited >= STALL_S) {
                reported[op] = started;
                report_stall(op_name[op], waited);
            }
        }
    }
    return NULL;
}

int disk_start(const char *path, uint64_t mib, double rate, char *err, size_t errlen)
{
    pthread_mutex_lock(&disk.lock);
    if (disk.fd >= 0) {
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, "disk workload already started; use disk set");
        return -1;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_DIRECT | O_DSYNC, 0644);
    if (fd < 0) {
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, "open %s: %s", path, strerror(errno));
        return -1;
    }
    uint64_t blocks = mib * 1024 * 1024 / BLOCK_BYTES;
    disk.version = calloc(blocks, sizeof *disk.version);
    disk.lat_us = calloc(LAT_BUCKETS, sizeof *disk.lat_us);
    uint8_t *chunk = NULL;
    const size_t chunk_blocks = 256; /* 1 MiB writes for the initial fill */
    if (!disk.version || !disk.lat_us ||
        posix_memalign((void **)&chunk, BLOCK_BYTES, chunk_blocks * BLOCK_BYTES) != 0) {
        close(fd);
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (uint64_t b = 0; b < blocks; b += chunk_blocks) {
        size_t n = blocks - b < chunk_blocks ? blocks - b : chunk_blocks;
        for (size_t i = 0; i < n; i++) {
            block_content(chunk + i * BLOCK_BYTES, b + i, 1);
            disk.version[b + i] = 1;
        }
        if (pwrite(fd, chunk, n * BLOCK_BYTES, (off_t)(b * BLOCK_BYTES)) != (ssize_t)(n * BLOCK_BYTES)) {
            snprintf(err, errlen, "initial fill of %s at block %llu: %s", path,
                     (unsigned long long)b, strerror(errno));
            free(chunk);
            close(fd);
            pthread_mutex_unlock(&disk.lock);
            return -1;
        }
    }
    free(chunk);
    disk.fd = fd;
    snprintf(disk.path, sizeof disk.path, "%s", path);
    disk.blocks = blocks;
    disk.rate_mib_s = rate;
    disk.rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)now_s();
    disk.running = 1;
    int rc = pthread_create(&disk.thread, NULL, writer, NULL);
    pthread_t watch;
    if (rc == 0 && pthread_create(&watch, NULL, stall_watch, NULL) == 0)
        pthread_detach(watch);
    pthread_mutex_unlock(&disk.lock);
    if (rc != 0) {
        snprintf(err, errlen, "pthread_create: %s", strerror(rc));
        return -1;
    }
    return 0;
}

int disk_set(double rate, char *err, size_t errlen)
{
    pthread_mutex_lock(&disk.lock);
    if (disk.fd < 0) {
        pthread_mutex_unlock(&disk.lock);
        snprintf(err, errlen, "no disk workload; use disk start first");
        return -1;
    }
    disk.rate_mib_s = rate;
    pthread_mutex_unlock(&disk.lock);
    return 0;
}

int disk_verify(struct verify_result *r, char *err, size_t errlen)
{
    memset(r, 0, sizeof *r);
    uint8_t *buf, *expect;
    if (posix_memalign((void **)&buf, BLOCK_BYTES, BLOCK_BYTES) != 0 ||
        posix_memalign((void **)&expect, BLOCK_BYTES, BLOCK_BYTES) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_lock(&disk.lock);
    if (disk.fd < 0) {
        pthread_mutex_unlock(&disk.lock);
        free(buf);
        free(expect);
        snprintf(err, errlen, "no disk workload; use disk start first");
        return -1;
    }
    int rc = 0;
    __atomic_store_n(&disk.verifier_tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELAXED);
    for (uint64_t i = 0; i < disk.blocks; i++) {
        if (watched_io(OP_VERIFY, disk.fd, buf, (off_t)(i * BLOCK_BYTES)) != (ssize_t)BLOCK_BYTES) {
            snprintf(err, errlen, "read block %llu: %s", (unsigned long long)i, strerror(errno));
            rc = -1;
            break;
        }
        r->checked++;
        block_content(expect, i, disk.version[i]);
        if (memcmp(buf, expect, BLOCK_BYTES) == 0)
            continue;
        block_content(expect, i, disk.version[i] - 1);
        if (disk.version[i] > 1 && memcmp(buf, expect, BLOCK_BYTES) == 0)
            r->stale++;
        else
            r->corrupt++;
        if (r->first_bad == 0)
            r->first_bad = i + 1;
    }
    pthread_mutex_unlock(&disk.lock);
    free(buf);
    free(expect);
    return rc;
}

long long disk_inject(int stale, char *err, size_t errlen)
{
    uint8_t *buf;
    if (posix_memalign((void **)&buf, BLOCK_BYTES, BLOCK_BYTES) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_lock(&disk.lock);
    long long found = -1;
    if (disk.fd < 0) {
        snprintf(err, errlen, "no disk workload; use disk start first");
    } else {
        /* a fresh start point each time, so two injections hit two blocks */
        disk.rng ^= disk.rng << 13;
        disk.rng ^= disk.rng >> 7;
        disk.rng ^= disk.rng << 17;
        static long long last = -1; /* never hit the same block twice in a row */
        for (uint64_t k = 0; k < disk.blocks; k++) {
            uint64_t i = (disk.rng + k) % disk.blocks;
            if ((long long)i == last)
                continue;
            if (stale) {
                if (disk.version[i] < 2)
                    continue;
                block_content(buf, i, disk.version[i] - 1);
            } else {
                block_content(buf, i, disk.version[i]);
                buf[100] ^= 0x5a;
            }
            if (pwrite(disk.fd, buf, BLOCK_BYTES, (off_t)(i * BLOCK_BYTES)) != (ssize_t)BLOCK_BYTES) {
                snprintf(err, errlen, "write block %llu: %s", (unsigned long long)i, strerror(errno));
                break;
            }
            found = (long long)i;
            last = found;
            break;
        }
        if (found < 0 && err[0] == 0)
            snprintf(err, errlen, "no block has been rewritten yet; let the workload run first");
    }
    pthread_mutex_unlock(&disk.lock);
    free(buf);
    return found;
}

static uint64_t percentile_us(double q)
{
    uint64_t target = (uint64_t)(q * (double)disk.lat_writes);
    uint64_t seen = 0;
    for (uint64_t i = 0; i < LAT_BUCKETS - 1; i++) {
        seen += disk.lat_us[i];
        if (seen > target)
            return (i + 1) * LAT_BUCKET_US; /* the bucket's upper edge */
    }
    return disk.lat_max_us;
}

/* Starts a new latency measurement (the writer and its blocks' versions go on). */
void disk_reset_stats(void)
{
    pthread_mutex_lock(&disk.lock);
    if (disk.lat_us)
        memset(disk.lat_us, 0, LAT_BUCKETS * sizeof *disk.lat_us);
    disk.lat_writes = 0;
    disk.lat_max_us = 0;
    __atomic_store_n(&disk.reads, 0, __ATOMIC_RELAXED);
    disk_reset_read_counts();
    pthread_mutex_unlock(&disk.lock);
}

/* The reader's counts per second from second `from` on, at most `READ_COUNTS_PER_LINE` of them
 * (a reply is one serial line): `seconds=S from=F counts=C,C,...`, S the seconds since the last
 * reset (the last one still running). */
void disk_read_counts(uint64_t from, char *out, size_t len)
{
    double since;
    __atomic_load(&disk.reads_since, &since, __ATOMIC_RELAXED);
    double elapsed = now_s() - since;
    uint64_t seconds = elapsed < 0 ? 0 : (uint64_t)elapsed + 1;
    if (seconds > READ_SECONDS)
        seconds = READ_SECONDS;
    int n = snprintf(out, len, "seconds=%llu from=%llu counts=", (unsigned long long)seconds,
                     (unsigned long long)from);
    for (uint64_t i = from; i < seconds && i < from + READ_COUNTS_PER_LINE && n > 0 && (size_t)n < len; i++)
        n += snprintf(out + n, len - (size_t)n, i == from ? "%u" : ",%u",
                      __atomic_load_n(&disk.reads_by_s[i], __ATOMIC_RELAXED));
}

void disk_stats(char *out, size_t len)
{
    pthread_mutex_lock(&disk.lock);
    if (disk.fd < 0) {
        snprintf(out, len, "blocks=0 writes=0");
    } else {
        snprintf(out, len,
                 "blocks=%llu rate_mib_s=%.2f writes=%llu lat_writes=%llu lat_p50_us=%llu "
                 "lat_p99_us=%llu lat_p999_us=%llu lat_max_us=%llu reads=%llu read_s=%.3f",
                 (unsigned long long)disk.blocks, disk.rate_mib_s, (unsigned long long)disk.writes,
                 (unsigned long long)disk.lat_writes,
                 (unsigned long long)percentile_us(0.50), (unsigned long long)percentile_us(0.99),
                 (unsigned long long)percentile_us(0.999), (unsigned long long)disk.lat_max_us,
                 (unsigned long long)__atomic_load_n(&disk.reads, __ATOMIC_RELAXED),
                 now_s() - disk.reads_since);
    }
    pthread_mutex_unlock(&disk.lock);
}

/* The FNV-1a 64 digest of a file's bytes read from the disk itself (O_DIRECT: a guest that
 * arrived with its page cache would otherwise answer from memory), so a test can tell which
 * bytes the guest reads, whatever image chain QEMU holds them in. */
int disk_sum(const char *path, char *out, size_t len, char *err, size_t errlen)
{
    const size_t chunk = 1u << 20;
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) {
        snprintf(err, errlen, "open %s: %s", path, strerror(errno));
        return -1;
    }
    unsigned char *buf;
    if (posix_memalign((void **)&buf, BLOCK_BYTES, chunk) != 0) {
        close(fd);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    uint64_t h = 0xcbf29ce484222325ull, bytes = 0;
    for (;;) {
        ssize_t n = read(fd, buf, chunk);
        if (n < 0) {
            snprintf(err, errlen, "read %s: %s", path, strerror(errno));
            free(buf);
            close(fd);
            return -1;
        }
        if (n == 0)
            break;
        for (ssize_t i = 0; i < n; i++)
            h = (h ^ buf[i]) * 0x100000001b3ull;
        bytes += (uint64_t)n;
    }
    free(buf);
    close(fd);
    snprintf(out, len, "bytes=%llu fnv64=%016llx", (unsigned long long)bytes, (unsigned long long)h);
    return 0;
}
