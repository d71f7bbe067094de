/* A stand-in libcuda.so.1 for tests on machines without a GPU: the real driver's exported
 * names and calling conventions, doing nothing but what a test can check. The eBPF
 * collector probes it exactly as it probes the real one.
 * Synchronisation waits as long as its argument says: a stream's or an event's handle
 * carries the microseconds to wait in its low 20 bits; cuCtxSynchronize waits what
 * standin_set_ctx_sync_us() set. */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef int CUresult;
typedef void *CUstream, *CUfunction, *CUevent, *CUgraphExec;
typedef uint64_t CUdeviceptr;
typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned numAttrs;
} CUlaunchConfig;

static volatile uintptr_t sink;  /* keeps calls from being optimised away */
static unsigned long ctx_sync_us;

static void wait_us(unsigned long us) {
    struct timespec t = {us / 1000000, (long)(us % 1000000) * 1000};
    nanosleep(&t, NULL);
}

void standin_set_ctx_sync_us(unsigned long us) { ctx_sync_us = us; }

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, CUstream stream,
                        void **params, void **extra) {
    sink += (uintptr_t)stream + gx + bx + shared;
    return 0;
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                          void **extra) {
    sink += (uintptr_t)config->hStream;
    return 0;
}
CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) { sink += (uintptr_t)stream; return 0; }
CUresult cuStreamSynchronize(CUstream stream) { wait_us((uintptr_t)stream & 0xfffff); return 0; }
CUresult cuEventSynchronize(CUevent event) { wait_us((uintptr_t)event & 0xfffff); return 0; }
CUresult cuCtxSynchronize(void) { wait_us(ctx_sync_us); return 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { sink += n; return 0; }
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { sink += n; return 0; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { sink += n; return 0; }
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { sink += n; return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    sink += n;
    return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    sink += n;
    return 0;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    sink += n;
    return 0;
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    sink += n;
    return 0;
}
