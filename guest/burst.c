/* A memory burst: Overdriver's transient overload, in one guest. `burst start mib=N secs=S`
 * takes N MiB more, writes every page, and for S seconds reads all of it back over and over
 * (it is the guest's working set while it lasts, so a guest squeezed by its balloon has to
 * page it in and out); then it checks every page's content and frees the memory. `burst
 * stats` says how far it is and what the check found. One burst at a time. */
#define _GNU_SOURCE
#include "guest.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>


static struct {
    pthread_mutex_t lock;
    int running;
    uint64_t pages;
    double secs;
    uint64_t passes;
    uint64_t checked;
    uint64_t corrupt;
    int done;
} burst = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* Each page's 8-byte words hold its index and their own offset: a page swapped back in from
 * the wrong place, or not at all, reads differently. */
static void fill(uint8_t *page, uint64_t index)
{
    uint64_t *w = (uint64_t *)page;
    for (size_t i = 0; i < PAGE_BYTES / 8; i++)
        w[i] = (index << 16) ^ (uint64_t)i ^ 0x6275727374ull;
}

static int intact(const uint8_t *page, uint64_t index)
{
    const uint64_t *w = (const uint64_t *)page;
    for (size_t i = 0; i < PAGE_BYTES / 8; i++)
        if (w[i] != ((index << 16) ^ (uint64_t)i ^ 0x6275727374ull))
            return 0;
    return 1;
}

static void *run(void *arg)
{
    uint8_t *region = arg;
    pthread_mutex_lock(&burst.lock);
    uint64_t pages = burst.pages;
    double end = now_s() + burst.secs;
    pthread_mutex_unlock(&burst.lock);
    volatile uint64_t sum = 0;
    while (now_s() < end) {
        for (uint64_t i = 0; i < pages; i++)
            sum += region[i * PAGE_BYTES + (i % PAGE_BYTES)];
        pthread_mutex_lock(&burst.lock);
        burst.passes++;
        pthread_mutex_unlock(&burst.lock);
        sleep_ms(100);
    }
    uint64_t corrupt = 0;
    for (uint64_t i = 0; i < pages; i++)
        corrupt += !intact(region + i * PAGE_BYTES, i);
    munmap(region, pages * PAGE_BYTES);
    pthread_mutex_lock(&burst.lock);
    burst.checked = pages;
    burst.corrupt = corrupt;
    burst.running = 0;
    burst.done = 1;
    pthread_mutex_unlock(&burst.lock);
    return NULL;
}

int burst_start(uint64_t mib, double secs, char *err, size_t errlen)
{
    pthread_mutex_lock(&burst.lock);
    if (burst.running) {
        pthread_mutex_unlock(&burst.lock);
        snprintf(err, errlen, "a burst runs already");
        return -1;
    }
    uint64_t pages = mib * (1024 * 1024 / PAGE_BYTES);
    uint8_t *region = mmap(NULL, pages * PAGE_BYTES, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) {
        pthread_mutex_unlock(&burst.lock);
        snprintf(err, errlen, "mmap %llu MiB: %s", (unsigned long long)mib, strerror(errno));
        return -1;
    }
    for (uint64_t i = 0; i < pages; i++)
        fill(region + i * PAGE_BYTES, i);
    burst.pages = pages;
    burst.secs = secs;
    burst.passes = 0;
    burst.checked = 0;
    burst.corrupt = 0;
    burst.done = 0;
    burst.running = 1;
    pthread_t thread;
    int rc = pthread_create(&thread, NULL, run, region);
    if (rc != 0) {
        burst.running = 0;
        munmap(region, pages * PAGE_BYTES);
        pthread_mutex_unlock(&burst.lock);
        snprintf(err, errlen, "pthread_create: %s", strerror(rc));
        return -1;
    }
    pthread_detach(thread);
    pthread_mutex_unlock(&burst.lock);
    return 0;
}

void burst_stats(char *out, size_t len)
{
    pthread_mutex_lock(&burst.lock);
    snprintf(out, len, "state=%s mib=%llu passes=%llu checked=%llu corrupt=%llu",
             burst.running ? "running" : burst.done ? "done" : "none",
             (unsigned long long)(burst.pages * PAGE_BYTES / (1024 * 1024)),
             (unsigned long long)burst.passes, (unsigned long long)burst.checked,
             (unsigned long long)burst.corrupt);
    pthread_mutex_unlock(&burst.lock);
}
