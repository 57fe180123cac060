// A whole training step through the C++ API (flatep::Buffer and flatep::ExpertPools, not raw kernel launches),
// captured as one CUDA graph per rank under cudaStreamCaptureModeGlobal (any cudaMalloc / cudaFree, synchronising
// copy or device synchronisation inside an op fails the capture), then replayed with new tokens, routing weights and
// routing at different skews written into the static inputs: every output must be bitwise that of the same step
// run eagerly. R processes share GPU 0 over the ipc transport.
//
// The step: plan (into caller storage) -> dispatch -> prefetch -> a toy expert (per receive row of group g:
// y = x * W[g], elementwise, W the compute view [2*epn][H] of one projection) -> weighted combine; backward with the
// loss 0.5 * |out|^2 (grad_out = out): dispatch of grad_out -> combine_grad -> the expert's backward (row gradients,
// and per group the fp32 sum over its rows of grad_y * x) -> write_grads (accumulating, as nn.MoE does) ->
// reduce_grad -> unweighted combine of the row gradients (dispatch's backward) -> entry_values (the routing
// weights' gradient). Checked per trial: out, grad_x, grad_topk_weights, the own gradients (main_grad), cu_seqlens.
//
//   step_graph_gpu_main [R ...]     (default: 2 4)
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "device_test_util.hpp"
#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"
#include "kernels/common/groups.cuh"
#include "layout/layout.hpp"
#include "routing/routing.hpp"

namespace {

using namespace flatep;
using gpu_test::from_device;
using gpu_test::to_device;

constexpr int kS = 256, kH = 512, kK = 4, kExpertsPerRank = 8, kAlign = 16, kTrials = 20;
constexpr double kSigmas[] = {0.0, 0.7, 1.4, 2.2};

__device__ float bf(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
__device__ uint16_t to_bf(float f) {  // round to nearest even (finite inputs)
    const uint32_t u = __float_as_uint(f);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// y[r][h] = bf16(x[r][h] * W[g][h]) inside the groups, 0 past the last group end.
__global__ void expert_forward(const int32_t* cu, int G, int rows, const uint16_t* x, const uint16_t* w, uint16_t* y) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < int64_t(rows) * kH;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int r = int(i / kH), h = int(i % kH), g = find_group(cu, G, r);
        y[i] = g < G ? to_bf(bf(x[i]) * bf(w[int64_t(g) * kH + h])) : uint16_t(0);
    }
}

// Row gradients dx = bf16(dy * W[g]) (0 past the end) and per group gw[g][h] = sum over its rows of dy * x (fp32,
// rows in order: one thread per (g, h)).
__global__ void expert_backward(const int32_t* cu, int G, int rows, const uint16_t* x, const uint16_t* w,
                                const uint16_t* dy, uint16_t* dx, float* gw) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t i = tid; i < int64_t(rows) * kH; i += stride) {
        const int r = int(i / kH), h = int(i % kH), g = find_group(cu, G, r);
        dx[i] = g < G ? to_bf(bf(dy[i]) * bf(w[int64_t(g) * kH + h])) : uint16_t(0);
    }
    for (int64_t i = tid; i < int64_t(G) * kH; i += stride) {
        const int g = int(i / kH), h = int(i % kH);
        const int begin = g == 0 ? 0 : cu[g - 1];
        float sum = 0.0f;
        for (int r = begin; r < cu[g]; ++r)
            sum = __fadd_rn(sum, __fmul_rn(bf(dy[int64_t(r) * kH + h]), bf(x[int64_t(r) * kH + h])));
        gw[i] = sum;
    }
}

struct Step {
    Buffer* buffer;
    ExpertPools* pools;
    ExpertLayer* layer;
    cudaStream_t stream;
    int rank = 0, rows = 0, groups = 0;
    // static inputs
    int32_t* idx;
    uint16_t* x;
    float* w;
    // activations and outputs
    uint16_t *recv_x, *y, *out, *grad_rows, *grad_y, *grad_rx, *grad_x;
    float *recv_w, *grad_rw, *grad_w, *gw;
    int32_t* storage = nullptr;  // plan storage of the captured step (null: the Buffer's slots)
    Plan plan;

    void run() {
        const Launch on{stream};
        plan = buffer->plan(idx, 4, kS, storage, on);
        const int32_t* cu = plan.device_cu_seqlens(rank);
        buffer->dispatch(plan, x, w, recv_x, recv_w, on);
        pools->prefetch(plan, *layer, on);
        expert_forward<<<264, 256, 0, stream>>>(cu, groups, rows, recv_x, layer->weights(0), y);
        buffer->combine(plan, y, recv_w, out, on);
        buffer->dispatch(plan, out, nullptr, grad_rows, nullptr, on);  // grad_out = out
        buffer->combine_grad(plan, grad_rows, y, recv_w, grad_y, grad_rw, on);
        expert_backward<<<264, 256, 0, stream>>>(cu, groups, rows, recv_x, layer->weights(0), grad_y, grad_rx, gw);
        pools->write_grads(plan, *layer, 0, gw, 4, /*accumulate=*/true, on);
        pools->reduce_grad(plan, *layer, on);
        buffer->combine(plan, grad_rx, nullptr, grad_x, on);
        buffer->entry_values(plan, grad_rw, grad_w, on);
    }

    // Bitwise snapshot of every checked output, cu_seqlens from `p` (the device is idle).
    std::vector<uint8_t> results(const Plan& p) const {
        std::vector<uint8_t> all;
        auto add = [&](const void* p, size_t bytes) {
            std::vector<uint8_t> v(bytes);
            CUDA_OK(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost));
            all.insert(all.end(), v.begin(), v.end());
        };
        add(out, size_t(kS) * kH * 2);
        add(grad_x, size_t(kS) * kH * 2);
        add(grad_w, size_t(kS) * kK * 4);
        add(layer->own_grads(0), size_t(kExpertsPerRank) * kH * 4);
        add(p.device_cu_seqlens(rank), size_t(groups) * 4);
        return all;
    }
};

void write_inputs(const Step& st, int R, int trial) {
    const int E = R * kExpertsPerRank;
    const std::vector<double> pop = routing::popularity(E, kSigmas[trial % 4], uint64_t(trial));
    std::vector<int32_t> idx(size_t(kS) * kK);
    routing::sample_topk(pop, kS, kK, uint64_t(trial) * 31 + 5, st.rank, idx.data());
    std::vector<uint16_t> x(size_t(kS) * kH);
    for (size_t i = 0; i < x.size(); ++i)
        x[i] = float_to_bf16(float(routing::uniform(uint64_t(trial) * 1000 + st.rank, i)) - 0.5f);
    std::vector<float> w(size_t(kS) * kK);
    for (size_t i = 0; i < w.size(); ++i) w[i] = float(routing::uniform(uint64_t(trial) * 1000 + 500 + st.rank, i));
    CUDA_OK(cudaMemcpy(st.idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(st.x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(st.w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
}

// The own gradients accumulate (write_grads accumulate=true), as nn.MoE's main_grad: zero them before each step.
void zero_main_grad(const Step& st) {
    CUDA_OK(cudaMemsetAsync(st.layer->own_grads(0), 0, size_t(kExpertsPerRank) * kH * 4, st.stream));
}

template <typename T>
T* device_array(size_t n) {
    T* p = nullptr;
    CUDA_OK(cudaMalloc(&p, n * sizeof(T)));
    CUDA_OK(cudaMemset(p, 0, n * sizeof(T)));
    return p;
}

int child(int R, int rank, std::shared_ptr<Bootstrap> boot) {
    gpu_test::use_rank_device(rank, false);
    std::shared_ptr<Transport> transport(make_ipc_transport(boot, MemoryKind::kDevice, 60.0));
    Config c;
    c.num_ranks = R;
    c.rank = rank;
    c.num_experts = R * kExpertsPerRank;
    c.num_tokens = kS;
    c.topk = kK;
    c.hidden = kH;
    c.align = kAlign;
    Buffer buffer(c, transport);
    ExpertPools pools(transport, kExpertsPerRank, {{1, kH}});
    ExpertLayer layer = pools.register_layer();
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {  // own weights: expert e's row h = bf16(1 + ((e * 7 + h) % 13) / 16)
        std::vector<uint16_t> own(size_t(kExpertsPerRank) * kH);
        for (int g = 0; g < kExpertsPerRank; ++g)
            for (int h = 0; h < kH; ++h)
                own[size_t(g) * kH + h] = float_to_bf16(1.0f + float(((rank * kExpertsPerRank + g) * 7 + h) % 13) / 16);
        CUDA_OK(cudaMemcpy(layer.own_weights(0), own.data(), own.size() * 2, cudaMemcpyHostToDevice));
    }
    const Layout& l = internal::layout(buffer);
    Step st{};
    st.buffer = &buffer;
    st.pools = &pools;
    st.layer = &layer;
    st.stream = stream;
    st.rank = rank;
    st.rows = l.num_recv_rows;
    st.groups = l.num_groups();
    const size_t rows = size_t(l.num_recv_rows);
    st.idx = device_array<int32_t>(size_t(kS) * kK);
    st.x = device_array<uint16_t>(size_t(kS) * kH);
    st.w = device_array<float>(size_t(kS) * kK);
    st.recv_x = device_array<uint16_t>(rows * kH);
    st.y = device_array<uint16_t>(rows * kH);
    st.grad_rows = device_array<uint16_t>(rows * kH);
    st.grad_y = device_array<uint16_t>(rows * kH);
    st.grad_rx = device_array<uint16_t>(rows * kH);
    st.out = device_array<uint16_t>(size_t(kS) * kH);
    st.grad_x = device_array<uint16_t>(size_t(kS) * kH);
    st.recv_w = device_array<float>(rows);
    st.grad_rw = device_array<float>(rows);
    st.grad_w = device_array<float>(size_t(kS) * kK);
    st.gw = device_array<float>(size_t(2 * kExpertsPerRank) * kH);
    int32_t* storage = device_array<int32_t>(size_t(buffer.plan_words()));

    // Warm-up (eager, the Buffer's plan slots), then capture one step into caller storage.
    write_inputs(st, R, 0);
    zero_main_grad(st);
    st.run();
    CUDA_OK(cudaStreamSynchronize(stream));
    st.storage = storage;
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    zero_main_grad(st);
    st.run();
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    const Plan captured = st.plan;  // lives in `storage`: every replay rewrites it
    st.storage = nullptr;
    int failures = 0, distinct = 0;
    std::vector<uint8_t> previous;
    for (int trial = 1; trial <= kTrials; ++trial) {
        write_inputs(st, R, trial);
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        buffer.check_status(Launch{stream});
        const std::vector<uint8_t> replayed = st.results(captured);
        zero_main_grad(st);
        st.run();
        CUDA_OK(cudaStreamSynchronize(stream));
        buffer.check_status(Launch{stream});
        const std::vector<uint8_t> eager = st.results(st.plan);
        size_t bad = eager.size();
        for (size_t i = 0; i < eager.size() && bad == eager.size(); ++i) {
            if (replayed[i] != eager[i]) bad = i;
        }
        if (bad != eager.size()) {
            std::fprintf(stderr,
                         "R=%d rank %d trial %d: FAIL the replay differs from the eager step at byte %zu of %zu\n", R,
                         rank, trial, bad, eager.size());
            ++failures;
        }
        const std::vector<uint8_t> cu(eager.end() - st.groups * 4, eager.end());
        distinct += cu != previous;
        previous = cu;
        const PlanStats& stats = st.plan.stats();  // host accessor: a synchronising copy, outside the graph
        for (int d = 0; d < R; ++d) {
            if (stats.loads_after[d] != kS * kK) {
                std::fprintf(stderr, "R=%d rank %d trial %d: FAIL rank %d computes %d rows, expected %d\n", R, rank,
                             trial, d, stats.loads_after[d], kS * kK);
                ++failures;
            }
        }
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    if (distinct < 4) {
        std::fprintf(stderr, "R=%d rank %d: FAIL only %d distinct plans over %d trials\n", R, rank, distinct, kTrials);
        ++failures;
    }
    if (failures == 0) {
        std::printf("R=%d rank %d: PASS (%d replays of the whole step bitwise equal to eager; %d distinct plans)\n", R,
                    rank, kTrials, distinct);
    }
    return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    gpu_test::IpcTestArgs args;
    if (!gpu_test::parse_ipc_test_args(argc, argv, {2, 4}, args)) return 2;
    if (access("/dev/nvidiactl", F_OK) != 0) {
        std::printf("SKIP: no CUDA device (/dev/nvidiactl missing)\n");
        return 0;
    }
    int failed = 0;
    for (int R : args.rank_counts) {
        failed += gpu_test::run_rank_processes(
            "step_graph_gpu_main", R, false,
            [&](int rank, std::shared_ptr<Bootstrap> boot) { return child(R, rank, boot); });
    }
    std::printf("%s\n", failed == 0 ? "step_graph_gpu_main: all PASS" : "step_graph_gpu_main: FAILED");
    return failed == 0 ? 0 : 1;
}
