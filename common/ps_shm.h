/* ps_shm.h - the same-host transport: tensors in shared memory.
 *
 * A worker on psd's host keeps its gradient in a memfd it seals against
 * resizing and hands to psd; psd keeps its parameter versions in one memfd
 * of PSD_MAX_ARENAS slots and hands the worker a read-only descriptor of it.
 * The descriptors travel over a unix socket (SOCK_SEQPACKET, abstract
 * address: nothing in the file system or /dev/shm is left behind, whatever
 * kills either side). ZeroMQ still carries every control message; a PUSH or
 * WEIGHTS message then names tensors in a region instead of carrying frames.
 *
 * The exchange, once per worker right after ASSIGN (which gives the socket
 * name and a 16-byte token over the authenticated ZeroMQ channel):
 *   worker -> psd: ps_shm_hello_t + its gradient memfd
 *   psd -> worker: ps_shm_reply_t + a read-only fd of the parameter slots */
#ifndef PS_SHM_H
#define PS_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#define PS_SHM_MAGIC "PSDSHM1" /* 8 bytes with its NUL */
#define PS_SHM_TOKEN 16

typedef struct {
    char magic[8];
    uint64_t run_id;
    uint32_t rank;
    uint32_t reserved;
    uint8_t token[PS_SHM_TOKEN];
    uint64_t grad_bytes;      /* size of the memfd sent along */
} ps_shm_hello_t;

typedef struct {
    char magic[8];
    int32_t status;           /* 0 accepted (fd attached), else -errno and a message */
    uint32_t slots;           /* parameter versions in the region */
    uint64_t slot_bytes;      /* bytes from one slot to the next */
    char message[112];
} ps_shm_reply_t;

/* Fill an abstract unix address for name (no leading NUL or '@'). */
socklen_t ps_shm_addr(struct sockaddr_un *a, const char *name);

/* A memfd of `bytes` (zero-filled); seal: also seal its size (shrink, grow)
 * and the seals. Returns the fd or -errno. */
int ps_shm_memfd(const char *name, size_t bytes, int seal);

/* 0 if fd is a memfd of exactly `bytes` whose size is sealed (so that a
 * mapping of it can never fault), else -errno with why. */
int ps_shm_check_sealed(int fd, size_t bytes, char *why, size_t n);

/* A read-only descriptor of the same memfd (through /proc/self/fd): whoever
 * holds it cannot write or resize the region. Returns the fd or -errno. */
int ps_shm_reopen_ro(int fd);

/* One datagram with at most one descriptor (fd < 0: none). 0 or -errno. */
int ps_shm_send(int sock, const void *buf, size_t len, int fd);
/* Receive one datagram of exactly len bytes and at most one descriptor
 * (*fd = -1 when none). Extra or truncated descriptors are closed and the
 * datagram refused (-EBADMSG). flags: MSG_DONTWAIT or 0. Returns 0 or -errno. */
int ps_shm_recv(int sock, void *buf, size_t len, int *fd, int flags);

/* Bytes rounded up to whole pages. */
size_t ps_shm_round(size_t bytes);

#endif
