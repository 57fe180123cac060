// Shared by the GPU test and the ops benchmark: R ranks of one step on the GPU (LocalDeviceGroup) and, as the
// oracle, on the CPU backend (LocalHostWorld threads), with the same inputs. No GoogleTest.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "flatep/config.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/plan/plan.cuh"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/combine_args.hpp"
#include "ops/combine_grad_args.hpp"
#include "ops/dispatch_args.hpp"
#include "ops/grad_reduce_args.hpp"
#include "ops/prefetch_args.hpp"
#include "ops/write_grads_args.hpp"
#include "planner/gpu_planner.cuh"
#include "routing/routing.hpp"
#include "runtime/device_ops.hpp"
#include "runtime/host_plan.hpp"
#include "testing/local_device.hpp"
#include "transport/local_host.hpp"

namespace flatep::gpu_test {

inline uint64_t mix(uint64_t x) { return routing::mix64(x); }

// Finite bf16 values in about [-64, 64] (no NaN/Inf: their payloads differ between CPU and GPU adds).
inline void fill_bf16(uint16_t* dst, int64_t n, uint64_t seed) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t r = mix(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
        const uint16_t sign = uint16_t((r & 1) << 15);
        const uint16_t exp = uint16_t(110 + (r >> 1) % 23);  // 2^-17 .. 2^5
        const uint16_t man = uint16_t((r >> 8) & 0x7f);
        dst[i] = uint16_t(sign | (exp << 7) | man);
    }
}
inline void fill_f32(float* dst, int64_t n, uint64_t seed, float lo, float hi) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t r = mix(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
        dst[i] = lo + (hi - lo) * float(double(r >> 11) / double(1ull << 53));
    }
}

// Fills n bf16 words of device memory with finite values (the bits of fill_bf16's kind, generated on the device, on
// the legacy stream).
void fill_device_bf16(void* dst, int64_t n, uint64_t seed);

// The sync::SyncArgs of the CPU backend's rank for a symmetric buffer `reg` laid out as `sym` (60 s timeout).
sync::SyncArgs host_sync(const SymmetricRegion& reg, const SymmetricLayout& sym, int rank, int num_ranks,
                         uint64_t* epoch);

// Runs fn(rank) for every rank on its own thread (the CPU backend's ranks, testing::run_ranks); exceptions on ranks
// are rethrown after every thread ended, as "host rank r: what" lines.
void run_host_ranks(int num_ranks, const std::function<void(int rank)>& fn);

// A config of the GPU tests (the other fields at their defaults).
// Name of the plan array holding word w.
inline std::string plan_word_name(const Layout& l, int64_t w) {
    const PlanSizes s = make_plan_sizes(l);
    const std::pair<const char*, int64_t> arrays[] = {
        {"tpe_all", s.tpe_all},         {"alloc", s.alloc},           {"keep", s.keep},
        {"spill_start", s.spill_start}, {"take_start", s.take_start}, {"group_row", s.group_row},
        {"slot_expert", s.slot_expert}, {"cu_seqlens", s.cu_seqlens}, {"stats", s.stats},
        {"entry_rank", s.entry_rank},   {"entry_row", s.entry_row},   {"row_head", s.row_head},
        {"row_next", s.row_next},       {"header", s.header}};
    std::string name = "?";
    int64_t base = 0;
    for (auto& a : arrays) {
        if (w >= a.second) {
            name = a.first;
            base = a.second;
        }
    }
    return name + "[" + std::to_string(w - base) + "]";
}

inline Config make_config(int R, int E, int S, int K, int H, int align, double capacity_factor = 1.0) {
    Config c;
    c.num_ranks = R;
    c.num_experts = E;
    c.num_tokens = S;
    c.topk = K;
    c.hidden = H;
    c.align = align;
    c.capacity_factor = capacity_factor;
    return c;
}

enum class RoutingKind { kRandom, kOneExpert, kBadIds };

struct CaseSpec {
    std::string name;
    Config config;
    PlannerKind planner = PlannerKind::kBalanced;
    RoutingKind routing = RoutingKind::kRandom;
    double sigma = 1.0;
    uint64_t seed = 1;
    int num_tokens = -1;  // tokens passed per rank (-1: S)
    int index_bytes = 4;
    bool weighted = true;
    bool separate_recv = true;    // recv_x outside the symmetric region (with canary rows around it)
    bool backward = false;        // also combine-backward (dispatch, combine_grad) and dispatch-backward (combine)
    int64_t expert_elems = 1024;  // prefetch / reduce_grad size per expert (bf16 bytes = 2x, fp32 grads)
    int64_t grads_elems = 1024;   // backward: write_grads size per expert (not a multiple of 8: the scalar kernel)
};

// Routing of every rank: topk_idx [R][s*K] as int64 (converted to the index width on upload).
inline std::vector<std::vector<int64_t>> make_routing(const CaseSpec& c, uint64_t seed) {
    const Config& g = c.config;
    const int s = c.num_tokens < 0 ? g.num_tokens : c.num_tokens;
    std::vector<std::vector<int64_t>> out(g.num_ranks);
    const std::vector<double> pop = routing::popularity(g.num_experts, c.sigma, seed);
    std::vector<int32_t> tmp(size_t(s) * g.topk);
    for (int r = 0; r < g.num_ranks; ++r) {
        out[r].resize(size_t(s) * g.topk);
        if (c.routing == RoutingKind::kOneExpert) {
            // Every token of every rank routes to the same K experts (the hot expert first).
            for (int t = 0; t < s; ++t)
                for (int k = 0; k < g.topk; ++k) out[r][size_t(t) * g.topk + k] = (3 + k) % g.num_experts;
            continue;
        }
        routing::sample_topk(pop, s, g.topk, seed, r, tmp.data());
        for (size_t i = 0; i < tmp.size(); ++i) out[r][i] = tmp[i];
        if (c.routing == RoutingKind::kBadIds) {
            for (size_t i = 0; i < tmp.size(); ++i) {
                const uint64_t h = mix(seed + 77 * r + i);
                if (h % 97 == 0) out[r][i] = (h & 1024) ? -1 : g.num_experts + 3;
            }
        }
    }
    return out;
}

// Inputs of one step for every rank (identical on both backends).
struct StepInputs {
    std::vector<std::vector<int64_t>> topk;       // [R][s*K]
    std::vector<std::vector<uint16_t>> x;         // [R][s*H]
    std::vector<std::vector<float>> weights;      // [R][s*K]
    std::vector<std::vector<uint16_t>> y;         // [R][NvS*H] expert outputs
    std::vector<std::vector<uint16_t>> gout;      // [R][s*H] combine backward input
    std::vector<std::vector<uint16_t>> gy;        // [R][NvS*H] dispatch backward input
    std::vector<std::vector<uint16_t>> expert_w;  // [R][epn*expert_elems] bf16 weights
    std::vector<std::vector<float>> grads;        // [R][epn*expert_elems]
    std::vector<std::vector<float>> red_pool;     // [R][epn*expert_elems] replica gradients
    std::vector<std::vector<uint16_t>> wgrad16;   // backward: [R][2*epn*grads_elems] GEMM weight grads, bf16
    std::vector<std::vector<float>> wgrad32;      // backward: the same in fp32
};

inline StepInputs make_inputs(const CaseSpec& c, const Layout& l, uint64_t seed) {
    const int R = l.num_ranks, s = c.num_tokens < 0 ? l.num_tokens : c.num_tokens;
    const int64_t H = l.hidden, nvs = l.num_recv_rows, pe = int64_t(l.experts_per_rank) * c.expert_elems;
    StepInputs in;
    in.topk = make_routing(c, seed);
    in.x.resize(R);
    in.weights.resize(R);
    in.y.resize(R);
    in.gout.resize(R);
    in.gy.resize(R);
    in.expert_w.resize(R);
    in.grads.resize(R);
    in.red_pool.resize(R);
    in.wgrad16.resize(R);
    in.wgrad32.resize(R);
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) {
        threads.emplace_back([&, r] {
            const uint64_t base = seed * 1000 + r * 16;
            in.x[r].resize(size_t(s) * H);
            fill_bf16(in.x[r].data(), int64_t(s) * H, base + 1);
            in.weights[r].resize(size_t(s) * l.topk);
            fill_f32(in.weights[r].data(), int64_t(s) * l.topk, base + 2, -1.f, 1.f);
            in.y[r].resize(size_t(nvs * H));
            fill_bf16(in.y[r].data(), nvs * H, base + 3);
            if (c.backward) {
                in.gout[r].resize(size_t(s) * H);
                fill_bf16(in.gout[r].data(), int64_t(s) * H, base + 4);
                in.gy[r].resize(size_t(nvs * H));
                fill_bf16(in.gy[r].data(), nvs * H, base + 5);
            }
            in.expert_w[r].resize(size_t(pe));
            fill_bf16(in.expert_w[r].data(), pe, base + 6);
            in.grads[r].resize(size_t(pe));
            fill_f32(in.grads[r].data(), pe, base + 7, -1.f, 1.f);
            in.red_pool[r].resize(size_t(pe));
            fill_f32(in.red_pool[r].data(), pe, base + 8, -1.f, 1.f);
            if (c.backward) {
                const int64_t ge = 2 * int64_t(l.experts_per_rank) * c.grads_elems;
                in.wgrad16[r].resize(size_t(ge));
                fill_bf16(in.wgrad16[r].data(), ge, base + 9);
                in.wgrad32[r].resize(size_t(ge));
                fill_f32(in.wgrad32[r].data(), ge, base + 10, -1.f, 1.f);
            }
        });
    }
    for (auto& t : threads) t.join();
    return in;
}

// Outputs of one step of one rank (host copies).
struct RankOutputs {
    std::vector<int32_t> plan;        // whole plan allocation
    std::vector<uint16_t> recv_x;     // [NvS*H] (rows past the last group end: whatever the buffer held)
    std::vector<float> recv_w;        // [NvS]
    std::vector<uint16_t> out;        // [s*H]
    std::vector<uint16_t> recv_gx;    // backward: [NvS*H] combine-backward rows
    std::vector<uint16_t> gx;         // backward: [s*H] dispatch-backward sums
    std::vector<uint16_t> grad_y;     // backward: combine_grad [NvS*H] (device: with canary rows around)
    std::vector<float> grad_w;        // backward: combine_grad [NvS] (device: with canary rows around)
    std::vector<uint16_t> slot_pool;  // [epn*expert_elems] bf16
    std::vector<uint16_t> pull_pool;  // device: the same slots pulled by their holder (serving's prefetch)
    std::vector<float> grads;
    std::vector<float> red_pool;
    std::vector<float> wgrads16, wgrads32;  // backward: write_grads outputs [2*epn*grads_elems] (canary-prefilled)
    int32_t status[4];
};

// Runs one step on the CPU backend (R threads), returns every rank's outputs.
std::vector<RankOutputs> run_host(const CaseSpec& c, const Layout& l, const StepInputs& in);

// Device state of a case: buffers sized once, reused by steps and graph replays.
struct DeviceCase {
    DeviceCase(const CaseSpec& c, const Layout& l, testing::LocalDeviceGroup& group);
    ~DeviceCase();
    void upload(const StepInputs& in);  // inputs into the device buffers (synchronous)
    void enqueue_step();                // every op of every rank on the rank streams (no host sync)
    std::vector<RankOutputs> download();

    CaseSpec spec;
    Layout layout;
    SymmetricLayout sym;
    testing::LocalDeviceGroup& group;
    int num_tokens;
    std::vector<SymmetricRegion> regions, slot_regions, red_regions, pull_regions;
    struct PerRank {
        int32_t* plan = nullptr;
        void* workspace = nullptr;
        void* topk = nullptr;
        uint16_t* x = nullptr;
        float* weights = nullptr;
        uint16_t* recv_alloc = nullptr;  // separate recv_x with canary rows around
        uint16_t* recv_x = nullptr;
        float* recv_w = nullptr;
        uint16_t* y = nullptr;
        uint16_t* out_alloc = nullptr;  // out with canary rows after
        uint16_t* gout = nullptr;
        uint16_t* recv_galloc = nullptr;
        uint16_t* recv_gx = nullptr;
        uint16_t* gy = nullptr;
        uint16_t* gx_alloc = nullptr;
        uint16_t* grad_y_alloc = nullptr;  // combine_grad outputs with canary rows around
        float* grad_w_alloc = nullptr;
        uint16_t* wgrad16 = nullptr;  // write_grads inputs and outputs
        float* wgrad32 = nullptr;
        float* wgrads16 = nullptr;
        float* wgrads32 = nullptr;
        uint16_t* expert_w = nullptr;
        float* grads = nullptr;
    };
    std::vector<PerRank> ranks;
    static constexpr int kCanaryRows = 4;
    static constexpr uint16_t kCanary = 0x7fa5;         // a NaN pattern nothing writes
    static constexpr uint32_t kCanaryF32 = 0x7fa5a5a5;  // an fp32 NaN pattern nothing writes
};

}  // namespace flatep::gpu_test
