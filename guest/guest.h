/* ferry-guest: the programs that run inside ferry's test guests. */
#ifndef FERRY_GUEST_H
#define FERRY_GUEST_H

#include "content.h"

#include <stddef.h>
#include <stdint.h>

struct verify_result {
    uint64_t checked;
    uint64_t stale;     /* one version behind: a lost update */
    uint64_t corrupt;   /* matches neither the current nor the previous version */
    uint64_t first_bad; /* 1 + index of the first bad page or block, 0 if none */
};

double now_s(void);
/* One line on the serial console, whole (lines from several threads never interleave). */
void tty_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void sleep_ms(unsigned ms);

int parse_pattern(const char *s, enum pattern *out);
const char *pattern_name(enum pattern p);
int mem_start(enum pattern pat, uint64_t mib, double rate, double hot_mib, char *err, size_t errlen);
/* rate < 0 and hot_mib < 0 keep the current values */
int mem_set(int has_pat, enum pattern pat, double rate, double hot_mib, char *err, size_t errlen);
void mem_verify(struct verify_result *r);
void mem_stats(char *out, size_t len);
/* Fault injection, to show the verifiers catch what they claim to: `stale` puts back a page's
 * previous version (a lost update), `corrupt` flips one byte. The table is left alone. Returns
 * the page index, or -1 with `err` set. */
long long mem_inject(int stale, char *err, size_t errlen);

/* A memory burst: `mib` more for `secs` seconds, read over and over, checked, then freed. */
int burst_start(uint64_t mib, double secs, char *err, size_t errlen);
void burst_stats(char *out, size_t len);

int disk_start(const char *path, uint64_t mib, double rate, char *err, size_t errlen);
int disk_set(double rate, char *err, size_t errlen);
int disk_read(uint64_t hot_mib, char *err, size_t errlen);
int disk_verify(struct verify_result *r, char *err, size_t errlen);
int disk_sum(const char *path, char *out, size_t len, char *err, size_t errlen);
void disk_stats(char *out, size_t len);
void disk_reset_stats(void);
void disk_read_counts(uint64_t from, char *out, size_t len);
/* The same for a disk block (the write goes through O_DIRECT like the writer's). */
long long disk_inject(int stale, char *err, size_t errlen);

int tcpseq_serve(int port, unsigned interval_ms);

/* The QEMU guest agent's protocol (the subset in qga.c) on `dev`, or, when NULL, on the
 * virtio-serial port named org.qemu.guest_agent.0 (waiting a few seconds for it to appear).
 * Returns only on failure: 2 when there is no such port, 1 otherwise. */
int qga_serve(const char *dev);

#endif
