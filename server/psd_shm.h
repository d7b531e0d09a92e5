/* psd_shm.h - psd's end of the same-host transport (common/ps_shm.h): a
 * unix socket in the abstract namespace on psd's libuv loop, where workers
 * that ASSIGN told about trade their gradient memfd for a read-only
 * descriptor of the parameter slots. */
#ifndef PSD_SHM_H
#define PSD_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "ps_shm.h"

typedef struct psd_shm psd_shm_t;

/* Judge a worker's hello and the memfd that came with it: return 0 to
 * accept (map what it needs; the fd is closed afterwards either way), or
 * -errno with why (sent to the worker and logged). */
typedef int (*psd_shm_hello_fn)(void *ud, const ps_shm_hello_t *h, int fd, char *why, size_t n);

/* Listen on the abstract address `name`. Accepted workers get ro_fd with
 * slots/slot_bytes. 0 or -errno. */
int psd_shm_listen(psd_shm_t **out, uv_loop_t *loop, const char *name, int ro_fd, uint32_t slots,
                   uint64_t slot_bytes, psd_shm_hello_fn fn, void *ud);
/* Drop connections that sent nothing within 2 s (call from a timer). */
void psd_shm_expire(psd_shm_t *sh, double now);
/* Close the socket and connections; freed once the loop has run their close
 * callbacks. NULL is fine. */
void psd_shm_close(psd_shm_t *sh);

#endif
