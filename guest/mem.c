/* Memory dirtier and full-memory verifier.
 *
 * One region of anonymous memory, one table of (version, pattern) per page. The dirtier thread
 * rewrites pages at a chosen rate and pattern; the verifier recomputes every page from the table
 * and counts mismatches. Both hold `lock`, so a verification sees a quiescent region.
 */
#include "guest.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static struct {
    pthread_mutex_t lock;
    pthread_t thread;
    int running;
    uint8_t *region;
    uint64_t pages;
    uint32_t *version;
    uint8_t *pattern;
    /* settings the dirtier reads on every batch; changed under `lock` */
    enum pattern pat;
    double rate_mib_s; /* 0 = as fast as the CPU allows */
    uint64_t hot_pages; /* the working set: pages [0, hot_pages) */
    uint64_t written_pages;
    uint64_t rng;
} mem = { .lock = PTHREAD_MUTEX_INITIALIZER };

static uint64_t next_rand(void)
{
    mem.rng ^= mem.rng << 13;
    mem.rng ^= mem.rng >> 7;
    mem.rng ^= mem.rng << 17;
    return mem.rng;
}

/* Rewrites one page to its next version. Caller holds the lock. */
static void dirty_page(uint64_t idx)
{
    uint8_t *page = mem.region + idx * PAGE_BYTES;
    uint32_t v = mem.version[idx] + 1;
    if (mem.pat == PAT_DELTA && mem.pattern[idx] == PAT_DELTA) {
        /* a small in-page change: only the slot this version owns */
        uint32_t s = v % DELTA_SLOTS;
        fill_textlike(page + s * DELTA_SLOT_BYTES, DELTA_SLOT_BYTES, (idx << 32) ^ v ^ 0x5a5a);
    } else {
        page_content(page, idx, v, mem.pat);
    }
    mem.version[idx] = v;
    mem.pattern[idx] = (uint8_t)mem.pat;
    mem.written_pages++;
}

static void *dirtier(void *arg)
{
    (void)arg;
    const uint64_t batch = 64; /* pages per lock hold: short enough for a prompt verify */
    double credit = 0;
    double last = now_s();
    for (;;) {
        pthread_mutex_lock(&mem.lock);
        if (!mem.running) {
            pthread_mutex_unlock(&mem.lock);
            return NULL;
        }
        enum pattern pat = mem.pat;
        double rate = mem.rate_mib_s;
        if (pat == PAT_IDLE) {
            pthread_mutex_unlock(&mem.lock);
            sleep_ms(20);
            last = now_s();
            continue;
        }
        uint64_t n = batch;
        if (rate > 0) {
            double t = now_s();
            credit += (t - last) * rate * (1024.0 * 1024.0 / PAGE_BYTES);
            last = t;
            if (credit > batch * 4)
                credit = batch * 4; /* no bursts after a pause (e.g. a migration stop) */
            n = credit >= 1 ? (uint64_t)credit : 0;
            if (n > batch)
                n = batch;
            credit -= (double)n;
        }
        for (uint64_t i = 0; i < n; i++)
            dirty_page(next_rand() % mem.hot_pages);
        pthread_mutex_unlock(&mem.lock);
        if (rate > 0 && n < batch)
            sleep_ms(1);
    }
}

int parse_pattern(const char *s, enum pattern *out)
{
    static const struct { const char *name; enum pattern p; } names[] = {
        { "zero", PAT_ZERO }, { "delta", PAT_DELTA }, { "ws", PAT_WS },
        { "hot", PAT_HOT },   { "idle", PAT_IDLE },
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(s, names[i].name) == 0) {
            *out = names[i].p;
            return 0;
        }
    return -1;
}

const char *pattern_name(enum pattern p)
{
    switch (p) {
    case PAT_ZERO: return "zero";
    case PAT_DELTA: return "delta";
    case PAT_WS: return "ws";
    case PAT_HOT: return "hot";
    case PAT_IDLE: return "idle";
    default: return "none";
    }
}

/* Applies pattern/rate/hot settings; the hot pattern defaults to a quarter of the region at
 * full speed, faster than any WAN carries. */
static void apply_settings(enum pattern pat, double rate, double hot_mib)
{
    mem.pat = pat;
    mem.rate_mib_s = rate;
    uint64_t hot = hot_mib > 0 ? (uint64_t)(hot_mib * 1024 * 1024 / PAGE_BYTES) : 0;
    if (pat == PAT_HOT && hot == 0)
        hot = mem.pages / 4;
    if (hot == 0 || hot > mem.pages)
        hot = mem.pages;
    mem.hot_pages = hot;
}

int mem_start(enum pattern pat, uint64_t mib, double rate, double hot_mib, char *err, size_t errlen)
{
    pthread_mutex_lock(&mem.lock);
    if (mem.region) {
        pthread_mutex_unlock(&mem.lock);
        snprintf(err, errlen, "memory workload already started (%llu pages); use mem set",
                 (unsigned long long)mem.pages);
        return -1;
    }
    uint64_t pages = mib * 1024 * 1024 / PAGE_BYTES;
    uint8_t *region = mmap(NULL, pages * PAGE_BYTES, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (region == MAP_FAILED) {
        pthread_mutex_unlock(&mem.lock);
        snprintf(err, errlen, "mmap %llu MiB: %s", (unsigned long long)mib, strerror(errno));
        return -1;
    }
    mem.version = calloc(pages, sizeof *mem.version);
    mem.pattern = calloc(pages, 1);
    if (!mem.version || !mem.pattern) {
        munmap(region, pages * PAGE_BYTES);
        pthread_mutex_unlock(&mem.lock);
        snprintf(err, errlen, "out of memory for the page table");
        return -1;
    }
    mem.region = region;
    mem.pages = pages;
    mem.rng = 0x2545f4914f6cdd1dull ^ (uint64_t)time(NULL);
    /* Fill every page once so the region holds the pattern's content before migration. */
    enum pattern fill = pat == PAT_HOT || pat == PAT_IDLE ? PAT_WS : pat;
    apply_settings(fill, rate, hot_mib);
    mem.pat = fill;
    for (uint64_t i = 0; i < pages; i++) {
        page_content(region + i * PAGE_BYTES, i, 1, fill);
        mem.version[i] = 1;
        mem.pattern[i] = (uint8_t)fill;
    }
    apply_settings(pat, rate, hot_mib);
    mem.running = 1;
    int rc = pthread_create(&mem.thread, NULL, dirtier, NULL);
    pthread_mutex_unlock(&mem.lock);
    if (rc != 0) {
        snprintf(err, errlen, "pthread_create: %s", strerror(rc));
        return -1;
    }
    return 0;
}

int mem_set(int has_pat, enum pattern pat, double rate, double hot_mib, char *err, size_t errlen)
{
    pthread_mutex_lock(&mem.lock);
    if (!mem.region) {
        pthread_mutex_unlock(&mem.lock);
        snprintf(err, errlen, "no memory workload; use mem start first");
        return -1;
    }
    apply_settings(has_pat ? pat : mem.pat, rate >= 0 ? rate : mem.rate_mib_s,
                   hot_mib >= 0 ? hot_mib : 0);
    pthread_mutex_unlock(&mem.lock);
    return 0;
}

void mem_verify(struct verify_result *r)
{
    static uint8_t expect[PAGE_BYTES];
    memset(r, 0, sizeof *r);
    pthread_mutex_lock(&mem.lock);
    for (uint64_t i = 0; i < mem.pages; i++) {
        const uint8_t *page = mem.region + i * PAGE_BYTES;
        page_content(expect, i, mem.version[i], (enum pattern)mem.pattern[i]);
        r->checked++;
        if (memcmp(page, expect, PAGE_BYTES) == 0)
            continue;
        /* A page one version behind was lost in transit (stale); anything else is damage. */
        page_content(expect, i, mem.version[i] - 1, (enum pattern)mem.pattern[i]);
        if (mem.version[i] > 1 && memcmp(page, expect, PAGE_BYTES) == 0)
            r->stale++;
        else
            r->corrupt++;
        if (r->first_bad == 0)
            r->first_bad = i + 1;
    }
    pthread_mutex_unlock(&mem.lock);
}

long long mem_inject(int stale, char *err, size_t errlen)
{
    pthread_mutex_lock(&mem.lock);
    if (!mem.region) {
        pthread_mutex_unlock(&mem.lock);
        snprintf(err, errlen, "no memory workload; use mem start first");
        return -1;
    }
    static long long last = -1; /* never hit the same page twice in a row */
    uint64_t start = next_rand() % mem.pages;
    for (uint64_t k = 0; k < mem.pages; k++) {
        uint64_t i = (start + k) % mem.pages;
        if ((long long)i == last)
            continue;
        uint8_t *page = mem.region + i * PAGE_BYTES;
        if (stale) {
            /* only a page whose previous version differs can go stale visibly */
            static uint8_t prev[PAGE_BYTES];
            if (mem.version[i] < 2)
                continue;
            page_content(prev, i, mem.version[i] - 1, (enum pattern)mem.pattern[i]);
            if (memcmp(prev, page, PAGE_BYTES) == 0)
                continue;
            memcpy(page, prev, PAGE_BYTES);
        } else {
            page[i % PAGE_BYTES] ^= 0x5a;
        }
        pthread_mutex_unlock(&mem.lock);
        last = (long long)i;
        return (long long)i;
    }
    pthread_mutex_unlock(&mem.lock);
    snprintf(err, errlen, "no page has been rewritten yet; let the workload run first");
    return -1;
}

void mem_stats(char *out, size_t len)
{
    pthread_mutex_lock(&mem.lock);
    snprintf(out, len, "pages=%llu pattern=%s rate_mib_s=%.1f hot_pages=%llu written_pages=%llu",
             (unsigned long long)mem.pages, pattern_name(mem.pat), mem.rate_mib_s,
             (unsigned long long)mem.hot_pages, (unsigned long long)mem.written_pages);
    pthread_mutex_unlock(&mem.lock);
}
