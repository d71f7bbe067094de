/* Drives a known pattern of CUDA calls through the stand-in libraries, for the eBPF
 * collector's tests and overhead bench. Reads commands from stdin, one per line:
 *   round K     per stream 0x1000, 0x2000, 0x3000 (times K): K runtime launches, K driver
 *               launches and K runtime "Ex" launches; K graph launches; K copies of
 *               1000 bytes host to device, K of 4096 device to host, K of 777 device to
 *               device; one stream sync of 3.1 ms, one event sync of 0.38 ms, one device
 *               sync of 24 ms. Prints "done".
 *   bench N     N cuLaunchKernel calls, prints the ns per call.
 *   exit
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef struct { unsigned x, y, z; } dim3;
typedef struct {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    void *stream;
    void *attrs;
    unsigned numAttrs;
} cudaLaunchConfig_t;

int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   void *, void **, void **);
int cuEventSynchronize(void *);
int cuMemcpyDtoDAsync_v2(uint64_t, uint64_t, size_t, void *);
void standin_set_ctx_sync_us(unsigned long);
int cudaLaunchKernel(const void *, dim3, dim3, void **, size_t, void *);
int cudaLaunchKernelExC(const cudaLaunchConfig_t *, const void *, void **);
int cudaGraphLaunch(void *, void *);
int cudaStreamSynchronize(void *);
int cudaDeviceSynchronize(void);
int cudaMemcpy(void *, const void *, size_t, int);
int cudaMemcpyAsync(void *, const void *, size_t, int, void *);

static char buffer[8192];

static void round_of(int k) {
    dim3 grid = {4, 1, 1}, block = {128, 1, 1};
    for (uintptr_t s = 0x1000; s <= 0x3000; s += 0x1000) {
        for (int i = 0; i < k * (int)(s >> 12); i++) {
            cudaLaunchKernel((void *)1, grid, block, NULL, 0, (void *)s);
            cuLaunchKernel((void *)1, 4, 1, 1, 128, 1, 1, 0, (void *)s, NULL, NULL);
            cudaLaunchConfig_t config = {grid, block, 0, (void *)s, NULL, 0};
            cudaLaunchKernelExC(&config, (void *)1, NULL);
        }
    }
    for (int i = 0; i < k; i++) {
        cudaGraphLaunch((void *)7, (void *)0x1000);
        cudaMemcpyAsync((void *)0x10, buffer, 1000, 1, (void *)0x1000);
        cudaMemcpy(buffer, (void *)0x10, 4096, 2);
        cuMemcpyDtoDAsync_v2(0x10, 0x20, 777, (void *)0x2000);
    }
    cudaStreamSynchronize((void *)(0x100000 | 3100));
    cuEventSynchronize((void *)(0x200000 | 380));
    standin_set_ctx_sync_us(24000);
    cudaDeviceSynchronize();
}

int main(void) {
    char line[128];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        long n = 0;
        if (sscanf(line, "round %ld", &n) == 1) {
            round_of((int)n);
            printf("done\n");
        } else if (sscanf(line, "bench %ld", &n) == 1) {
            struct timespec a, b;
            clock_gettime(CLOCK_MONOTONIC, &a);
            for (long i = 0; i < n; i++)
                cuLaunchKernel((void *)1, 4, 1, 1, 128, 1, 1, 0, (void *)0x1000, NULL, NULL);
            clock_gettime(CLOCK_MONOTONIC, &b);
            printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
        } else if (strncmp(line, "exit", 4) == 0) {
            break;
        }
    }
    return 0;
}
