// CUDA-event timing shared by the GPU benchmark drivers: an event pair, the common-start timing of an op on every
// virtual rank's stream, graph-replay timing of a single-stream op,
// and the device-to-device copy bandwidth every data-plane figure is set beside (design §9).
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

#include "internal/api.hpp"
#include "timing.hpp"

namespace flatep::bench {

// Two timing events on one stream: record(start), work, record(stop), elapsed_us() (waits for stop).
class EventPair {
  public:
    EventPair() {
        FLATEP_CUDA_CHECK(cudaEventCreate(&start_));
        FLATEP_CUDA_CHECK(cudaEventCreate(&stop_));
    }
    ~EventPair() {
        cudaEventDestroy(start_);
        cudaEventDestroy(stop_);
    }
    EventPair(const EventPair&) = delete;
    EventPair& operator=(const EventPair&) = delete;
    void start(cudaStream_t s) { FLATEP_CUDA_CHECK(cudaEventRecord(start_, s)); }
    void stop(cudaStream_t s) { FLATEP_CUDA_CHECK(cudaEventRecord(stop_, s)); }
    float elapsed_us() {
        FLATEP_CUDA_CHECK(cudaEventSynchronize(stop_));
        float ms = 0;
        FLATEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
        return ms * 1000.f;
    }

  private:
    cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Every other rank's stream of `group` waits for rank 0's work so far (fork), and rank 0's for every other rank's
// (join: one event per rank).
template <class Group>
void fork_ranks(Group& group, cudaEvent_t fork) {
    FLATEP_CUDA_CHECK(cudaEventRecord(fork, group.stream(0)));
    for (int r = 1; r < group.num_ranks(); ++r) FLATEP_CUDA_CHECK(cudaStreamWaitEvent(group.stream(r), fork));
}
template <class Group>
void join_ranks(Group& group, std::vector<cudaEvent_t>& join) {
    for (int r = 1; r < group.num_ranks(); ++r) {
        FLATEP_CUDA_CHECK(cudaEventRecord(join[size_t(r)], group.stream(r)));
        FLATEP_CUDA_CHECK(cudaStreamWaitEvent(group.stream(0), join[size_t(r)]));
    }
}

// Time of `op`, which enqueues work on every rank's stream of `group` (R virtual ranks on one GPU: num_ranks(),
// stream(r), synchronize()), from a common start to the end of the last rank's work; median / min over iters after
// warmup. The other ranks' streams wait for rank 0's start event, rank 0's stream for every rank's end.
template <class Group>
Timing time_ranks(Group& group, int iters, int warmup, const std::function<void()>& op) {
    const int R = group.num_ranks();
    cudaStream_t s0 = group.stream(0);
    EventPair ev;
    cudaEvent_t fork;
    std::vector<cudaEvent_t> join(static_cast<size_t>(R));
    FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    for (int r = 0; r < R; ++r) FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(join.data() + r, cudaEventDisableTiming));
    std::vector<float> times;
    for (int it = 0; it < warmup + iters; ++it) {
        group.synchronize();
        ev.start(s0);
        fork_ranks(group, fork);
        op();
        join_ranks(group, join);
        ev.stop(s0);
        const float us = ev.elapsed_us();
        if (it >= warmup) times.push_back(us);
    }
    cudaEventDestroy(fork);
    for (cudaEvent_t e : join) cudaEventDestroy(e);
    return summarize(times);
}

// Device time of a single-stream op without host launch latency: `batch` launches of op captured in one CUDA graph,
// the graph replayed warmup + iters times; per-op time = replay time / batch (gaps between kernels included).
inline Timing time_graph(cudaStream_t stream, int iters, int warmup, int batch, const std::function<void()>& op) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    FLATEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < batch; ++i) op();
    FLATEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FLATEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    EventPair ev;
    std::vector<float> us;
    for (int it = 0; it < warmup + iters; ++it) {
        ev.start(stream);
        FLATEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        ev.stop(stream);
        const float t = ev.elapsed_us();
        if (it >= warmup) us.push_back(t / float(batch));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return summarize(us);
}

// The same op on every rank's stream, without the host's launch time: one host thread enqueueing R ranks' kernels
// one after the other (time_ranks) makes every rank's first barrier wait for the last rank's launches, which one
// process per GPU never does. `batch` calls of op, each with every rank's stream forked from and joined back into rank
// 0's, are captured in one CUDA graph and replayed as time_graph does. Call the op eagerly first (scratch buffers grow
// outside a capture).
template <class Group>
Timing time_ranks_graph(Group& group, int iters, int warmup, int batch, const std::function<void()>& op) {
    cudaEvent_t fork;
    std::vector<cudaEvent_t> join(static_cast<size_t>(group.num_ranks()));
    FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    for (cudaEvent_t& e : join) FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    group.synchronize();
    const Timing t = time_graph(group.stream(0), iters, warmup, batch, [&] {
        fork_ranks(group, fork);
        op();
        join_ranks(group, join);
    });
    cudaEventDestroy(fork);
    for (cudaEvent_t e : join) cudaEventDestroy(e);
    return t;
}

// Device-to-device copy bandwidth (GB/s, bytes read + written), median of `iters` cudaMemcpyAsync of `bytes` after
// two untimed ones. The source is filled with a non-zero pattern first.
inline double copy_bandwidth_gbps(int iters, size_t bytes = size_t(4) << 30) {
    void *a = nullptr, *b = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&a, bytes));
    FLATEP_CUDA_CHECK(cudaMalloc(&b, bytes));
    FLATEP_CUDA_CHECK(cudaMemset(a, 0x5a, bytes));
    EventPair ev;
    std::vector<float> us;
    for (int it = 0; it < iters + 2; ++it) {
        ev.start(nullptr);
        FLATEP_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
        ev.stop(nullptr);
        const float t = ev.elapsed_us();
        if (it >= 2) us.push_back(t);
    }
    cudaFree(a);
    cudaFree(b);
    return 2.0 * double(bytes) / (double(median(us)) * 1e-6) / 1e9;
}

}  // namespace flatep::bench
