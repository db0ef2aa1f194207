/*
 * incus-ready: tell Incus that this instance is ready.
 *
 * Incus 6.0 emits the lifecycle event `instance-ready` only when the guest itself sends
 * `PATCH /1.0 {"state":"Ready"}` to the guest API socket /dev/incus/sock. Busybox cannot
 * (its nc has no unix sockets), so the test image's init runs this tiny static client at
 * boot.
 *
 * It keeps trying for up to 30 s and exits 0 on the first HTTP 200. Every attempt that
 * fails (no socket yet, a write or read error, no answer within 5 s, any other status)
 * is reported on stderr (the instance's console log) and tried again 0.2 s later, so a
 * single refused or lost request cannot leave the instance never ready.
 *
 * Build: gcc -static -Os -o incus-ready incus-ready.c
 * Usage: incus-ready [SOCKET]            (default /dev/incus/sock)
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static const char request[] =
    "PATCH /1.0 HTTP/1.0\r\n"
    "Host: incus\r\n"
    "Content-Type: application/json\r\n"
    "Content-Length: 17\r\n"
    "\r\n"
    "{\"state\":\"Ready\"}";

enum { DEADLINE_S = 30, RETRY_US = 200000, ANSWER_TIMEOUT_S = 5 };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int connect_to(const char *path) {
    struct sockaddr_un addr;
    struct timeval timeout = {ANSWER_TIMEOUT_S, 0};
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) return fd;
    close(fd);
    return -1;
}

/* One request: 0 on an HTTP 200; otherwise -1, with the reason in `why`. */
static int attempt(const char *path, char *why, size_t why_size) {
    char reply[512];
    int fd = connect_to(path);
    if (fd < 0) {
        snprintf(why, why_size, "cannot connect to %s", path);
        return -1;
    }
    size_t sent = 0;
    while (sent < sizeof request - 1) {
        ssize_t n = write(fd, request + sent, sizeof request - 1 - sent);
        if (n <= 0) {
            snprintf(why, why_size, "write failed");
            close(fd);
            return -1;
        }
        sent += (size_t)n;
    }
    ssize_t got = read(fd, reply, sizeof reply - 1);
    close(fd);
    if (got <= 0) {
        snprintf(why, why_size, "no answer");
        return -1;
    }
    reply[got] = '\0';
    if (strncmp(reply, "HTTP/1.0 200", 12) == 0 || strncmp(reply, "HTTP/1.1 200", 12) == 0) {
        return 0;
    }
    reply[strcspn(reply, "\r\n")] = '\0';
    snprintf(why, why_size, "refused: %.80s", reply);
    return -1;
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "/dev/incus/sock";
    char why[128] = "not tried";
    char last[128] = "";
    signal(SIGHUP, SIG_IGN); /* outlive the console session that started it */
    signal(SIGPIPE, SIG_IGN); /* a closed socket is a failed attempt, not a death */
    double deadline = now() + DEADLINE_S;
    for (;;) {
        if (attempt(path, why, sizeof why) == 0) return 0;
        if (strcmp(why, last) != 0) { /* each new reason once, not every 0.2 s */
            fprintf(stderr, "incus-ready: %s; trying again\n", why);
            strcpy(last, why);
        }
        if (now() > deadline) break;
        usleep(RETRY_US);
    }
    fprintf(stderr, "incus-ready: gave up after %d s: %s\n", DEADLINE_S, why);
    return 1;
}
