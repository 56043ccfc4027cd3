/* Deterministic page and block contents for the guest workloads.
 *
 * Every byte a workload writes is a pure function of (index, version, pattern), so a verifier
 * can recompute what any page or disk block must hold from two small numbers kept in a table.
 * A page that arrives stale (an older version) or damaged no longer matches its recomputed
 * content, whichever of the page and the table travelled late.
 */
#ifndef FERRY_GUEST_CONTENT_H
#define FERRY_GUEST_CONTENT_H

#include <stdint.h>
#include <string.h>

#define PAGE_BYTES 4096u

/* Memory patterns, after the seeds' workloads. Zero is reserved: a zeroed table entry never
 * names a valid pattern. */
enum pattern {
    PAT_NONE = 0,
    PAT_ZERO = 1,  /* SPECjbb-like: most versions are all-zero pages, the rest mostly zero */
    PAT_DELTA = 2, /* kernel-compile-like: each version rewrites one 64-byte slot of a page */
    PAT_WS = 3,    /* TPC-W-like: each version rewrites the whole page */
    PAT_HOT = 4,   /* a small hot set rewritten whole, as fast as the CPU allows */
    PAT_IDLE = 5,  /* filled once, then left alone */
};

static inline uint64_t mix64(uint64_t x)
{
    /* splitmix64 finalizer: cheap and well distributed */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Text-like bytes: 4 bits of entropy per byte, so zstd halves them, roughly like real data. */
static inline void fill_textlike(uint8_t *dst, size_t len, uint64_t seed)
{
    uint64_t s = mix64(seed) | 1;
    for (size_t i = 0; i + 8 <= len; i += 8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        uint64_t w = (s & 0x0f0f0f0f0f0f0f0full) | 0x6060606060606060ull;
        memcpy(dst + i, &w, 8);
    }
}

#define DELTA_SLOT_BYTES 64u
#define DELTA_SLOTS (PAGE_BYTES / DELTA_SLOT_BYTES)

/* Writes into `page` the content page `idx` has at `version` under `pat`. Version 0 is the
 * untouched, all-zero page. */
static inline void page_content(uint8_t *page, uint64_t idx, uint32_t version, enum pattern pat)
{
    if (version == 0 || pat == PAT_NONE) {
        memset(page, 0, PAGE_BYTES);
        return;
    }
    uint64_t seed = (idx << 32) ^ version;
    switch (pat) {
    case PAT_ZERO:
        memset(page, 0, PAGE_BYTES);
        if (mix64(seed) % 4 == 0)
            fill_textlike(page, 256, seed);
        break;
    case PAT_DELTA:
        fill_textlike(page, PAGE_BYTES, idx);
        for (uint32_t s = 0; s < DELTA_SLOTS; s++) {
            /* the latest version u <= version with u % DELTA_SLOTS == s wrote slot s */
            uint32_t back = (version - s) % DELTA_SLOTS;
            if (version < back + 1)
                continue;
            uint32_t u = version - back;
            if (u == 0)
                continue;
            fill_textlike(page + s * DELTA_SLOT_BYTES, DELTA_SLOT_BYTES, (idx << 32) ^ u ^ 0x5a5a);
        }
        break;
    case PAT_WS:
    case PAT_HOT:
    case PAT_IDLE:
    default:
        fill_textlike(page, PAGE_BYTES, seed);
        break;
    }
}

#endif
