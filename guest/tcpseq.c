/* TCP sequence server: each client gets the lines "0\n", "1\n", ... one every interval, on a
 * thread of its own. A client that sees every number once, in order, knows its connection
 * survived a migration without a lost or repeated byte. */
#include "guest.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

struct client {
    int fd;
    unsigned interval_ms;
};

static void *serve_client(void *arg)
{
    struct client c = *(struct client *)arg;
    free(arg);
    char line[32];
    for (unsigned long long seq = 0;; seq++) {
        int n = snprintf(line, sizeof line, "%llu\n", seq);
        if (send(c.fd, line, (size_t)n, MSG_NOSIGNAL) != n)
            break;
        sleep_ms(c.interval_ms);
    }
    close(c.fd);
    return NULL;
}

int tcpseq_serve(int port, unsigned interval_ms)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    if (bind(ls, (struct sockaddr *)&a, sizeof a) != 0 || listen(ls, 8) != 0) {
        fprintf(stderr, "tcpseq: port %d: %s\n", port, strerror(errno));
        return 1;
    }
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0)
            continue;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct client *c = malloc(sizeof *c);
        c->fd = fd;
        c->interval_ms = interval_ms;
        pthread_t t;
        if (pthread_create(&t, NULL, serve_client, c) != 0) {
            close(fd);
            free(c);
            continue;
        }
        pthread_detach(t);
    }
}
