/* A stand-in libcudart.so for tests: the runtime's exported names and calling
 * conventions, each calling the driver (the stand-in libcuda.so.1) as the real runtime
 * does, so a probe on both must count every call once. */
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef struct { unsigned x, y, z; } dim3;
typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void *hStream;
    void *attrs;
    unsigned numAttrs;
} CUlaunchConfig;
typedef struct {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    void *stream;
    void *attrs;
    unsigned numAttrs;
} cudaLaunchConfig_t;

CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, void *, void **, void **);
CUresult cuGraphLaunch(void *, void *);
CUresult cuStreamSynchronize(void *);
CUresult cuEventSynchronize(void *);
CUresult cuCtxSynchronize(void);
CUresult cuMemcpyHtoD_v2(uint64_t, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, uint64_t, size_t);
CUresult cuMemcpyDtoD_v2(uint64_t, uint64_t, size_t);
CUresult cuMemcpy(uint64_t, uint64_t, size_t);
CUresult cuMemcpyHtoDAsync_v2(uint64_t, const void *, size_t, void *);
CUresult cuMemcpyDtoHAsync_v2(void *, uint64_t, size_t, void *);
CUresult cuMemcpyDtoDAsync_v2(uint64_t, uint64_t, size_t, void *);
CUresult cuMemcpyAsync(uint64_t, uint64_t, size_t, void *);

int cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t shared,
                     void *stream) {
    return cuLaunchKernel((void *)func, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                          (unsigned)shared, stream, args, NULL);
}
int cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args) {
    CUlaunchConfig c = {config->gridDim.x, config->gridDim.y, config->gridDim.z,
                        config->blockDim.x, config->blockDim.y, config->blockDim.z,
                        (unsigned)config->dynamicSmemBytes, config->stream, NULL, 0};
    return cuLaunchKernelEx(&c, (void *)func, args, NULL);
}
int cudaGraphLaunch(void *exec, void *stream) { return cuGraphLaunch(exec, stream); }
int cudaStreamSynchronize(void *stream) { return cuStreamSynchronize(stream); }
int cudaEventSynchronize(void *event) { return cuEventSynchronize(event); }
int cudaDeviceSynchronize(void) { return cuCtxSynchronize(); }

/* cudaMemcpyKind: 0 host to host, 1 host to device, 2 device to host, 3 device to device,
   4 default (inferred). */
int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
    switch (kind) {
    case 1: return cuMemcpyHtoD_v2((uintptr_t)dst, src, n);
    case 2: return cuMemcpyDtoH_v2(dst, (uintptr_t)src, n);
    case 3: return cuMemcpyDtoD_v2((uintptr_t)dst, (uintptr_t)src, n);
    default: return cuMemcpy((uintptr_t)dst, (uintptr_t)src, n);
    }
}
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    switch (kind) {
    case 1: return cuMemcpyHtoDAsync_v2((uintptr_t)dst, src, n, stream);
    case 2: return cuMemcpyDtoHAsync_v2(dst, (uintptr_t)src, n, stream);
    case 3: return cuMemcpyDtoDAsync_v2((uintptr_t)dst, (uintptr_t)src, n, stream);
    default: return cuMemcpyAsync((uintptr_t)dst, (uintptr_t)src, n, stream);
    }
}
