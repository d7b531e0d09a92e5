#include "ps_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

socklen_t ps_shm_addr(struct sockaddr_un *a, const char *name)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    size_t n = strnlen(name, sizeof a->sun_path - 2);
    memcpy(a->sun_path + 1, name, n); /* sun_path[0] = 0: abstract */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

size_t ps_shm_round(size_t bytes)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + pg - 1) / pg * pg;
}

int ps_shm_memfd(const char *name, size_t bytes, int seal)
{
    int fd = memfd_create(name, MFD_CLOEXEC | (seal ? MFD_ALLOW_SEALING : 0));
    if (fd < 0) return -errno;
    if (ftruncate(fd, (off_t)bytes) != 0 ||
        (seal && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)) {
        int e = errno;
        close(fd);
        return -e;
    }
    return fd;
}

int ps_shm_check_sealed(int fd, size_t bytes, char *why, size_t n)
{
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
        snprintf(why, n, "not a sealable memfd");
        return -EINVAL;
    }
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
        snprintf(why, n, "its size is not sealed");
        return -EINVAL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != (uint64_t)bytes) {
        snprintf(why, n, "its size is %lld bytes, want %zu", (long long)st.st_size, bytes);
        return -EINVAL;
    }
    return 0;
}

int ps_shm_reopen_ro(int fd)
{
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    int ro = open(p, O_RDONLY | O_CLOEXEC);
    return ro < 0 ? -errno : ro;
}

int ps_shm_send(int sock, const void *buf, size_t len, int fd)
{
    struct iovec iov = {(void *)buf, len};
    union {
        char b[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&u, 0, sizeof u);
        mh.msg_control = u.b;
        mh.msg_controllen = sizeof u.b;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    }
    for (;;) {
        ssize_t r = sendmsg(sock, &mh, MSG_NOSIGNAL);
        if (r == (ssize_t)len) return 0;
        if (r >= 0) return -EMSGSIZE;
        if (errno != EINTR) return -errno;
    }
}

int ps_shm_recv(int sock, void *buf, size_t len, int *fd, int flags)
{
    *fd = -1;
    struct iovec iov = {buf, len};
    union {
        char b[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof u.b};
    ssize_t r;
    do
        r = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);
    while (r < 0 && errno == EINTR);
    if (r < 0) return -errno;
    int got[4], n = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int f;
            memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof f);
            if (n < 4) got[n++] = f;
            else close(f);
        }
    }
    if (n > 1 || (mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) || (size_t)r != len) {
        for (int i = 0; i < n; i++) close(got[i]);
        return r == 0 ? -ECONNRESET : -EBADMSG;
    }
    if (n == 1) *fd = got[0];
    return 0;
}
