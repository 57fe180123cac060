// L1c: flatep::ExpertPools on device memory (design §5) with R processes sharing one GPU over the ipc transport (CUDA
// VMM regions passed as file descriptors), against the CPU backend (R threads, host memory) on the same inputs:
//   - the compute views alias the layer's own memory (written through own_weights / read through weights) and the
//     pools (a second layer's view shows the first one's slots; own_grads / reduce_pool equal the grads view halves),
//   - prefetch fills the slot pools and reduce_grad the owners' grads (and zeroes the consumed slots) bitwise equal
//     to the CPU backend, over the whole [2*epn] views of every projection.
// With --gpu-per-rank (L2), rank r runs on GPU r % device count: replicas' weights and gradients cross NVLink.
// Plain main (the device machine has no GoogleTest); exits 0 with "SKIP" where there is no GPU.
//
//   ipc_pools_gpu_main [--gpu-per-rank] [R ...]     (default: 2 4)
//
// The parent computes the CPU reference before forking and never initialises CUDA; each child checks its own rank.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "device_test_util.hpp"
#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "routing/routing.hpp"
#include "transport/local_host.hpp"

namespace {

using namespace flatep;

constexpr int kEpn = 4;
constexpr int kProjections = 2;
const ProjectionShape kShapes[kProjections] = {{16, 24}, {24, 8}};  // expert bytes multiples of 16, elems of 4

struct ProjectionData {
    std::vector<uint16_t> own_weights;  // input: [epn][elems], written through own_weights(p)
    std::vector<float> grads_in;        // input: [2*epn][elems], written through grads(p) before reduce_grad
    std::vector<uint16_t> weights;      // after prefetch: layer 1's view [2*epn][elems]
    std::vector<uint16_t> other_slots;  // after prefetch: layer 0's view, slot half [epn][elems]
    std::vector<float> grads;           // after reduce_grad: layer 1's view [2*epn][elems]
    std::vector<float> own_grads;       // after reduce_grad: own_grads(p) [epn][elems]
    std::vector<float> reduce_pool;     // after reduce_grad: reduce_pool(p) [epn][elems]
};

struct RankData {
    std::vector<int32_t> idx;  // [s][K]
    ProjectionData proj[kProjections];
    std::vector<int32_t> slot_expert;  // [R][epn] of the plan
};

Config config_for(int R, int rank) {
    Config c;
    c.num_ranks = R;
    c.rank = rank;
    c.num_experts = kEpn * R;
    c.num_tokens = 64;
    c.topk = 2;
    c.hidden = 16;
    c.align = 1;
    return c;
}

int num_tokens_of(int rank) { return 64 - 5 * (rank % 3); }

void make_inputs(int R, std::vector<RankData>& data) {
    const Config c = config_for(R, 0);
    const std::vector<double> pop = routing::popularity(c.num_experts, 1.5, 11);  // skewed: replicas get placed
    for (int r = 0; r < R; ++r) {
        RankData& d = data[r];
        const int s = num_tokens_of(r);
        d.idx.resize(size_t(s) * c.topk);
        routing::sample_topk(pop, s, c.topk, 11, r, d.idx.data());
        for (int p = 0; p < kProjections; ++p) {
            ProjectionData& pd = d.proj[p];
            const int64_t n = kEpn * kShapes[p].elems();
            pd.own_weights.resize(size_t(n));
            for (int64_t i = 0; i < n; ++i)
                pd.own_weights[i] = uint16_t(0x3c00u + ((routing::mix64((r * 7 + p) * 1000003u + i) >> 40) & 0x3ff));
            pd.grads_in.resize(size_t(2 * n));
            for (int64_t i = 0; i < 2 * n; ++i) {
                // Mixed magnitudes and signs: the fp32 sums' rounding depends on the (rank, slot) order.
                const double u = routing::uniform(r * 31 + p + 5, uint64_t(i));
                const int scale = int(routing::mix64(uint64_t(r * 131 + p) * 7919u + i) % 24) - 12;
                pd.grads_in[i] = float(std::ldexp(u - 0.5, scale));
            }
        }
    }
}

void host_reference(int R, std::vector<RankData>& data) {
    transport::LocalHostWorld world(R, 60.0);
    std::vector<std::string> errors(R);
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) {
        threads.emplace_back([&, r] {
            try {
                RankData& d = data[r];
                Buffer buffer(config_for(R, r), world.transport(r));
                Plan plan = buffer.plan(d.idx.data(), 4, num_tokens_of(r));
                const planner::HostPlan& h = internal::host_plan(plan);
                d.slot_expert.assign(h.view.slot_expert, h.view.slot_expert + R * kEpn);
                ExpertPools pools(world.transport(r), kEpn, {kShapes[0], kShapes[1]});
                ExpertLayer layer0 = pools.register_layer();
                ExpertLayer layer1 = pools.register_layer();
                for (int p = 0; p < kProjections; ++p) {
                    ProjectionData& pd = d.proj[p];
                    std::memcpy(layer1.own_weights(p), pd.own_weights.data(), pd.own_weights.size() * 2);
                }
                pools.prefetch(plan, layer1);
                for (int p = 0; p < kProjections; ++p) {
                    ProjectionData& pd = d.proj[p];
                    const int64_t n = kEpn * kShapes[p].elems();
                    pd.weights.assign(layer1.weights(p), layer1.weights(p) + 2 * n);
                    pd.other_slots.assign(layer0.weights(p) + n, layer0.weights(p) + 2 * n);
                    std::memcpy(layer1.grads(p), pd.grads_in.data(), pd.grads_in.size() * 4);
                }
                pools.reduce_grad(plan, layer1);
                for (int p = 0; p < kProjections; ++p) {
                    ProjectionData& pd = d.proj[p];
                    const int64_t n = kEpn * kShapes[p].elems();
                    pd.grads.assign(layer1.grads(p), layer1.grads(p) + 2 * n);
                    pd.own_grads.assign(layer1.own_grads(p), layer1.own_grads(p) + n);
                    pd.reduce_pool.assign(pools.reduce_pool(p), pools.reduce_pool(p) + n);
                }
            } catch (const std::exception& e) {
                errors[r] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < R; ++r) {
        if (!errors[r].empty()) throw std::runtime_error("host reference rank " + std::to_string(r) + ": " + errors[r]);
    }
}

using gpu_test::from_device;

template <typename T>
int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
    if (a.size() != b.size()) return 0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return int64_t(i);
    }
    return -1;
}

int child(int R, int rank, std::shared_ptr<Bootstrap> boot, const RankData& ref, bool gpu_per_rank) {
    const int device = gpu_test::use_rank_device(rank, gpu_per_rank);
    std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kDevice, 60.0);
    Buffer buffer(config_for(R, rank), transport);
    ExpertPools pools(transport, kEpn, {kShapes[0], kShapes[1]});
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const Launch on{stream};
    int failures = 0;
    auto report = [&](const std::string& what, int64_t bad) {
        if (bad >= 0) {
            std::fprintf(stderr, "R=%d rank %d: FAIL %s (first differing element %lld)\n", R, rank, what.c_str(),
                         static_cast<long long>(bad));
            ++failures;
        }
    };
    if (!pools.on_device()) report("pools.on_device()", 0);

    int32_t* idx = nullptr;
    CUDA_OK(cudaMalloc(&idx, ref.idx.size() * 4));
    CUDA_OK(cudaMemcpy(idx, ref.idx.data(), ref.idx.size() * 4, cudaMemcpyHostToDevice));
    ExpertLayer layer0 = pools.register_layer();
    ExpertLayer layer1 = pools.register_layer();
    if (!layer1.on_device()) report("layer.on_device()", 0);
    for (int p = 0; p < kProjections; ++p) {
        const std::vector<uint16_t>& w = ref.proj[p].own_weights;
        CUDA_OK(cudaMemcpy(layer1.own_weights(p), w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaDeviceSynchronize());  // the copies ran on the legacy stream, which `stream` does not wait for

    Plan plan = buffer.plan(idx, 4, num_tokens_of(rank), nullptr, on);
    pools.prefetch(plan, layer1, on);
    CUDA_OK(cudaStreamSynchronize(stream));
    for (int p = 0; p < kProjections; ++p) {
        const ProjectionData& pd = ref.proj[p];
        const int64_t n = kEpn * kShapes[p].elems();
        const std::string name = " projection " + std::to_string(p);
        const std::vector<uint16_t> view = from_device(layer1.weights(p), 2 * n);
        report("prefetch: weights view vs CPU backend" + name, first_difference(view, pd.weights));
        // Own half written through the own mapping, slot half equal to the pool and to another layer's view.
        report("own_weights alias the view" + name,
               first_difference(std::vector<uint16_t>(view.begin(), view.begin() + n), pd.own_weights));
        const std::vector<uint16_t> slot_half(view.begin() + n, view.end());
        report("slot pool is the view's second half" + name,
               first_difference(from_device(pools.slot_pool(p), n), slot_half));
        report("another layer's view shares the slot pool" + name,
               first_difference(from_device(layer0.weights(p) + n, n), slot_half));
        report("layer 0's own weights stay zero" + name,
               first_difference(from_device(layer0.weights(p), n), std::vector<uint16_t>(size_t(n), 0)));
        CUDA_OK(cudaMemcpy(layer1.grads(p), pd.grads_in.data(), pd.grads_in.size() * 4, cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaDeviceSynchronize());
    pools.reduce_grad(plan, layer1, on);
    CUDA_OK(cudaStreamSynchronize(stream));
    for (int p = 0; p < kProjections; ++p) {
        const ProjectionData& pd = ref.proj[p];
        const int64_t n = kEpn * kShapes[p].elems();
        const std::string name = " projection " + std::to_string(p);
        report("reduce_grad: grads view vs CPU backend" + name,
               first_difference(from_device(layer1.grads(p), 2 * n), pd.grads));
        report("reduce_grad: own_grads vs CPU backend" + name,
               first_difference(from_device(layer1.own_grads(p), n), pd.own_grads));
        report("reduce_grad: reduce_pool vs CPU backend" + name,
               first_difference(from_device(pools.reduce_pool(p), n), pd.reduce_pool));
    }
    // The plan itself (a synchronising host copy) must be the reference's, or the comparisons above mean little.
    std::vector<int32_t> slots;
    for (int d = 0; d < R; ++d) {
        for (int32_t e : plan.slot_expert(d)) slots.push_back(e);
    }
    report("plan slot_expert", first_difference(slots, ref.slot_expert));
    int replicas = 0;
    for (int32_t e : ref.slot_expert) replicas += e >= 0;
    CUDA_OK(cudaFree(idx));
    CUDA_OK(cudaStreamDestroy(stream));
    if (failures == 0) {
        std::printf(
            "R=%d rank %d (GPU %d): PASS (%d replicas; views alias layer memory and pools; prefetch and "
            "reduce_grad bitwise equal to the CPU backend)\n",
            R, rank, device, replicas);
    }
    return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    // Without a GPU only the CPU reference runs (it must place replicas), then the test skips.
    const bool have_gpu = access("/dev/nvidiactl", F_OK) == 0;
    gpu_test::IpcTestArgs args;
    if (!gpu_test::parse_ipc_test_args(argc, argv, {2, 4}, args)) return 2;
    const std::vector<int>& sizes = args.rank_counts;
    int failed = 0;
    for (int R : sizes) {
        std::vector<RankData> data(R);
        make_inputs(R, data);
        host_reference(R, data);
        int replicas = 0;
        for (int32_t e : data[0].slot_expert) replicas += e >= 0;
        if (replicas == 0) {  // no replica: prefetch and reduce_grad would move nothing, and the test prove nothing
            std::printf("R=%d: FAIL the reference plan places no replicas\n", R);
            ++failed;
            continue;
        }
        if (!have_gpu) {
            std::printf("R=%d: CPU reference places %d replicas\n", R, replicas);
            continue;
        }
        failed += gpu_test::run_rank_processes("ipc_pools_gpu_main", R, args.gpu_per_rank,
                                               [&](int rank, std::shared_ptr<Bootstrap> boot) {
                                                   return child(R, rank, boot, data[rank], args.gpu_per_rank);
                                               });
    }
    if (!have_gpu && failed == 0) {
        std::printf("SKIP: no CUDA device (/dev/nvidiactl missing)\n");
        return 0;
    }
    std::printf("%s\n", failed == 0 ? "ipc_pools_gpu_main: all PASS" : "ipc_pools_gpu_main: FAILED");
    return failed == 0 ? 0 : 1;
}
