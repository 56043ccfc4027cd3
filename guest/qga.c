/* ferry-guest qga: the subset of the QEMU guest agent's protocol (qemu-guest-agent) that the lab
 * uses through libvirt (`virsh qemu-agent-command`), on the virtio-serial port
 * org.qemu.guest_agent.0.
 *
 * Requests are JSON objects, one after another; a request ends when its braces balance outside
 * strings. A 0xFF byte from the host throws away any partial request (clients send it before
 * guest-sync-delimited). Every response is one line:
 *   {"return": VALUE}  or  {"error": {"class": CLASS, "desc": TEXT}}, with the request's "id"
 * Commands: guest-sync, guest-sync-delimited (0xFF, then the response), guest-ping, guest-info,
 * guest-exec (path, arg, env, capture-output) and guest-exec-status (pid).
 *
 * libvirt sends {"execute":"guest-sync", "arguments":{"id":MS}} before its first command and after
 * a timeout, and reads the replies line by line as JSON: a line that is not JSON breaks its
 * connection, so nothing else may ever be written to the port.
 */
#define _GNU_SOURCE
#include "guest.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#define PORT_NAME "org.qemu.guest_agent.0"
#define PORTS_DIR "/sys/class/virtio-ports"
#define PORT_WAIT_MS 10000
#define MAX_REQUEST 65536
#define MAX_DEPTH 32
#define MAX_NODES 1024
#define MAX_ARGS 64
#define MAX_PROCS 64
#define MAX_CAPTURE (64 * 1024) /* of each of stdout and stderr (qga keeps 16 MiB) */
#define STR_(x) #x
#define STR(x) STR_(x)

/* ---- output ---- */

struct sb {
    char *p;
    size_t len, cap;
};

static void sb_add(struct sb *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            /* Nothing sensible to answer; the init script starts us again. */
            fprintf(stderr, "ferry-guest qga: out of memory\n");
            exit(1);
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_puts(struct sb *b, const char *s)
{
    sb_add(b, s, strlen(s));
}

static void sb_printf(struct sb *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0)
        sb_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A JSON string. Control characters are escaped so a response always stays on one line. */
static void sb_json_str(struct sb *b, const char *s, size_t n)
{
    sb_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char esc[2] = { '\\', (char)c };
            sb_add(b, esc, 2);
        } else if (c < 0x20 || c == 0x7f) {
            sb_printf(b, "\\u%04x", c);
        } else {
            sb_add(b, (const char *)&c, 1);
        }
    }
    sb_add(b, "\"", 1);
}

static void sb_base64(struct sb *b, const unsigned char *d, size_t n)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)d[i] << 16 | (i + 1 < n ? (unsigned)d[i + 1] << 8 : 0) |
                     (i + 2 < n ? d[i + 2] : 0);
        char q[4] = { tab[v >> 18], tab[(v >> 12) & 63], i + 1 < n ? tab[(v >> 6) & 63] : '=',
                      i + 2 < n ? tab[v & 63] : '=' };
        sb_add(b, q, 4);
    }
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (w <= 0)
            return; /* the host went away: the response is lost, as with qga */
        p += w;
        n -= (size_t)w;
    }
}

/* ---- JSON ---- */

enum jtype { J_OBJ, J_ARR, J_STR, J_NUM, J_TRUE, J_FALSE, J_NULL };

struct jnode {
    enum jtype type;
    const char *raw; /* J_NUM: its text, as sent (echoed as is: ids can be any size) */
    size_t rawlen;
    const char *str; /* J_STR: decoded, NUL-terminated */
    size_t len;
    const char *key; /* the member's name, inside an object */
    int child, next; /* first member or element, next sibling; -1 for none */
};

/* One request, parsed. Static: a guest agent handles one request at a time. */
static struct json {
    struct jnode nodes[MAX_NODES];
    int n;
    char strs[MAX_REQUEST + 1]; /* decoded strings; each is shorter than its quoted form */
    size_t strs_len;
    const char *p, *end;
    const char *err;
} js;

static int perr(const char *why)
{
    if (!js.err)
        js.err = why;
    return -1;
}

static void skip_ws(void)
{
    while (js.p < js.end && (*js.p == ' ' || *js.p == '\t' || *js.p == '\r' || *js.p == '\n'))
        js.p++;
}

static int hex4(unsigned *out)
{
    if (js.end - js.p < 4)
        return perr("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = *js.p++;
        if (!isxdigit((unsigned char)c))
            return perr("invalid \\u escape");
        v = v << 4 | (unsigned)(isdigit((unsigned char)c) ? c - '0' : (tolower(c) - 'a' + 10));
    }
    *out = v;
    return 0;
}

/* \uXXXX (after the "\u"), as UTF-8; a surrogate pair makes one character. */
static int unicode_escape(char **d)
{
    unsigned cp, lo;
    if (hex4(&cp) < 0)
        return -1;
    if (cp >= 0xdc00 && cp < 0xe000)
        return perr("lone low surrogate in \\u escape");
    if (cp >= 0xd800 && cp < 0xdc00) {
        if (js.end - js.p < 2 || js.p[0] != '\\' || js.p[1] != 'u')
            return perr("lone high surrogate in \\u escape");
        js.p += 2;
        if (hex4(&lo) < 0)
            return -1;
        if (lo < 0xdc00 || lo >= 0xe000)
            return perr("invalid surrogate pair in \\u escape");
        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
    }
    if (cp == 0)
        return perr("\\u0000 is not supported"); /* our strings are C strings */
    char *o = *d;
    if (cp < 0x80) {
        *o++ = (char)cp;
    } else if (cp < 0x800) {
        *o++ = (char)(0xc0 | cp >> 6);
        *o++ = (char)(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
        *o++ = (char)(0xe0 | cp >> 12);
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3f));
        *o++ = (char)(0x80 | (cp & 0x3f));
    } else {
        *o++ = (char)(0xf0 | cp >> 18);
        *o++ = (char)(0x80 | ((cp >> 12) & 0x3f));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3f));
        *o++ = (char)(0x80 | (cp & 0x3f));
    }
    *d = o;
    return 0;
}

static int parse_string(const char **out, size_t *len)
{
    char *dst = js.strs + js.strs_len, *d = dst;
    js.p++; /* the opening quote */
    while (js.p < js.end) {
        unsigned char c = (unsigned char)*js.p++;
        if (c == '"') {
            *d++ = 0;
            *out = dst;
            *len = (size_t)(d - dst) - 1;
            js.strs_len += (size_t)(d - dst);
            return 0;
        }
        if (c < 0x20)
            return perr("control character in a string");
        if (c != '\\') {
            *d++ = (char)c;
            continue;
        }
        if (js.p == js.end)
            break;
        switch (c = (unsigned char)*js.p++) {
        case '"': case '\\': case '/': *d++ = (char)c; break;
        case 'b': *d++ = '\b'; break;
        case 'f': *d++ = '\f'; break;
        case 'n': *d++ = '\n'; break;
        case 'r': *d++ = '\r'; break;
        case 't': *d++ = '\t'; break;
        case 'u':
            if (unicode_escape(&d) < 0)
                return -1;
            break;
        default:
            return perr("invalid escape in a string");
        }
    }
    return perr("unterminated string");
}

static int digits(void)
{
    if (js.p == js.end || !isdigit((unsigned char)*js.p))
        return perr("invalid number");
    while (js.p < js.end && isdigit((unsigned char)*js.p))
        js.p++;
    return 0;
}

/* JSON's number grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static int parse_number(void)
{
    if (*js.p == '-')
        js.p++;
    if (js.p < js.end && *js.p == '0')
        js.p++;
    else if (digits() < 0)
        return -1;
    if (js.p < js.end && *js.p == '.') {
        js.p++;
        if (digits() < 0)
            return -1;
    }
    if (js.p < js.end && (*js.p == 'e' || *js.p == 'E')) {
        js.p++;
        if (js.p < js.end && (*js.p == '+' || *js.p == '-'))
            js.p++;
        if (digits() < 0)
            return -1;
    }
    return 0;
}

static int parse_literal(struct jnode *n)
{
    static const struct { const char *word; enum jtype type; } lits[] = {
        { "true", J_TRUE }, { "false", J_FALSE }, { "null", J_NULL },
    };
    for (size_t i = 0; i < sizeof lits / sizeof lits[0]; i++) {
        size_t l = strlen(lits[i].word);
        if ((size_t)(js.end - js.p) >= l && memcmp(js.p, lits[i].word, l) == 0) {
            n->type = lits[i].type;
            js.p += l;
            return 0;
        }
    }
    return perr("invalid token");
}

static int parse_value(int depth);

/* An object or an array: members are linked through child/next. */
static int parse_container(int i, int depth)
{
    int obj = *js.p == '{', last = -1;
    char close = obj ? '}' : ']';
    js.nodes[i].type = obj ? J_OBJ : J_ARR;
    js.p++;
    skip_ws();
    if (js.p < js.end && *js.p == close) {
        js.p++;
        return 0;
    }
    for (;;) {
        const char *key = NULL;
        size_t klen;
        if (obj) {
            skip_ws();
            if (js.p == js.end || *js.p != '"')
                return perr("expected a member name");
            if (parse_string(&key, &klen) < 0)
                return -1;
            skip_ws();
            if (js.p == js.end || *js.p != ':')
                return perr("expected ':'");
            js.p++;
        }
        int c = parse_value(depth + 1);
        if (c < 0)
            return -1;
        js.nodes[c].key = key;
        if (last < 0)
            js.nodes[i].child = c;
        else
            js.nodes[last].next = c;
        last = c;
        skip_ws();
        if (js.p < js.end && *js.p == ',') {
            js.p++;
            continue;
        }
        if (js.p < js.end && *js.p == close) {
            js.p++;
            return 0;
        }
        return perr(obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int parse_value(int depth)
{
    skip_ws();
    if (depth > MAX_DEPTH)
        return perr("nesting too deep");
    if (js.p == js.end)
        return perr("unexpected end of input");
    if (js.n == MAX_NODES)
        return perr("too many values");
    int i = js.n++;
    struct jnode *n = &js.nodes[i];
    memset(n, 0, sizeof *n);
    n->child = n->next = -1;
    n->raw = js.p;
    int rc;
    if (*js.p == '{' || *js.p == '[') {
        rc = parse_container(i, depth);
    } else if (*js.p == '"') {
        n->type = J_STR;
        rc = parse_string(&n->str, &n->len);
    } else if (*js.p == '-' || isdigit((unsigned char)*js.p)) {
        n->type = J_NUM;
        rc = parse_number();
    } else {
        rc = parse_literal(n);
    }
    n->rawlen = (size_t)(js.p - n->raw);
    return rc < 0 ? -1 : i;
}

/* Parses a whole request; returns its root node, or -1 with js.err set. */
static int json_parse(const char *text, size_t len)
{
    js.n = 0;
    js.strs_len = 0;
    js.p = text;
    js.end = text + len;
    js.err = NULL;
    int root = parse_value(0);
    if (root < 0)
        return -1;
    skip_ws();
    return js.p == js.end ? root : perr("trailing characters");
}

static int member(int obj, const char *key)
{
    for (int i = js.nodes[obj].child; i >= 0; i = js.nodes[i].next)
        if (strcmp(js.nodes[i].key, key) == 0)
            return i;
    return -1;
}

/* Writes a value back compactly (a request's "id" is echoed in its response, on one line). */
static void emit(struct sb *b, int i)
{
    const struct jnode *n = &js.nodes[i];
    switch (n->type) {
    case J_STR:
        sb_json_str(b, n->str, n->len);
        return;
    case J_OBJ:
    case J_ARR:
        sb_puts(b, n->type == J_OBJ ? "{" : "[");
        for (int c = n->child; c >= 0; c = js.nodes[c].next) {
            if (n->type == J_OBJ) {
                sb_json_str(b, js.nodes[c].key, strlen(js.nodes[c].key));
                sb_puts(b, ": ");
            }
            emit(b, c);
            if (js.nodes[c].next >= 0)
                sb_puts(b, ", ");
        }
        sb_puts(b, n->type == J_OBJ ? "}" : "]");
        return;
    default:
        sb_add(b, n->raw, n->rawlen); /* a number or a literal: no whitespace inside */
    }
}

/* An integer that fits in 64 bits, like qga's "int" parameters. */
static int node_int(int i, long long *out)
{
    const struct jnode *n = &js.nodes[i];
    char tmp[32];
    if (n->type != J_NUM || n->rawlen >= sizeof tmp)
        return -1;
    memcpy(tmp, n->raw, n->rawlen);
    tmp[n->rawlen] = 0;
    char *end;
    errno = 0;
    long long v = strtoll(tmp, &end, 10);
    if (errno || *end) /* out of range, or a fraction or exponent */
        return -1;
    *out = v;
    return 0;
}

/* ---- commands ---- */

struct call {
    int args;             /* the "arguments" object, or -1 */
    struct sb ret;        /* the "return" value, as JSON */
    const char *err_class; /* set when the command failed */
    char desc[512];
    int delimited;        /* guest-sync-delimited: 0xFF before the response */
};

static void fail(struct call *c, const char *cls, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->desc, sizeof c->desc, fmt, ap);
    va_end(ap);
    c->err_class = cls;
}

static int arg_get(const struct call *c, const char *key)
{
    return c->args < 0 ? -1 : member(c->args, key);
}

/* The messages are qga's, so a caller sees the same errors as from a real guest. */
static int arg_int(struct call *c, const char *key, long long *out)
{
    int i = arg_get(c, key);
    if (i < 0) {
        fail(c, "GenericError", "Parameter '%s' is missing", key);
        return -1;
    }
    if (node_int(i, out) < 0) {
        fail(c, "GenericError", "Invalid parameter type for '%s', expected: integer", key);
        return -1;
    }
    return i;
}

/* An optional array of strings into out[0..max-1]; returns the count, or -1. */
static int arg_strings(struct call *c, const char *key, char **out, int max)
{
    int i = arg_get(c, key), n = 0;
    if (i < 0)
        return 0;
    if (js.nodes[i].type != J_ARR) {
        fail(c, "GenericError", "Invalid parameter type for '%s', expected: array", key);
        return -1;
    }
    for (int e = js.nodes[i].child; e >= 0; e = js.nodes[e].next) {
        if (js.nodes[e].type != J_STR) {
            fail(c, "GenericError", "Invalid parameter type for '%s', expected: string", key);
            return -1;
        }
        if (n == max) {
            fail(c, "GenericError", "too many '%s' (ferry-guest takes at most %d)", key, max);
            return -1;
        }
        out[n++] = (char *)js.nodes[e].str;
    }
    return n;
}

static void cmd_sync(struct call *c)
{
    long long id;
    int i = arg_int(c, "id", &id);
    if (i >= 0)
        sb_add(&c->ret, js.nodes[i].raw, js.nodes[i].rawlen); /* exactly as the host wrote it */
}

static void cmd_sync_delimited(struct call *c)
{
    cmd_sync(c);
    c->delimited = !c->err_class;
}

static void cmd_ping(struct call *c)
{
    sb_puts(&c->ret, "{}");
}

static void cmd_info(struct call *c);

/* guest-exec's children, until guest-exec-status has reported their exit. */
struct proc {
    pid_t pid; /* 0: a free slot */
    int out_fd, err_fd; /* captured output (unlinked files), or -1 */
};
static struct proc procs[MAX_PROCS];

enum { CAP_OUT = 1, CAP_ERR = 2, CAP_MERGED = 4 };

/* capture-output: a boolean, or (QEMU 8.0 and later) one of qga's mode names. */
static int capture_mode(struct call *c, int *mode)
{
    static const struct { const char *name; int mode; } modes[] = {
        { "none", 0 }, { "stdout", CAP_OUT }, { "stderr", CAP_ERR },
        { "separated", CAP_OUT | CAP_ERR }, { "merged", CAP_OUT | CAP_MERGED },
    };
    int i = arg_get(c, "capture-output");
    *mode = 0;
    if (i < 0 || js.nodes[i].type == J_FALSE)
        return 0;
    if (js.nodes[i].type == J_TRUE) {
        *mode = CAP_OUT | CAP_ERR;
        return 0;
    }
    for (size_t m = 0; js.nodes[i].type == J_STR && m < sizeof modes / sizeof modes[0]; m++) {
        if (strcmp(js.nodes[i].str, modes[m].name) == 0) {
            *mode = modes[m].mode;
            return 0;
        }
    }
    fail(c, "GenericError", "Invalid parameter type for 'capture-output', expected: boolean");
    return -1;
}

/* A file in /tmp that only its descriptor keeps: nothing to clean up if we die. */
static int capture_file(void)
{
    char name[] = "/tmp/ferry-qga-XXXXXX";
    int fd = mkostemp(name, O_CLOEXEC);
    if (fd >= 0)
        unlink(name);
    return fd;
}

static void proc_free(struct proc *p)
{
    if (p->out_fd >= 0)
        close(p->out_fd);
    if (p->err_fd >= 0)
        close(p->err_fd);
    p->pid = 0;
}

/* In the child: stdin from /dev/null and stdout/stderr to the capture files or /dev/null, as
 * qga does; an exec failure goes back to the parent through `errfd`. */
static void child(int errfd, const struct proc *p, int merged, char **argv, char **envp)
{
    int null = open("/dev/null", O_RDWR);
    int out = p->out_fd >= 0 ? p->out_fd : null;
    int err = p->err_fd >= 0 ? p->err_fd : merged ? out : null;
    if (null >= 0 && dup2(null, 0) >= 0 && dup2(out, 1) >= 0 && dup2(err, 2) >= 0) {
        setsid(); /* out of our session: a signal meant for us is not for the command */
        if (envp)
            environ = envp; /* execvp then searches the caller's PATH, like qga */
        execvp(argv[0], argv);
    }
    int e = errno;
    while (write(errfd, &e, sizeof e) < 0 && errno == EINTR) {
    }
    _exit(127);
}

/* fork + exec; the close-on-exec pipe tells a failed exec (an error reply, as from qga) from a
 * command that started. */
static int spawn(struct call *c, struct proc *p, int merged, char **argv, char **envp)
{
    int ep[2];
    if (pipe2(ep, O_CLOEXEC) < 0) {
        fail(c, "GenericError", "pipe: %s", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0)
        child(ep[1], p, merged, argv, envp);
    int e = errno;
    close(ep[1]);
    if (pid < 0) {
        close(ep[0]);
        fail(c, "GenericError", "fork: %s", strerror(e));
        return -1;
    }
    ssize_t n;
    while ((n = read(ep[0], &e, sizeof e)) < 0 && errno == EINTR) {
    }
    close(ep[0]);
    if (n == sizeof e) {
        waitpid(pid, NULL, 0);
        fail(c, "GenericError",
             "Guest agent command failed, error was 'Failed to execute child process \"%s\" (%s)'",
             argv[0], strerror(e));
        return -1;
    }
    p->pid = pid;
    return 0;
}

static void cmd_exec(struct call *c)
{
    char *argv[MAX_ARGS + 2], *envp[MAX_ARGS + 1];
    int path = arg_get(c, "path"), mode, nargs, nenv;
    if (path < 0 || js.nodes[path].type != J_STR) {
        fail(c, "GenericError", path < 0 ? "Parameter 'path' is missing"
                                         : "Invalid parameter type for 'path', expected: string");
        return;
    }
    if ((nargs = arg_strings(c, "arg", argv + 1, MAX_ARGS)) < 0 ||
        (nenv = arg_strings(c, "env", envp, MAX_ARGS)) < 0 || capture_mode(c, &mode) < 0)
        return;
    if (arg_get(c, "input-data") >= 0) {
        fail(c, "GenericError", "input-data is not supported by ferry-guest");
        return;
    }
    argv[0] = (char *)js.nodes[path].str;
    argv[nargs + 1] = NULL;
    envp[nenv] = NULL;
    struct proc *p = NULL;
    for (int i = 0; i < MAX_PROCS && !p; i++)
        if (procs[i].pid == 0)
            p = &procs[i];
    if (!p) {
        fail(c, "GenericError", "%d commands not yet reaped by guest-exec-status", MAX_PROCS);
        return;
    }
    p->out_fd = mode & CAP_OUT ? capture_file() : -1;
    p->err_fd = mode & CAP_ERR ? capture_file() : -1;
    if (((mode & CAP_OUT) && p->out_fd < 0) || ((mode & CAP_ERR) && p->err_fd < 0)) {
        fail(c, "GenericError", "cannot capture output in /tmp: %s", strerror(errno));
        proc_free(p);
        return;
    }
    if (spawn(c, p, mode & CAP_MERGED, argv, arg_get(c, "env") >= 0 ? envp : NULL) < 0) {
        proc_free(p);
        return;
    }
    sb_printf(&c->ret, "{\"pid\": %d}", (int)p->pid);
}

/* ", "NAME-data": BASE64, "NAME-truncated": BOOL" for what a command wrote, if anything. */
static void emit_capture(struct sb *b, const char *name, int fd)
{
    static unsigned char data[MAX_CAPTURE];
    struct stat st;
    ssize_t n = fd < 0 ? 0 : pread(fd, data, sizeof data, 0);
    if (n <= 0)
        return;
    sb_printf(b, ", \"%s-data\": \"", name);
    sb_base64(b, data, (size_t)n);
    sb_printf(b, "\", \"%s-truncated\": %s", name,
              fstat(fd, &st) == 0 && st.st_size > n ? "true" : "false");
}

static void cmd_exec_status(struct call *c)
{
    long long pid;
    if (arg_int(c, "pid", &pid) < 0)
        return;
    struct proc *p = NULL;
    for (int i = 0; i < MAX_PROCS && !p; i++)
        if (procs[i].pid != 0 && procs[i].pid == pid)
            p = &procs[i];
    if (!p) {
        fail(c, "GenericError", "PID %lld does not exist", pid);
        return;
    }
    int st;
    pid_t r = waitpid(p->pid, &st, WNOHANG);
    if (r == 0) {
        sb_puts(&c->ret, "{\"exited\": false}");
        return;
    }
    if (r < 0) {
        fail(c, "GenericError", "waitpid %lld: %s", pid, strerror(errno));
    } else {
        sb_puts(&c->ret, "{\"exited\": true");
        if (WIFEXITED(st))
            sb_printf(&c->ret, ", \"exitcode\": %d", WEXITSTATUS(st));
        else if (WIFSIGNALED(st))
            sb_printf(&c->ret, ", \"signal\": %d", WTERMSIG(st));
        emit_capture(&c->ret, "out", p->out_fd);
        emit_capture(&c->ret, "err", p->err_fd);
        sb_puts(&c->ret, "}");
    }
    proc_free(p); /* like qga: a pid is reported as exited once, then forgotten */
}

static const struct command {
    const char *name;
    void (*fn)(struct call *c);
} commands[] = {
    { "guest-sync", cmd_sync },
    { "guest-sync-delimited", cmd_sync_delimited },
    { "guest-ping", cmd_ping },
    { "guest-info", cmd_info },
    { "guest-exec", cmd_exec },
    { "guest-exec-status", cmd_exec_status },
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

static void cmd_info(struct call *c)
{
    sb_puts(&c->ret, "{\"version\": \"ferry-guest\", \"supported_commands\": [");
    for (size_t i = 0; i < NCOMMANDS; i++)
        sb_printf(&c->ret, "%s{\"enabled\": true, \"name\": \"%s\", \"success-response\": true}",
                  i ? ", " : "", commands[i].name);
    sb_puts(&c->ret, "]}");
}

static void dispatch(struct call *c, int root)
{
    int ex = member(root, "execute");
    if (ex < 0) {
        fail(c, "GenericError", "QMP input lacks member 'execute'");
        return;
    }
    if (js.nodes[ex].type != J_STR) {
        fail(c, "GenericError", "QMP input member 'execute' must be a string");
        return;
    }
    c->args = member(root, "arguments");
    if (c->args >= 0 && js.nodes[c->args].type != J_OBJ) {
        fail(c, "GenericError", "QMP input member 'arguments' must be an object");
        return;
    }
    for (size_t i = 0; i < NCOMMANDS; i++) {
        if (strcmp(js.nodes[ex].str, commands[i].name) == 0) {
            commands[i].fn(c);
            return;
        }
    }
    fail(c, "CommandNotFound", "The command %s has not been found", js.nodes[ex].str);
}

/* The response line; `id` is the request's "id" member (-1 for none). */
static void respond(int fd, struct call *c, int id)
{
    struct sb out = { 0 };
    if (c->delimited)
        sb_add(&out, "\xff", 1);
    if (c->err_class) {
        sb_puts(&out, "{\"error\": {\"class\": ");
        sb_json_str(&out, c->err_class, strlen(c->err_class));
        sb_puts(&out, ", \"desc\": ");
        sb_json_str(&out, c->desc, strlen(c->desc));
        sb_puts(&out, "}");
    } else {
        sb_puts(&out, "{\"return\": ");
        sb_puts(&out, c->ret.len ? c->ret.p : "{}");
    }
    if (id >= 0) {
        sb_puts(&out, ", \"id\": ");
        emit(&out, id);
    }
    sb_puts(&out, "}\n");
    write_all(fd, out.p, out.len);
    free(out.p);
    free(c->ret.p);
}

static void respond_error(int fd, const char *desc)
{
    struct call c = { .args = -1 };
    fail(&c, "GenericError", "%s", desc);
    respond(fd, &c, -1);
}

static void handle(int fd, const char *req, size_t len)
{
    struct call c = { .args = -1 };
    int root = json_parse(req, len), id = -1;
    if (root < 0) {
        fail(&c, "GenericError", "JSON parse error, %s", js.err);
    } else if (js.nodes[root].type != J_OBJ) {
        fail(&c, "GenericError", "QMP input must be a JSON object");
    } else {
        id = member(root, "id");
        dispatch(&c, root);
    }
    respond(fd, &c, id);
}

/* ---- framing ---- */

static struct {
    char buf[MAX_REQUEST];
    size_t len;
    int depth;       /* of {} and [] outside strings */
    int in_str, esc;
    int garbage;     /* a run of bytes that cannot start a request */
    int skip;        /* after an over-long request: drop bytes up to the next newline */
} in;

static void reset_input(void)
{
    in.len = 0;
    in.depth = in.in_str = in.esc = in.garbage = in.skip = 0;
}

static void feed(int fd, unsigned char c)
{
    if (c == 0xff) { /* the host resynchronizes: whatever came before is stale */
        reset_input();
        return;
    }
    if (in.skip) {
        in.skip = c != '\n';
        return;
    }
    int space = c == ' ' || c == '\t' || c == '\r' || c == '\n';
    if (in.garbage && (space || c == '{' || c == '[')) {
        /* One error per run of junk, as qga's lexer gives; a brace may start a real request. */
        respond_error(fd, "JSON parse error, invalid input");
        reset_input();
    }
    if (in.len == 0 && !in.garbage) {
        if (space)
            return; /* between requests */
        in.garbage = c != '{' && c != '[';
    }
    if (in.len == sizeof in.buf) {
        respond_error(fd, "request longer than " STR(MAX_REQUEST) " bytes");
        reset_input();
        in.skip = c != '\n';
        return;
    }
    in.buf[in.len++] = (char)c;
    if (in.garbage)
        return;
    if (in.in_str) {
        if (in.esc)
            in.esc = 0;
        else if (c == '\\')
            in.esc = 1;
        else if (c == '"')
            in.in_str = 0;
        return;
    }
    if (c == '"') {
        in.in_str = 1;
    } else if (c == '{' || c == '[') {
        if (++in.depth > MAX_DEPTH) {
            respond_error(fd, "JSON parse error, nesting too deep");
            reset_input();
            in.skip = 1;
        }
    } else if (c == '}' || c == ']') {
        if (--in.depth == 0) {
            handle(fd, in.buf, in.len);
            reset_input();
        }
    }
}

/* ---- the port ---- */

/* The /dev node of the virtio-serial port named PORT_NAME, once it has one. */
static int find_port(char *dev, size_t len)
{
    DIR *d = opendir(PORTS_DIR);
    if (!d)
        return -1;
    int found = -1;
    struct dirent *e;
    while (found < 0 && (e = readdir(d)) != NULL) {
        char path[300], name[64] = "";
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, PORTS_DIR "/%s/name", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        if (fgets(name, sizeof name, f))
            name[strcspn(name, "\n")] = 0;
        fclose(f);
        snprintf(dev, len, "/dev/%s", e->d_name);
        /* The name arrives from the host after the port, and devtmpfs adds the node on its own. */
        if (strcmp(name, PORT_NAME) == 0 && access(dev, F_OK) == 0)
            found = 0;
    }
    closedir(d);
    return found;
}

int qga_serve(const char *dev)
{
    char found[300];
    for (int waited = 0; !dev; waited += 100) {
        if (find_port(found, sizeof found) == 0)
            dev = found;
        else if (waited >= PORT_WAIT_MS)
            return fprintf(stderr, "ferry-guest qga: no virtio-serial port " PORT_NAME "\n"), 2;
        else
            sleep_ms(100);
    }
    int fd = open(dev, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "ferry-guest qga: open %s: %s\n", dev, strerror(errno));
        return 1;
    }
    struct termios t;
    if (tcgetattr(fd, &t) == 0) { /* a tty (tests use a pty): bytes through as they are */
        cfmakeraw(&t);
        tcsetattr(fd, TCSANOW, &t);
    }
    signal(SIGCHLD, SIG_DFL); /* SIG_IGN would reap the children before guest-exec-status */
    setenv("PATH", "/bin:/sbin:/usr/bin:/usr/sbin", 0); /* /init may run without one */
    fprintf(stderr, "ferry-guest qga: serving on %s\n", dev);
    unsigned char buf[4096];
    for (;;) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (poll(&p, 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            fprintf(stderr, "ferry-guest qga: poll: %s\n", strerror(errno));
            return 1;
        }
        if (p.revents & POLLNVAL)
            return 1;
        ssize_t n = p.revents & POLLIN ? read(fd, buf, sizeof buf) : 0;
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n < 0) {
            fprintf(stderr, "ferry-guest qga: read %s: %s\n", dev, strerror(errno));
            return 1;
        }
        if (n == 0) {
            /* No one on the host end (virtio-serial reads 0 and polls HUP until libvirt
             * connects): a half-read request is from a client that left. Waiting keeps this
             * from spinning, as qga does; half a second is well within libvirt's 5 s wait for
             * its first guest-sync, and costs an emulated guest little CPU. */
            reset_input();
            sleep_ms(500);
            continue;
        }
        for (ssize_t i = 0; i < n; i++)
            feed(fd, buf[i]);
    }
}
