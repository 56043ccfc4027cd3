/* ferry-guest: the control agent, heartbeat, TCP sequence server and QEMU guest agent of ferry's
 * test guests.
 *
 *   ferry-guest agent [TTY]        heartbeat + command loop on the serial console (default /dev/ttyS0)
 *   ferry-guest tcpseq [PORT]      TCP sequence server (default port 7000)
 *   ferry-guest qga [DEVICE]       QEMU guest agent protocol, see qga.c (default: the virtio-serial
 *                                  port named org.qemu.guest_agent.0)
 *
 * Serial protocol (one line each, see docs/guest.md):
 *   host -> guest:  "<id> <command> [key=value ...]"
 *   guest -> host:  "R <id> ok [key=value ...]" or "R <id> err <message>"
 *                   "H <seq> <guest_ms>" every HEARTBEAT_MS, from a real-time thread
 * Commands: ping, mem start|set|verify|stats, burst start|stats,
 * disk start|set|read|verify|stats.
 */
#define _GNU_SOURCE
#include "guest.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

/* Every 5 ms: fine enough to see a 20 ms pause, coarse enough for a 115200-baud serial line
 * (about 12 bytes per beat, 2.4 KB/s). */
#define HEARTBEAT_MS 5

static int tty_fd = -1;
static pthread_mutex_t tty_lock = PTHREAD_MUTEX_INITIALIZER;

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void sleep_ms(unsigned ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void tty_line(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof line - 2)
        n = sizeof line - 2;
    line[n++] = '\n';
    pthread_mutex_lock(&tty_lock);
    for (int off = 0; off < n;) {
        ssize_t w = write(tty_fd, line + off, (size_t)(n - off));
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (int)w;
    }
    pthread_mutex_unlock(&tty_lock);
}

static void *heartbeat(void *arg)
{
    (void)arg;
    /* Real-time priority so the beat measures the VM's pauses, not our own dirtier. */
    struct sched_param sp = { .sched_priority = 50 };
    pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp);
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (unsigned long long seq = 0;; seq++) {
        tty_line("H %llu %.0f", seq, now_s() * 1000);
        next.tv_nsec += HEARTBEAT_MS * 1000000L;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        /* After a long pause, skip the missed beats instead of bursting them. */
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > next.tv_sec + 1)
            next = now;
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    return NULL;
}

/* key=value lookup in a tokenized command */
static const char *arg(int argc, char **argv, const char *key)
{
    size_t kl = strlen(key);
    for (int i = 0; i < argc; i++)
        if (strncmp(argv[i], key, kl) == 0 && argv[i][kl] == '=')
            return argv[i] + kl + 1;
    return NULL;
}

static int num(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || v < 0)
        return -1;
    *out = v;
    return 0;
}

static void reply_verify(const char *id, const struct verify_result *r)
{
    tty_line("R %s ok checked=%llu stale=%llu corrupt=%llu errors=%llu first_bad=%lld", id,
             (unsigned long long)r->checked, (unsigned long long)r->stale,
             (unsigned long long)r->corrupt, (unsigned long long)(r->stale + r->corrupt),
             (long long)r->first_bad - 1);
}

/* Parses an optional numeric key; returns -1 (and replies) on a malformed value. */
static int opt_num(const char *id, int argc, char **argv, const char *key, double *out)
{
    const char *s = arg(argc, argv, key);
    if (!s)
        return 0;
    if (num(s, out) != 0) {
        tty_line("R %s err %s=%s is not a non-negative number", id, key, s);
        return -1;
    }
    return 1;
}

/* `mem|disk inject kind=stale|corrupt`: runs `fn` and replies with the index it damaged. */
static void inject(const char *id, int argc, char **argv, const char *what, const char *unit,
                   long long (*fn)(int stale, char *err, size_t errlen))
{
    const char *kind = arg(argc, argv, "kind");
    int stale = kind && strcmp(kind, "stale") == 0;
    if (!kind || (!stale && strcmp(kind, "corrupt") != 0)) {
        tty_line("R %s err %s inject needs kind=stale or kind=corrupt", id, what);
        return;
    }
    char err[256] = "";
    long long index = fn(stale, err, sizeof err);
    if (index < 0)
        tty_line("R %s err %s", id, err);
    else
        tty_line("R %s ok %s=%lld", id, unit, index);
}

static void command(char *line)
{
    char *argv[16];
    int argc = 0;
    for (char *tok = strtok(line, " \t\r"); tok && argc < 16; tok = strtok(NULL, " \t\r"))
        argv[argc++] = tok;
    if (argc < 2)
        return; /* noise on the line, e.g. the host's terminal probing: ignore */
    const char *id = argv[0];
    const char *cmd = argv[1];
    const char *sub = argc > 2 ? argv[2] : "";
    char err[256] = "", out[400] = "";

    if (strcmp(cmd, "ping") == 0) {
        tty_line("R %s ok pong", id);
    } else if (strcmp(cmd, "mem") == 0) {
        double mib = 64, rate = -1, hot = -1;
        enum pattern pat = PAT_WS;
        const char *ps = arg(argc, argv, "pattern");
        if (ps && parse_pattern(ps, &pat) != 0) {
            tty_line("R %s err unknown pattern \"%s\" (known: zero delta ws hot idle)", id, ps);
            return;
        }
        if (opt_num(id, argc, argv, "mib", &mib) < 0 || opt_num(id, argc, argv, "rate", &rate) < 0 ||
            opt_num(id, argc, argv, "hot", &hot) < 0)
            return;
        if (strcmp(sub, "start") == 0) {
            if (mib < 1) {
                tty_line("R %s err mib must be at least 1", id);
                return;
            }
            if (mem_start(pat, (uint64_t)mib, rate < 0 ? 0 : rate, hot, err, sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                tty_line("R %s ok", id);
        } else if (strcmp(sub, "set") == 0) {
            if (mem_set(ps != NULL, pat, rate, hot, err, sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                tty_line("R %s ok", id);
        } else if (strcmp(sub, "verify") == 0) {
            struct verify_result r;
            mem_verify(&r);
            reply_verify(id, &r);
        } else if (strcmp(sub, "stats") == 0) {
            mem_stats(out, sizeof out);
            tty_line("R %s ok %s", id, out);
        } else if (strcmp(sub, "inject") == 0) {
            inject(id, argc, argv, "mem", "page", mem_inject);
        } else {
            tty_line("R %s err unknown mem subcommand \"%s\" (known: start set verify stats inject)", id, sub);
        }
    } else if (strcmp(cmd, "burst") == 0) {
        double mib = 32, secs = 10;
        if (opt_num(id, argc, argv, "mib", &mib) < 0 || opt_num(id, argc, argv, "secs", &secs) < 0)
            return;
        if (strcmp(sub, "start") == 0) {
            if (mib < 1 || mib > 65536 || secs < 0) {
                tty_line("R %s err use mib=1..65536 and secs of 0 or more", id);
                return;
            }
            if (burst_start((uint64_t)mib, secs, err, sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                tty_line("R %s ok", id);
        } else if (strcmp(sub, "stats") == 0) {
            burst_stats(out, sizeof out);
            tty_line("R %s ok %s", id, out);
        } else {
            tty_line("R %s err unknown burst subcommand \"%s\" (known: start stats)", id, sub);
        }
    } else if (strcmp(cmd, "disk") == 0) {
        double mib = 16, rate = 1;
        const char *path = arg(argc, argv, "path");
        if (opt_num(id, argc, argv, "mib", &mib) < 0 || opt_num(id, argc, argv, "rate", &rate) < 0)
            return;
        if (strcmp(sub, "start") == 0) {
            if (disk_start(path ? path : "/data/ferry-disk.dat", (uint64_t)mib, rate, err,
                           sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                tty_line("R %s ok", id);
        } else if (strcmp(sub, "set") == 0) {
            if (disk_set(rate, err, sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                tty_line("R %s ok", id);
        } else if (strcmp(sub, "read") == 0) {
            double hot = 16;
            if (opt_num(id, argc, argv, "hot", &hot) < 0)
                return;
            if (disk_read((uint64_t)hot, err, sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                tty_line("R %s ok", id);
        } else if (strcmp(sub, "verify") == 0) {
            struct verify_result r;
            if (disk_verify(&r, err, sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                reply_verify(id, &r);
        } else if (strcmp(sub, "stats") == 0) {
            disk_stats(out, sizeof out);
            tty_line("R %s ok %s", id, out);
        } else if (strcmp(sub, "read-counts") == 0) {
            double from = 0;
            if (opt_num(id, argc, argv, "from", &from) < 0)
                return;
            disk_read_counts(from < 1e6 ? (uint64_t)from : 1000000u, out, sizeof out);
            tty_line("R %s ok %s", id, out);
        } else if (strcmp(sub, "reset-stats") == 0) {
            disk_reset_stats();
            tty_line("R %s ok", id);
        } else if (strcmp(sub, "inject") == 0) {
            inject(id, argc, argv, "disk", "block", disk_inject);
        } else if (strcmp(sub, "sum") == 0) {
            if (!path)
                tty_line("R %s err disk sum needs path=FILE", id);
            else if (disk_sum(path, out, sizeof out, err, sizeof err) != 0)
                tty_line("R %s err %s", id, err);
            else
                tty_line("R %s ok %s", id, out);
        } else {
            tty_line("R %s err unknown disk subcommand \"%s\" (known: start set read verify stats reset-stats inject sum)", id, sub);
        }
    } else {
        tty_line("R %s err unknown command \"%s\" (known: ping mem burst disk)", id, cmd);
    }
}

static int agent(const char *tty)
{
    tty_fd = open(tty, O_RDWR | O_NOCTTY);
    if (tty_fd < 0) {
        fprintf(stderr, "ferry-guest: open %s: %s\n", tty, strerror(errno));
        return 1;
    }
    struct termios t;
    if (tcgetattr(tty_fd, &t) == 0) {
        cfmakeraw(&t);
        tcsetattr(tty_fd, TCSANOW, &t);
    }
    pthread_t hb;
    pthread_create(&hb, NULL, heartbeat, NULL);
    tty_line("R 0 ok ready");
    char buf[1024];
    size_t len = 0;
    for (;;) {
        ssize_t n = read(tty_fd, buf + len, sizeof buf - 1 - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            sleep_ms(10);
            continue;
        }
        len += (size_t)n;
        char *start = buf, *nl;
        while ((nl = memchr(start, '\n', len - (size_t)(start - buf))) != NULL) {
            *nl = 0;
            command(start);
            start = nl + 1;
        }
        len -= (size_t)(start - buf);
        memmove(buf, start, len);
        if (len == sizeof buf - 1)
            len = 0; /* an over-long line: drop it rather than wedge the loop */
    }
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "agent") == 0)
        return agent(argc >= 3 ? argv[2] : "/dev/ttyS0");
    if (argc >= 2 && strcmp(argv[1], "tcpseq") == 0)
        return tcpseq_serve(argc >= 3 ? atoi(argv[2]) : 7000, 10);
    if (argc >= 2 && strcmp(argv[1], "qga") == 0)
        return qga_serve(argc >= 3 ? argv[2] : NULL);
    fprintf(stderr, "usage: ferry-guest agent [TTY] | tcpseq [PORT] | qga [DEVICE]\n");
    return 2;
}
