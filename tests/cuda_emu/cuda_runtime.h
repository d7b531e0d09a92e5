/* cuda_runtime.h - a CPU emulation of the part of the CUDA runtime and of
 * the CUDA C++ kernel language that worker/cuda/psw_backend_cuda.cu uses, so
 * that the backend's own source runs, unchanged, on a machine with no GPU:
 * meson compiles it with the C++ compiler against this directory into
 * libpsw_cuda_emu.so, which pworker and tests/gpu/test_cuda_ops load as they
 * load libpsw_cuda.so (PSW_CUDA_PLUGIN). It is a checker more than a
 * simulator; where CUDA leaves a freedom it takes the one most likely to
 * expose a mistake:
 *
 * - Streams run lazily. Work queued on a stream (kernels, cuBLAS calls,
 *   asynchronous copies and memsets) runs only when something waits for it:
 *   cudaStreamSynchronize, cudaEventSynchronize, another stream that waits on
 *   an event of it (cudaStreamWaitEvent), cudaFree / cudaFreeHost (which
 *   wait for the whole device, as CUDA's do). Host code that reads a result
 *   without waiting reads what was there before.
 * - Device memory is not host memory. Every cudaMalloc is its own mapping,
 *   inaccessible except while queued work runs, so a host read or write of
 *   device memory faults (SIGSEGV: the test fails); it ends where the next
 *   page begins, an inaccessible guard, rounded to 256 bytes as cudaMalloc
 *   aligns, so a kernel that reads past its buffer faults too; fresh memory
 *   is filled with 0xff bytes (NaN floats). Every pointer passed to a kernel,
 *   a copy, a memset or a GEMM is checked to be where it must be (device,
 *   or host), and a copy's whole range to lie in one buffer: a mismatch
 *   prints what and where, and aborts.
 * - Kernels run on the calling thread, block after block; the threads of a
 *   block run one at a time as coroutines that switch at __syncthreads,
 *   __syncwarp and the warp shuffles (each a barrier of the block's live
 *   threads). A kernel's first launch runs this way; one that reached no
 *   barrier runs its threads as plain calls afterwards, and a barrier in
 *   such a launch aborts with the kernel's name.
 * - Launch configurations are checked as CUDA does (an empty grid, more than
 *   1024 threads a block: cudaErrorInvalidConfiguration from
 *   cudaGetLastError); cuBLAS GEMM arguments as cuBLAS does
 *   (CUBLAS_STATUS_INVALID_VALUE).
 * - cuBLAS's GEMM is OpenBLAS's cblas_sgemm, column-major: the same maths,
 *   not the same rounding as a GPU's.
 *
 * Devices: PSW_CUDA_EMU_DEVICES (default 1) of PSW_CUDA_EMU_MIB MiB each
 * (default 4096; cudaMalloc beyond it fails with cudaErrorMemoryAllocation).
 * A failing GPU: PSW_CUDA_EMU_FAIL=DEV:N makes the N-th kernel launch on
 * device DEV (counted from 1 in this process) fail as a kernel that faults
 * does: cudaErrorLaunchFailure from the next synchronisation, and from every
 * call after it (a CUDA context does not recover).
 * The driver: PSW_CUDA_EMU_DRIVER is its CUDA version as CUDA gives it
 * (12040 for 12.4; default: the runtime's, PSW_CUDA_EMU_RUNTIME, 12040); 0
 * emulates a machine without one. Without one, or with one older than the
 * runtime, cudaGetDeviceCount fails as CUDA's does
 * (cudaErrorInsufficientDriver).
 *
 * What it cannot check: real concurrency between streams and with the host,
 * the GPU's memory model, timing, and anything of the driver. */
#ifndef PSW_CUDA_EMU_RUNTIME_H
#define PSW_CUDA_EMU_RUNTIME_H

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

/* ---- types and constants ---- */

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorLaunchFailure = 719,
};

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
};

typedef struct psw_emu_stream *cudaStream_t;
typedef struct psw_emu_event *cudaEvent_t;

#define cudaStreamNonBlocking 0x01u
#define cudaEventDisableTiming 0x02u

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor;
};

/* ---- runtime API ---- */

cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorString(cudaError_t e);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);

/* ---- the emulator's side of kernels ---- */

namespace psw_emu {

/* The running kernel thread's coordinates. */
struct coords {
    uint3 tid, bid;
    dim3 bdim, gdim;
};
extern thread_local coords k;

void barrier(void);
/* lane `src` of the calling thread's warp (0-31) after every live thread
 * put its value: v as 8 bytes */
uint64_t exchange(uint64_t v, int src);
int lane(void);

/* Aborts with a message unless [p, p + bytes) lies in one device buffer
 * (want_device) or in no device buffer (!want_device). */
void check_ptr(const void *p, size_t bytes, bool want_device, const char *what, int arg);
/* Queues fn on s (a kernel of `name`, grid g, block b), or records
 * cudaErrorInvalidConfiguration for cudaGetLastError. */
void launch(const char *name, dim3 g, dim3 b, cudaStream_t s, std::function<void()> fn);

template <class... P>
struct launcher {
    void (*kernel)(P...);
    const char *name;
    dim3 g, b;
    cudaStream_t s;

    void operator()(P... args) const
    {
        int i = 0;
        /* every pointer argument must point into device memory (or be NULL) */
        (
            [&](const auto &a) {
                i++;
                if constexpr (std::is_pointer_v<std::decay_t<decltype(a)>>)
                    if (a) check_ptr(a, 1, true, name, i);
            }(args),
            ...);
        auto *kf = kernel;
        launch(name, g, b, s, [kf, args...]() { kf(args...); });
    }
};

template <class... P>
launcher<P...> make_launcher(void (*kernel)(P...), const char *name, dim3 g, dim3 b, cudaStream_t s)
{
    return launcher<P...>{kernel, name, g, b, s};
}

} // namespace psw_emu

#define PSW_LAUNCH(kernel, grid, block, stream) \
    psw_emu::make_launcher(kernel, #kernel, dim3(grid), dim3(block), (stream))

/* ---- the kernel language ---- */

#define __global__
#define __device__
#define __shared__ static /* blocks run one after another: one copy serves each in turn */
#define threadIdx (psw_emu::k.tid)
#define blockIdx (psw_emu::k.bid)
#define blockDim (psw_emu::k.bdim)
#define gridDim (psw_emu::k.gdim)

inline void __syncthreads(void) { psw_emu::barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu)
{
    (void)mask;
    psw_emu::barrier();
}

template <class T>
T psw_emu_shfl(T v, int src)
{
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "a shuffled value is at most 8 bytes");
    uint64_t in = 0, out;
    std::memcpy(&in, &v, sizeof v);
    out = psw_emu::exchange(in, src);
    T r;
    std::memcpy(&r, &out, sizeof r);
    return r;
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane)
{
    (void)mask;
    return psw_emu_shfl(v, src_lane & 31);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask)
{
    (void)mask;
    return psw_emu_shfl(v, (psw_emu::lane() ^ lane_mask) & 31);
}

/* compiled with -ffp-contract=off: a plain product or sum is not fused */
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

#endif
