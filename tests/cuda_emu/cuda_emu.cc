/* cuda_emu.cc - the CPU emulation of the CUDA runtime and cuBLAS described
 * in cuda_runtime.h. Compiled into libpsw_cuda_emu.so with the CUDA
 * backend's own source. */
#include "cublas_v2.h"
#include "cuda_runtime.h"

#include <cblas.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

/* ---- errors ---- */

static thread_local cudaError_t last_error = cudaSuccess;

static cudaError_t fail(cudaError_t e)
{
    last_error = e;
    return e;
}

/* PSW_CUDA_EMU_FAIL=DEV:N: the device, and the launch on it, that fails */
static int fail_dev = -1;
static long fail_launch;
static std::atomic<long> launches[16];
static std::atomic<bool> broken[16]; /* a launch failed: sticky */

static void fail_init(void)
{
    static std::once_flag once;
    std::call_once(once, [] {
        const char *s = getenv("PSW_CUDA_EMU_FAIL");
        if (s && (sscanf(s, "%d:%ld", &fail_dev, &fail_launch) != 2 || fail_dev < 0 || fail_dev >= 16 ||
                  fail_launch < 1)) {
            fprintf(stderr, "cuda_emu: PSW_CUDA_EMU_FAIL=%s: expected DEV:N (N >= 1)\n", s);
            abort();
        }
    });
}

[[noreturn]] static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("cuda_emu: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}

/* a kernel on dev faulted (PSW_CUDA_EMU_FAIL): every call fails from now on */
static bool is_broken(int dev) { return dev >= 0 && dev < 16 && broken[dev]; }
#define FAIL_IF_BROKEN(dev)                                                                    \
    do {                                                                                       \
        if (is_broken(dev)) return fail(cudaErrorLaunchFailure);                               \
    } while (0)

/* ---- devices ---- */

static int env_int(const char *name, int dflt, int lo, int hi)
{
    const char *s = getenv(name);
    if (!s || !*s) return dflt;
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < lo || v > hi) die("%s=%s: expected an integer in [%d, %d]", name, s, lo, hi);
    return (int)v;
}

/* PSW_CUDA_EMU_DEVICES, less those CUDA_VISIBLE_DEVICES hides: as CUDA
 * takes it, the ordinals listed up to the first that is not one */
static int n_devices(void)
{
    const int all = env_int("PSW_CUDA_EMU_DEVICES", 1, 0, 16);
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (!vis) return all;
    int n = 0;
    for (const char *q = vis; *q;) {
        char *end;
        const long v = strtol(q, &end, 10);
        if (end == q || v < 0 || v >= all || (*end && *end != ',')) break;
        n++;
        q = *end ? end + 1 : end;
    }
    return n;
}
static size_t device_bytes(void) { return (size_t)env_int("PSW_CUDA_EMU_MIB", 4096, 1, 1 << 20) << 20; }

static thread_local int cur_dev = 0;

/* PSW_CUDA_EMU_RUNTIME and PSW_CUDA_EMU_DRIVER: CUDA versions (12040 = 12.4) */
static int runtime_version(void) { return env_int("PSW_CUDA_EMU_RUNTIME", 12040, 1000, 99990); }
static int driver_version(void) { return env_int("PSW_CUDA_EMU_DRIVER", runtime_version(), 0, 99990); }

cudaError_t cudaDriverGetVersion(int *version)
{
    *version = driver_version(); /* 0: no driver, as CUDA says it */
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *version)
{
    *version = runtime_version();
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *n)
{
    *n = 0;
    if (driver_version() < runtime_version()) return fail(cudaErrorInsufficientDriver); /* none, or too old */
    *n = n_devices();
    return *n ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev)
{
    if (dev < 0 || dev >= n_devices()) return fail(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "psw CUDA emulator %d", dev);
    p->totalGlobalMem = device_bytes();
    p->major = 9;
    p->minor = 0;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev)
{
    if (dev < 0 || dev >= n_devices()) return fail(cudaErrorInvalidDevice);
    cur_dev = dev;
    return cudaSuccess;
}

/* ---- memory ---- */

namespace {
struct dev_alloc {
    char *map;       /* the mapping: the buffer's pages, then a guard page */
    size_t map_len;  /* without the guard page */
    char *base;      /* what cudaMalloc returned: ends 256-byte aligned at the guard page */
    size_t bytes;    /* as asked */
    int dev;
};
} // namespace

static std::mutex mu; /* allocs, pinned, used, device_depth, streams, plain */
static std::map<uintptr_t, dev_alloc> allocs; /* by base */
static std::set<void *> pinned;
static size_t used[16];
static int device_depth; /* queued work running (on any thread): device memory accessible */
static size_t page;

static void protect(const dev_alloc &a, bool open)
{
    if (mprotect(a.map, a.map_len, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0)
        die("mprotect: %s", strerror(errno));
}

/* Queued work runs between device_enter and device_leave. */
static void device_enter(void)
{
    std::lock_guard<std::mutex> g(mu);
    if (device_depth++ == 0)
        for (auto &kv : allocs) protect(kv.second, true);
}

static void device_leave(void)
{
    std::lock_guard<std::mutex> g(mu);
    if (--device_depth == 0)
        for (auto &kv : allocs) protect(kv.second, false);
}

/* the buffer holding p, or NULL (under mu) */
static const dev_alloc *find_alloc(const void *p)
{
    auto it = allocs.upper_bound((uintptr_t)p);
    if (it == allocs.begin()) return nullptr;
    --it;
    const dev_alloc &a = it->second;
    return (const char *)p < a.map + a.map_len + page ? &a : nullptr;
}

void psw_emu::check_ptr(const void *p, size_t bytes, bool want_device, const char *what, int arg)
{
    std::lock_guard<std::mutex> g(mu);
    const dev_alloc *a = find_alloc(p);
    const char *c = (const char *)p;
    if (want_device) {
        if (!a || c < a->base)
            die("%s: argument %d (%p) is not device memory (from cudaMalloc)", what, arg, p);
        if (bytes > a->bytes || (size_t)(c - a->base) > a->bytes - bytes)
            die("%s: argument %d: %zu bytes at offset %zu of a %zu-byte device buffer run past its end", what, arg,
                bytes, (size_t)(c - a->base), a->bytes);
    } else if (a) {
        die("%s: argument %d (%p) is device memory where host memory is expected", what, arg, p);
    }
}

static struct sigaction old_segv;

static void on_segv(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    /* no lock: the process is about to die; a best-effort diagnosis */
    const dev_alloc *a = find_alloc(si->si_addr);
    char msg[200];
    int n = 0;
    if (a && (char *)si->si_addr >= a->map + a->map_len)
        n = snprintf(msg, sizeof msg, "cuda_emu: SIGSEGV at %p: past the end of a %zu-byte device buffer\n",
                     si->si_addr, a->bytes);
    else if (a && device_depth == 0)
        n = snprintf(msg, sizeof msg, "cuda_emu: SIGSEGV at %p: the host touched device memory\n", si->si_addr);
    if (n > 0) (void)!write(2, msg, (size_t)n);
    /* the access faults again, and the handler before ours (by default:
     * death by SIGSEGV) has it */
    sigaction(sig, &old_segv, nullptr);
}

static void install_segv_handler(void)
{
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &old_segv);
    });
}

static void sync_device(int dev);

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    FAIL_IF_BROKEN(cur_dev);
    if (!p) return fail(cudaErrorInvalidValue);
    *p = nullptr;
    if (!bytes) return cudaSuccess; /* as CUDA: NULL, no error */
    install_segv_handler();
    std::lock_guard<std::mutex> g(mu);
    if (!page) page = (size_t)sysconf(_SC_PAGESIZE);
    if (bytes > device_bytes() - used[cur_dev]) return fail(cudaErrorMemoryAllocation);
    const size_t r = (bytes + 255) / 256 * 256, len = (r + page - 1) / page * page;
    char *m = (char *)mmap(nullptr, len + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
    if (mprotect(m + len, page, PROT_NONE) != 0) die("mprotect: %s", strerror(errno));
    dev_alloc a{m, len, m + len - r, bytes, cur_dev};
    memset(m, 0xff, len); /* fresh device memory is not zero: NaN floats */
    if (!device_depth) protect(a, false);
    allocs[(uintptr_t)a.base] = a;
    used[cur_dev] += bytes;
    *p = a.base;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    FAIL_IF_BROKEN(cur_dev);
    if (!p) return cudaSuccess;
    sync_device(cur_dev); /* as CUDA's: waits for the device */
    std::lock_guard<std::mutex> g(mu);
    auto it = allocs.find((uintptr_t)p);
    if (it == allocs.end()) die("cudaFree(%p): not a pointer cudaMalloc returned", p);
    munmap(it->second.map, it->second.map_len + page);
    used[it->second.dev] -= it->second.bytes;
    allocs.erase(it);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    if (!p) return fail(cudaErrorInvalidValue);
    if (posix_memalign(p, 4096, bytes ? bytes : 1) != 0) {
        *p = nullptr;
        return fail(cudaErrorMemoryAllocation);
    }
    std::lock_guard<std::mutex> g(mu);
    pinned.insert(*p);
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p)
{
    if (!p) return cudaSuccess;
    sync_device(cur_dev);
    std::lock_guard<std::mutex> g(mu);
    if (!pinned.erase(p)) die("cudaFreeHost(%p): not a pointer cudaMallocHost returned", p);
    free(p);
    return cudaSuccess;
}

/* the direction's ends checked (a mismatch aborts) */
static void check_copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, const char *what)
{
    if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDeviceToDevice) die("%s: copy kind %d", what, (int)kind);
    psw_emu::check_ptr(dst, bytes, kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice, what, 1);
    psw_emu::check_ptr(src, bytes, kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice, what, 2);
}

/* ---- streams and events ---- */

struct psw_emu_stream {
    int dev;
    std::deque<std::function<void()>> q;
    uint64_t queued = 0, done = 0;
    bool running = false;
};

struct psw_emu_event {
    cudaStream_t s = nullptr; /* of the last record (NULL: never recorded: complete) */
    uint64_t seq = 0;
};

static std::set<cudaStream_t> streams;

/* Runs s's queued work up to its seq-th item. */
static void run_until(cudaStream_t s, uint64_t seq)
{
    if (s->done >= seq) return;
    if (s->running) die("a stream waits for later work of a stream that waits for it");
    device_enter();
    s->running = true;
    while (s->done < seq) {
        std::function<void()> f = std::move(s->q.front());
        s->q.pop_front();
        f();
        s->done++;
    }
    s->running = false;
    device_leave();
}

static void enqueue(cudaStream_t s, std::function<void()> f)
{
    if (!s) { /* the legacy default stream: at once */
        device_enter();
        f();
        device_leave();
        return;
    }
    s->q.push_back(std::move(f));
    s->queued++;
}

static void sync_device(int dev)
{
    std::vector<cudaStream_t> all;
    {
        std::lock_guard<std::mutex> g(mu);
        for (cudaStream_t s : streams)
            if (s->dev == dev) all.push_back(s);
    }
    for (cudaStream_t s : all) run_until(s, s->queued);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    (void)flags;
    *s = new psw_emu_stream;
    (*s)->dev = cur_dev;
    std::lock_guard<std::mutex> g(mu);
    streams.insert(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s) return fail(cudaErrorInvalidValue);
    run_until(s, s->queued); /* CUDA finishes the queued work */
    {
        std::lock_guard<std::mutex> g(mu);
        streams.erase(s);
    }
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    FAIL_IF_BROKEN(s ? s->dev : cur_dev);
    if (s) run_until(s, s->queued);
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    (void)flags;
    *e = new psw_emu_event;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    FAIL_IF_BROKEN(s ? s->dev : cur_dev);
    if (!e || !s) return fail(cudaErrorInvalidValue);
    enqueue(s, [] {});
    e->s = s;
    e->seq = s->queued;
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    FAIL_IF_BROKEN(e && e->s ? e->s->dev : cur_dev);
    if (!e) return fail(cudaErrorInvalidValue);
    if (e->s) run_until(e->s, e->seq);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    FAIL_IF_BROKEN(s ? s->dev : cur_dev);
    (void)flags;
    if (!e) return fail(cudaErrorInvalidValue);
    cudaStream_t on = e->s;
    const uint64_t seq = e->seq;
    if (on) enqueue(s, [on, seq] { run_until(on, seq); });
    return cudaSuccess;
}

/* ---- copies ---- */

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind)
{
    FAIL_IF_BROKEN(cur_dev);
    if (!bytes) return cudaSuccess;
    check_copy(dst, src, bytes, kind, "cudaMemcpy");
    enqueue(nullptr, [=] { memcpy(dst, src, bytes); });
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s)
{
    FAIL_IF_BROKEN(s ? s->dev : cur_dev);
    if (!bytes) return cudaSuccess;
    check_copy(dst, src, bytes, kind, "cudaMemcpyAsync");
    enqueue(s, [=] { memcpy(dst, src, bytes); });
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s)
{
    FAIL_IF_BROKEN(s ? s->dev : cur_dev);
    if (!bytes) return cudaSuccess;
    psw_emu::check_ptr(p, bytes, true, "cudaMemsetAsync", 1);
    enqueue(s, [=] { memset(p, value, bytes); });
    return cudaSuccess;
}

/* ---- kernels ---- */

thread_local psw_emu::coords psw_emu::k;

/* Coroutines: a switch saves the callee-saved registers on the stack it
 * leaves and takes the other stack's (System V x86-64; 5-10 ns, where
 * swapcontext makes a system call for the signal mask each time). */
#if !defined(__x86_64__)
#error "cuda_emu's coroutines are written for x86-64"
#endif
extern "C" void psw_emu_switch(void **save_sp, void *to_sp);
asm(".text\n"
    ".p2align 4\n"
    ".type psw_emu_switch, @function\n"
    "psw_emu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size psw_emu_switch, .-psw_emu_switch\n");

namespace {
enum { READY, AT_BARRIER, DONE };
struct cothread {
    void *sp; /* saved stack pointer while switched out */
    uint3 tid;
    int state;
};
/* one block run as coroutines */
struct block_run {
    std::vector<cothread> th;
    std::vector<uint64_t> slot; /* warp shuffles: each thread's value */
    void *sched_sp;
    const std::function<void()> *fn;
    int cur;
    bool hit; /* a barrier was reached */
};
} // namespace

#define STACK_BYTES (64u << 10)

static thread_local block_run *blk;     /* the block running as coroutines, or NULL */
static thread_local const char *plain;  /* the kernel whose threads run as plain calls, or NULL */
static std::map<std::string, bool> plain_ok; /* kernel name: reached no barrier in its first launch */

/* A coroutine's first frame: runs the kernel body, then gives the CPU back
 * for good. */
static void co_start(void)
{
    block_run *b = blk;
    (*b->fn)();
    b = blk;
    b->th[(size_t)b->cur].state = DONE;
    void *dead;
    psw_emu_switch(&dead, b->sched_sp);
    __builtin_unreachable();
}

/* a fresh stack that psw_emu_switch enters at co_start */
static void *co_stack(char *stack)
{
    uintptr_t top = ((uintptr_t)stack + STACK_BYTES) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;            /* padding: co_start is entered as if called (rsp = 8 mod 16) */
    *--sp = (void *)co_start;   /* where the switch returns to */
    for (int i = 0; i < 6; i++) *--sp = nullptr; /* rbp rbx r12-r15 */
    return sp;
}

void psw_emu::barrier(void)
{
    if (plain) die("kernel %s reached a barrier, which its first launch did not", plain);
    block_run *b = blk;
    if (!b) die("a barrier outside a kernel");
    b->hit = true;
    const int me = b->cur;
    b->th[(size_t)me].state = AT_BARRIER;
    psw_emu_switch(&b->th[(size_t)me].sp, b->sched_sp);
}

int psw_emu::lane(void)
{
    const coords &c = k;
    return (int)((c.tid.x + c.tid.y * c.bdim.x + c.tid.z * c.bdim.x * c.bdim.y) % 32);
}

uint64_t psw_emu::exchange(uint64_t v, int src)
{
    block_run *b = blk;
    if (plain || !b) barrier(); /* dies, saying why */
    const int me = b->cur, from = me - me % 32 + src;
    b->slot[(size_t)me] = v;
    barrier();
    const uint64_t r = from < (int)b->th.size() ? b->slot[(size_t)from] : v;
    barrier(); /* every lane read before any writes again */
    return r;
}

static bool run_block_coop(const std::function<void()> &fn, dim3 bd, std::vector<std::unique_ptr<char[]>> &stacks)
{
    const size_t n = (size_t)bd.x * bd.y * bd.z;
    block_run b;
    b.th.resize(n);
    b.slot.assign(n, 0);
    b.fn = &fn;
    b.hit = false;
    while (stacks.size() < n) stacks.emplace_back(new char[STACK_BYTES]);
    for (size_t i = 0; i < n; i++) {
        cothread &t = b.th[i];
        t.tid = uint3{(unsigned)(i % bd.x), (unsigned)(i / bd.x % bd.y), (unsigned)(i / bd.x / bd.y)};
        t.state = READY;
        t.sp = co_stack(stacks[i].get());
    }
    block_run *outer = blk;
    blk = &b;
    for (;;) {
        for (size_t i = 0; i < n; i++)
            if (b.th[i].state == READY) {
                b.cur = (int)i;
                psw_emu::k.tid = b.th[i].tid;
                psw_emu_switch(&b.sched_sp, b.th[i].sp);
            }
        bool waiting = false; /* every live thread is at a barrier: release them */
        for (cothread &t : b.th)
            if (t.state == AT_BARRIER) t.state = READY, waiting = true;
        if (!waiting) break;
    }
    blk = outer;
    return b.hit;
}

static void run_grid(const char *name, dim3 g, dim3 bd, const std::function<void()> &fn)
{
    bool as_plain;
    {
        std::lock_guard<std::mutex> lk(mu);
        auto it = plain_ok.find(name);
        as_plain = it != plain_ok.end() && it->second;
    }
    psw_emu::coords &c = psw_emu::k;
    c.gdim = g;
    c.bdim = bd;
    static thread_local std::vector<std::unique_ptr<char[]>> stacks; /* kept: a launch reuses them */
    bool hit = false;
    for (unsigned z = 0; z < g.z; z++)
        for (unsigned y = 0; y < g.y; y++)
            for (unsigned x = 0; x < g.x; x++) {
                c.bid = uint3{x, y, z};
                if (!as_plain) {
                    hit |= run_block_coop(fn, bd, stacks);
                    continue;
                }
                plain = name;
                for (unsigned tz = 0; tz < bd.z; tz++)
                    for (unsigned ty = 0; ty < bd.y; ty++)
                        for (unsigned tx = 0; tx < bd.x; tx++) {
                            c.tid = uint3{tx, ty, tz};
                            fn();
                        }
                plain = nullptr;
            }
    if (!as_plain) {
        std::lock_guard<std::mutex> lk(mu);
        plain_ok[name] = !hit;
    }
}

void psw_emu::launch(const char *name, dim3 g, dim3 b, cudaStream_t s, std::function<void()> fn)
{
    const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    if (!g.x || !g.y || !g.z || !threads || threads > 1024 || b.z > 64 || g.y > 65535 || g.z > 65535) {
        last_error = cudaErrorInvalidConfiguration;
        return;
    }
    fail_init();
    const int dev = s ? s->dev : cur_dev;
    if (is_broken(dev)) {
        last_error = cudaErrorLaunchFailure;
        return;
    }
    if (dev == fail_dev && ++launches[dev] == fail_launch) { /* this kernel faults: not run */
        broken[dev] = true;
        return;
    }
    enqueue(s, [name, g, b, fn = std::move(fn)] { run_grid(name, g, b, fn); });
}

/* ---- cuBLAS ---- */

struct psw_emu_blas {
    cudaStream_t s = nullptr;
};

cublasStatus_t cublasCreate(cublasHandle_t *h)
{
    *h = new psw_emu_blas;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h)
{
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->s = s;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode)
{
    return h ? (mode == CUBLAS_DEFAULT_MATH ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE)
             : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t mode)
{
    /* only host scalars are emulated */
    return h ? (mode == CUBLAS_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE)
             : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char *cublasGetStatusString(cublasStatus_t st)
{
    switch (st) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

/* bytes a column-major (rows, cols) operand with leading dimension ld spans */
static size_t span(int rows, int cols, int ld) { return ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * 4; }

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    const int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
    const int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
    if (m < 0 || n < 0 || k < 0 || lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1) || ldc < (m > 1 ? m : 1) ||
        !alpha || !beta)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!m || !n) return CUBLAS_STATUS_SUCCESS;
    psw_emu::check_ptr(alpha, 4, false, "cublasSgemm alpha", 0);
    psw_emu::check_ptr(beta, 4, false, "cublasSgemm beta", 0);
    if (k) {
        psw_emu::check_ptr(A, span(ar, ac, lda), true, "cublasSgemm A", 7);
        psw_emu::check_ptr(B, span(br, bc, ldb), true, "cublasSgemm B", 9);
    }
    psw_emu::check_ptr(C, span(m, n, ldc), true, "cublasSgemm C", 12);
    const float al = *alpha, be = *beta; /* host pointer mode: read now */
    const CBLAS_TRANSPOSE cta = ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans;
    const CBLAS_TRANSPOSE ctb = tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans;
    enqueue(h->s, [=] { cblas_sgemm(CblasColMajor, cta, ctb, m, n, k, al, A, lda, B, ldb, be, C, ldc); });
    return CUBLAS_STATUS_SUCCESS;
}
