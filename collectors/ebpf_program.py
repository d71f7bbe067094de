"""The BPF C text of the eBPF collector (compiled by bcc), with the probes it attaches.

Launches, graph launches and copies are counted where they enter the driver, with entry
probes only (a uprobe is a trap; a return probe is a second one): the runtime's calls
(cudaLaunchKernel) reach the driver's (cuLaunchKernel), so each is counted once. The
optional runtime group counts at the runtime's entry instead and marks the thread so the
driver does not count that call again. Synchronisation is timed at the outermost call per
thread (runtime or driver). Wait times and launch call times go to in-kernel log2
histograms (bcc's `bpf_log2l` slots) with a sum beside them; maps are read, never cleared
(an exited process's entries are deleted by pid).
"""
from __future__ import annotations

# x86-64 SysV: arguments 1-6 in registers, the 7th and later on the stack above the
# return address at function entry: argument n (n > 6) at sp + 8 * (n - 6).
PROGRAM = r"""
#include <uapi/linux/ptrace.h>

struct launch_key { u32 pid; u32 pad; u64 stream; };
struct kind_key { u32 pid; u32 kind; };
struct slot_key { u32 pid; u32 kind; u64 slot; };
struct call { u64 ts; u32 depth; u32 kind; };

BPF_HASH(launches, struct launch_key, u64, 65536);
BPF_HASH(graphs, u32, u64, 16384);
BPF_HASH(copied, struct kind_key, u64, 16384);
BPF_HASH(wait_slots, struct slot_key, u64, 65536);
BPF_HASH(wait_sums, struct kind_key, u64, 16384);
BPF_HASH(launch_slots, struct slot_key, u64, 65536);
BPF_HASH(launch_sums, struct kind_key, u64, 16384);
BPF_HASH(in_runtime, u64, u32, 65536);      /* per thread: runtime launch/copy in flight */
BPF_HASH(launch_started, u64, u64, 65536);  /* per thread: driver launch entry time */
BPF_HASH(waiting, u64, struct call, 65536); /* per thread: the outermost sync */

static __always_inline u64 stack_arg(struct pt_regs *ctx, int n) {
    u64 value = 0;
    bpf_probe_read_user(&value, sizeof(value), (void *)(PT_REGS_SP(ctx) + 8 * (n - 6)));
    return value;
}

static __always_inline u64 field_at(void *base, int offset) {
    u64 value = 0;
    bpf_probe_read_user(&value, sizeof(value), base + offset);
    return value;
}

/* A launch or copy is counted where it enters the driver, with an entry probe only (the
   cheap kind). With the runtime group on, the runtime's own entry counts it and marks the
   thread, and the driver call inside is not counted again. */
static __always_inline void count_launch(u64 stream, u32 graph) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (graph) {
        graphs.increment(pid);
    } else {
        struct launch_key key = {.pid = pid, .stream = stream};
        launches.increment(key);
    }
}

static __always_inline void count_copy(u64 bytes, u32 direction) {
    struct kind_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .kind = direction};
    copied.increment(key, bytes);
}

static __always_inline int driver_launch(u64 stream, u32 graph) {
    u64 tid = bpf_get_current_pid_tgid();
    if (!in_runtime.lookup(&tid))
        count_launch(stream, graph);
#ifdef LAUNCH_LATENCY
    u64 now = bpf_ktime_get_ns();
    launch_started.update(&tid, &now);
#endif
    return 0;
}

static __always_inline int driver_copy(u64 bytes, u32 direction) {
    u64 tid = bpf_get_current_pid_tgid();
    if (!in_runtime.lookup(&tid))
        count_copy(bytes, direction);
    return 0;
}

static __always_inline void enter_runtime(void) {
    u64 tid = bpf_get_current_pid_tgid();
    u32 one = 1;
    in_runtime.update(&tid, &one);
}

static __always_inline int enter_wait(u32 api) {
    u64 tid = bpf_get_current_pid_tgid();
    struct call *inflight = waiting.lookup(&tid);
    if (inflight) {            /* the runtime calling the driver: timed once, outermost */
        inflight->depth += 1;
        return 0;
    }
    struct call now = {.ts = bpf_ktime_get_ns(), .depth = 1, .kind = api};
    waiting.update(&tid, &now);
    return 0;
}

static __always_inline int leave_wait(void) {
    u64 tid = bpf_get_current_pid_tgid();
    struct call *inflight = waiting.lookup(&tid);
    if (!inflight)
        return 0;
    if (inflight->depth > 1) {
        inflight->depth -= 1;
        return 0;
    }
    u64 delta = bpf_ktime_get_ns() - inflight->ts;
    struct slot_key slot = {.pid = tid >> 32, .kind = inflight->kind, .slot = bpf_log2l(delta)};
    struct kind_key sum = {.pid = tid >> 32, .kind = inflight->kind};
    waiting.delete(&tid);
    wait_slots.increment(slot);
    wait_sums.increment(sum, delta);
    return 0;
}

/* Driver launches: the stream handle is where each API keeps it. */
int cu_launch(struct pt_regs *ctx) { return driver_launch(stack_arg(ctx, 9), 0); }
int cu_launch_ex(struct pt_regs *ctx) {
    return driver_launch(field_at((void *)PT_REGS_PARM1(ctx), 32), 0);
}
int cu_graph_launch(struct pt_regs *ctx) { return driver_launch(PT_REGS_PARM2(ctx), 1); }
int launch_return(struct pt_regs *ctx) {      /* launch_latency: time inside the call */
    u64 tid = bpf_get_current_pid_tgid();
    u64 *started = launch_started.lookup(&tid);
    if (!started)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *started;
    launch_started.delete(&tid);
    struct slot_key slot = {.pid = tid >> 32, .kind = 0, .slot = bpf_log2l(delta)};
    struct kind_key sum = {.pid = tid >> 32, .kind = 0};
    launch_slots.increment(slot);
    launch_sums.increment(sum, delta);
    return 0;
}

/* Runtime launches (the runtime group): counted here, not again in the driver. */
int cuda_launch(struct pt_regs *ctx) {
    enter_runtime();
    count_launch(stack_arg(ctx, 8), 0);
    return 0;
}
int cuda_launch_ex(struct pt_regs *ctx) {
    enter_runtime();
    count_launch(field_at((void *)PT_REGS_PARM1(ctx), 32), 0);
    return 0;
}
int cuda_graph_launch(struct pt_regs *ctx) { enter_runtime(); count_launch(0, 1); return 0; }
int cuda_copy(struct pt_regs *ctx) {
    u64 kind = PT_REGS_PARM4(ctx);
    enter_runtime();
    count_copy(PT_REGS_PARM3(ctx), kind <= 4 ? (u32)kind : 4);
    return 0;
}
int runtime_return(struct pt_regs *ctx) {
    u64 tid = bpf_get_current_pid_tgid();
    in_runtime.delete(&tid);
    return 0;
}

/* Synchronisation: one entry probe per API (its id), one shared return probe. */
int wait_cu_stream(struct pt_regs *ctx) { return enter_wait(0); }
int wait_cu_event(struct pt_regs *ctx) { return enter_wait(1); }
int wait_cu_ctx(struct pt_regs *ctx) { return enter_wait(2); }
int wait_cuda_stream(struct pt_regs *ctx) { return enter_wait(3); }
int wait_cuda_event(struct pt_regs *ctx) { return enter_wait(4); }
int wait_cuda_device(struct pt_regs *ctx) { return enter_wait(5); }
int wait_return(struct pt_regs *ctx) { return leave_wait(); }

/* Driver copies: the byte count is the third argument everywhere. The runtime's
   cudaMemcpyKind is its fourth (0 HtoH, 1 HtoD, 2 DtoH, 3 DtoD, 4 default). */
int copy_htod(struct pt_regs *ctx) { return driver_copy(PT_REGS_PARM3(ctx), 1); }
int copy_dtoh(struct pt_regs *ctx) { return driver_copy(PT_REGS_PARM3(ctx), 2); }
int copy_dtod(struct pt_regs *ctx) { return driver_copy(PT_REGS_PARM3(ctx), 3); }
int copy_any(struct pt_regs *ctx) { return driver_copy(PT_REGS_PARM3(ctx), 4); }
"""

WAIT_APIS = ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize",
             "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
DIRECTIONS = ("htoh", "htod", "dtoh", "dtod", "default")

# probe group -> [(library, symbol, entry function or None, return function or None)]
PROBES: dict[str, list[tuple[str, str, str | None, str | None]]] = {
    "launch": [
        ("cuda", "cuLaunchKernel", "cu_launch", None),
        ("cuda", "cuLaunchKernel_ptsz", "cu_launch", None),
        ("cuda", "cuLaunchKernelEx", "cu_launch_ex", None),
        ("cuda", "cuLaunchKernelEx_ptsz", "cu_launch_ex", None),
    ],
    "graph": [
        ("cuda", "cuGraphLaunch", "cu_graph_launch", None),
        ("cuda", "cuGraphLaunch_ptsz", "cu_graph_launch", None),
    ],
    "sync": [
        ("cuda", "cuStreamSynchronize", "wait_cu_stream", "wait_return"),
        ("cuda", "cuEventSynchronize", "wait_cu_event", "wait_return"),
        ("cuda", "cuCtxSynchronize", "wait_cu_ctx", "wait_return"),
        ("cudart", "cudaStreamSynchronize", "wait_cuda_stream", "wait_return"),
        ("cudart", "cudaEventSynchronize", "wait_cuda_event", "wait_return"),
        ("cudart", "cudaDeviceSynchronize", "wait_cuda_device", "wait_return"),
    ],
    "memcpy": [
        ("cuda", "cuMemcpyHtoD_v2", "copy_htod", None),
        ("cuda", "cuMemcpyHtoDAsync_v2", "copy_htod", None),
        ("cuda", "cuMemcpyDtoH_v2", "copy_dtoh", None),
        ("cuda", "cuMemcpyDtoHAsync_v2", "copy_dtoh", None),
        ("cuda", "cuMemcpyDtoD_v2", "copy_dtod", None),
        ("cuda", "cuMemcpyDtoDAsync_v2", "copy_dtod", None),
        ("cuda", "cuMemcpy", "copy_any", None),
        ("cuda", "cuMemcpyAsync", "copy_any", None),
    ],
    # Return probes on the driver's launches: time inside the call (costs a second trap).
    "launch_latency": [
        ("cuda", symbol, None, "launch_return")
        for symbol in ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx",
                       "cuLaunchKernelEx_ptsz", "cuGraphLaunch", "cuGraphLaunch_ptsz")
    ],
    # The runtime's own entry points, for runtimes that reach the driver some other way
    # than its exported symbols; the driver then does not count their calls again.
    "runtime": [
        ("cudart", symbol, entry, "runtime_return") for symbol, entry in (
            ("cudaLaunchKernel", "cuda_launch"), ("cudaLaunchKernel_ptsz", "cuda_launch"),
            ("cudaLaunchKernelExC", "cuda_launch_ex"),
            ("cudaLaunchKernelExC_ptsz", "cuda_launch_ex"),
            ("cudaGraphLaunch", "cuda_graph_launch"),
            ("cudaGraphLaunch_ptsz", "cuda_graph_launch"),
            ("cudaMemcpy", "cuda_copy"), ("cudaMemcpyAsync", "cuda_copy"))
    ],
}
LATENCY_GROUP = "launch_latency"
GROUPS = tuple(PROBES)
# Entry probes only by default: a uprobe costs a trap per call (measured by
# bench/ebpf_overhead.py); time inside launch calls (a second trap) is asked for.
DEFAULT_GROUPS = ("launch", "graph", "sync", "memcpy")
