/*
 * incus-ready: tell Incus that this instance is ready.
 *
 * Incus 6.0 emits the lifecycle event `instance-ready` only when the guest itself sends
 * `PATCH /1.0 {"state":"Ready"}` to the guest API socket /dev/incus/sock. Busybox cannot
 * (its nc has no unix sockets), so the test image runs this tiny static client at boot.
 * It waits up to 30 s for the socket, sends the request, and exits 0 on an HTTP 200.
 *
 * Build: gcc -static -Os -o incus-ready incus-ready.c
 * Usage: incus-ready [SOCKET]            (default /dev/incus/sock)
 */
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static const char request[] =
    "PATCH /1.0 HTTP/1.0\r\n"
    "Host: incus\r\n"
    "Content-Type: application/json\r\n"
    "Content-Length: 17\r\n"
    "\r\n"
    "{\"state\":\"Ready\"}";

static int connect_to(const char *path) {
    struct sockaddr_un addr;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) return fd;
    close(fd);
    return -1;
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "/dev/incus/sock";
    char reply[512];
    int fd = -1;
    for (int tries = 0; tries < 300 && fd < 0; tries++) {
        fd = connect_to(path);
        if (fd < 0) usleep(100000);
    }
    if (fd < 0) {
        perror("incus-ready: connect");
        return 1;
    }
    size_t sent = 0;
    while (sent < sizeof request - 1) {
        ssize_t n = write(fd, request + sent, sizeof request - 1 - sent);
        if (n <= 0) {
            perror("incus-ready: write");
            return 1;
        }
        sent += (size_t)n;
    }
    ssize_t got = read(fd, reply, sizeof reply - 1);
    close(fd);
    if (got <= 0) {
        fputs("incus-ready: no reply\n", stderr);
        return 1;
    }
    reply[got] = '\0';
    if (strncmp(reply, "HTTP/1.0 200", 12) != 0 && strncmp(reply, "HTTP/1.1 200", 12) != 0) {
        fprintf(stderr, "incus-ready: refused: %.80s\n", reply);
        return 1;
    }
    return 0;
}
