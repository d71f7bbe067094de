/* A stand-in libnvidia-ml.so.1 for machines without a GPU: only the NVML calls the
 * ac-observe NVML collector makes, returning fixed, known values through the real
 * struct layouts, so the real pynvml binding and the collector's error paths run.
 * GPU 0: GPM supported, one compute process (pid 4242, or the pids listed in
 * $AC_NVML_STANDIN_PIDS, comma-separated, at most 8), each with process utilisation samples
 * (SM 30+i %, memory 20+i %, encoder i %, decoder 2i % for the i-th).
 * GPU 1: no power reading (NOT_SUPPORTED), no GPM, no process utilisation, two XID
 * events pending (codes 79 and 48), MIG mode on with two MIG devices (GPU instance 1 and
 * 2, compute instance 0 each) and one process, pid 4343 (or $AC_NVML_STANDIN_MIG_PID),
 * in GPU instance 2, 256 MiB. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
enum { OK = 0, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, NOT_FOUND = 6, INSUFFICIENT_SIZE = 7,
       TIMEOUT = 10 };

typedef struct { int index; } device_t;
/* 0, 1: the GPUs; 2, 3: GPU 1's MIG devices (GPU instances 1 and 2). */
static device_t devices[4] = {{0}, {1}, {2}, {3}};
static int event_set_token;
static int xid_pending = 2;

typedef struct { unsigned int gpu, memory; } utilization_t;
typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned int version; unsigned int sensorType; int temperature; } temperature_v1_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory;
                 unsigned int gpuInstanceId, computeInstanceId; } process_info_t;
typedef struct { device_t *device; unsigned long long eventType, eventData;
                 unsigned int gpuInstanceId, computeInstanceId; } event_data_t;
typedef struct { unsigned int version, isSupportedDevice; } gpm_support_t;
typedef struct { char *shortName, *longName, *unit; } metric_info_t;
typedef struct { unsigned int metricId; nvmlReturn_t nvmlReturn; double value;
                 metric_info_t metricInfo; } gpm_metric_t;
typedef struct { unsigned int version, numMetrics; void *sample1, *sample2;
                 gpm_metric_t metrics[477]; } gpm_metrics_get_t;

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return OK; }
nvmlReturn_t nvmlInit_v2(void) { return OK; }
nvmlReturn_t nvmlShutdown(void) { return OK; }
const char *nvmlErrorString(nvmlReturn_t r) { (void)r; return "stand-in NVML error"; }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { *count = 2; return OK; }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, device_t **device) {
    if (index > 1) return INVALID_ARGUMENT;
    *device = &devices[index];
    return OK;
}

nvmlReturn_t nvmlDeviceGetUUID(device_t *d, char *uuid, unsigned int length) {
    const char *ids[4] = {"GPU-11111111-2222-3333-4444-000000000000",
                          "GPU-11111111-2222-3333-4444-000000000001",
                          "MIG-aaaaaaaa-bbbb-cccc-dddd-000000000001",
                          "MIG-aaaaaaaa-bbbb-cccc-dddd-000000000002"};
    if (length < 41) return INSUFFICIENT_SIZE;
    strcpy(uuid, ids[d->index]);
    return OK;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(device_t *d, utilization_t *u) {
    u->gpu = d->index == 0 ? 37 : 91;
    u->memory = 20;
    return OK;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(device_t *d, memory_t *m) {
    m->total = 80ULL << 30;
    m->used = d->index == 0 ? 1ULL << 30 : 40ULL << 30;
    m->free = m->total - m->used;
    return OK;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(device_t *d, unsigned int *milliwatts) {
    if (d->index == 1) return NOT_SUPPORTED;
    *milliwatts = 123456;
    return OK;
}

nvmlReturn_t nvmlDeviceGetTemperatureV(device_t *d, temperature_v1_t *t) {
    if (t->version != 0x100000C || t->sensorType != 0) return INVALID_ARGUMENT;
    t->temperature = d->index == 0 ? 61 : 72;
    return OK;
}

nvmlReturn_t nvmlDeviceGetClockInfo(device_t *d, unsigned int type, unsigned int *mhz) {
    if (type != 1) return NOT_SUPPORTED; /* only the SM clock */
    *mhz = d->index == 0 ? 1410 : 1980;
    return OK;
}

/* The compute processes on GPU 0: 4242, or those $AC_NVML_STANDIN_PIDS lists. */
static unsigned int standin_pids(unsigned int *pids) {
    const char *listed = getenv("AC_NVML_STANDIN_PIDS");
    unsigned int n = 0;
    if (listed == NULL || *listed == 0) { pids[0] = 4242; return 1; }
    while (*listed && n < 8) {
        char *end;
        unsigned long pid = strtoul(listed, &end, 10);
        if (end == listed) break;
        pids[n++] = (unsigned int)pid;
        listed = *end == ',' ? end + 1 : end;
    }
    return n;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(device_t *d, unsigned int *count,
                                                     process_info_t *infos) {
    unsigned int pids[8];
    unsigned int have = d->index == 0 ? standin_pids(pids) : d->index == 1 ? 1 : 0;
    if (have == 0) { *count = 0; return OK; }
    if (d->index == 1) { /* MIG: one process in GPU instance 2 */
        const char *mig_pid = getenv("AC_NVML_STANDIN_MIG_PID");
        if (infos == NULL || *count < 1) { *count = 1; return INSUFFICIENT_SIZE; }
        memset(infos, 0, sizeof(process_info_t));
        infos[0].pid = mig_pid && *mig_pid ? (unsigned int)strtoul(mig_pid, NULL, 10) : 4343;
        infos[0].usedGpuMemory = 256ULL << 20;
        infos[0].gpuInstanceId = 2;
        infos[0].computeInstanceId = 0;
        *count = 1;
        return OK;
    }
    if (infos == NULL || *count < have) { *count = have; return INSUFFICIENT_SIZE; }
    memset(infos, 0, sizeof(process_info_t) * have);
    for (unsigned int i = 0; i < have; i++) {
        infos[i].pid = pids[i];
        infos[i].usedGpuMemory = 512ULL << 20;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFF; /* not MIG */
    }
    *count = have;
    return OK;
}

typedef struct { unsigned int pid; unsigned long long timeStamp;
                 unsigned int smUtil, memUtil, encUtil, decUtil; } process_sample_t;

/* As NVML: the samples newer than `since` (each call samples anew: later timeStamps),
   NOT_FOUND when there are none. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(device_t *d, process_sample_t *samples,
                                             unsigned int *count, unsigned long long since) {
    static unsigned long long sampled_at = 1000000ULL;
    unsigned int pids[8];
    unsigned int have;
    if (d->index != 0) return NOT_SUPPORTED;
    have = standin_pids(pids);
    if (samples == NULL || *count < have) { *count = have; return INSUFFICIENT_SIZE; }
    sampled_at += 1000;
    if (sampled_at <= since) return NOT_FOUND;
    for (unsigned int i = 0; i < have; i++) {
        samples[i].pid = pids[i];
        samples[i].timeStamp = sampled_at + i;
        samples[i].smUtil = 30 + i;
        samples[i].memUtil = 20 + i;
        samples[i].encUtil = i;
        samples[i].decUtil = 2 * i;
    }
    *count = have;
    return OK;
}

nvmlReturn_t nvmlEventSetCreate(void **set) { *set = &event_set_token; return OK; }
nvmlReturn_t nvmlEventSetFree(void *set) { (void)set; return OK; }

nvmlReturn_t nvmlDeviceRegisterEvents(device_t *d, unsigned long long types, void *set) {
    (void)d; (void)set;
    return (types & 0x8ULL) ? OK : NOT_SUPPORTED;
}

nvmlReturn_t nvmlEventSetWait_v2(void *set, event_data_t *data, unsigned int timeout_ms) {
    (void)set; (void)timeout_ms;
    if (xid_pending == 0) return TIMEOUT;
    memset(data, 0, sizeof(*data));
    data->device = &devices[1];
    data->eventType = 0x8ULL;
    data->eventData = xid_pending == 2 ? 79 : 48;
    xid_pending--;
    return OK;
}

nvmlReturn_t nvmlGpmQueryDeviceSupport(device_t *d, gpm_support_t *s) {
    if (s->version != 1) return INVALID_ARGUMENT;
    s->isSupportedDevice = d->index == 0;
    return OK;
}

nvmlReturn_t nvmlGpmSampleAlloc(void **sample) {
    *sample = calloc(1, sizeof(struct timespec));
    return *sample ? OK : INVALID_ARGUMENT;
}

nvmlReturn_t nvmlGpmSampleFree(void *sample) { free(sample); return OK; }

nvmlReturn_t nvmlGpmSampleGet(device_t *d, void *sample) {
    if (d->index != 0 || sample == NULL) return NOT_SUPPORTED;
    clock_gettime(CLOCK_MONOTONIC, (struct timespec *)sample);
    return OK;
}

nvmlReturn_t nvmlGpmMetricsGet(gpm_metrics_get_t *get) {
    if (get->version != 1 || !get->sample1 || !get->sample2 || get->numMetrics > 477)
        return INVALID_ARGUMENT;
    struct timespec *a = get->sample1, *b = get->sample2;
    double gap = (b->tv_sec - a->tv_sec) + (b->tv_nsec - a->tv_nsec) / 1e9;
    for (unsigned int i = 0; i < get->numMetrics; i++) {
        gpm_metric_t *m = &get->metrics[i];
        m->nvmlReturn = OK;
        switch (m->metricId) {
            case 3: m->value = 45.5; break;   /* SM occupancy */
            case 2: m->value = 80.25; break;  /* SM util */
            case 5: m->value = 12.5; break;   /* any tensor */
            case 10: m->value = 33.0; break;  /* DRAM bandwidth */
            default: m->nvmlReturn = NOT_SUPPORTED;
        }
        if (gap < 0.1) m->nvmlReturn = INVALID_ARGUMENT; /* NVML wants samples >= 100 ms apart */
    }
    return OK;
}

nvmlReturn_t nvmlDeviceGetMigMode(device_t *d, unsigned int *current, unsigned int *pending) {
    if (d->index > 1) return INVALID_ARGUMENT;
    *current = *pending = d->index == 1;
    return OK;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(device_t *d, unsigned int *count) {
    *count = d->index == 1 ? 7 : 0; /* as an A100 or H100: up to 7, here 2 made */
    return OK;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(device_t *d, unsigned int index,
                                                 device_t **mig) {
    if (d->index != 1) return INVALID_ARGUMENT;
    if (index > 1) return 6; /* NVML_ERROR_NOT_FOUND: a slot with no MIG device */
    *mig = &devices[2 + index];
    return OK;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(device_t *d, unsigned int *id) {
    if (d->index < 2) return INVALID_ARGUMENT;
    *id = d->index - 1; /* 1, 2 */
    return OK;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(device_t *d, unsigned int *id) {
    if (d->index < 2) return INVALID_ARGUMENT;
    *id = 0;
    return OK;
}
