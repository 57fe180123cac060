// The static planner on the GPU (issue 60; design §4 "The static planner"): launch_planner with a placement table in
// device memory, both engines (the parallel one-block kernel and the serial reference), against the host planner,
// bitwise over the plan's global part, for shapes from a single rank to MoonEP's and R=64 at E=896, random and
// adversarial counts (every entry on one expert), placements with empty slots anywhere and hot experts placed on many
// ranks. The whole step (plan op, dispatch, pull and push prefetch, combine, graph replays) is test_gpu_serving's
// static_* cases. Before the GPU runs, check_plan holds every host plan to the rule (so a CPU machine checks those).
// Plain main: PASS/FAIL with the first differing word; "SKIP: no CUDA device" where no GPU exists.
//
//   test_gpu_static [--host-only]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "gpu_harness.hpp"
#include "kernels/common/cuda_check.cuh"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "planner/gpu_planner.cuh"
#include "planner/planner.hpp"
#include "planner/static_placement.hpp"
#include "routing/routing.hpp"

using namespace flatep;

namespace {

struct Shape {
    int R, E, S, K, B, align;
};

// A placement of B slots a rank (B = num_slots): the hottest experts (ids from 0, the routing's most popular under
// adversarial counts) on every rank that can hold them, the rest drawn from `seed`, one slot in four empty.
std::vector<int32_t> placement_of(const Layout& l, uint64_t seed) {
    const int R = l.num_ranks, E = l.num_experts, B = l.num_slots, epn = l.experts_per_rank;
    std::vector<int32_t> placement(size_t(R) * B, -1);
    for (int d = 0; d < R && R > 1; ++d) {
        for (int j = 0; j < B; ++j) {
            if (routing::mix64(seed + uint64_t(d * 977 + j)) % 4 == 0) continue;
            int e = j < 2 ? j : int(routing::mix64(seed * 31 + uint64_t(d * 131 + j)) % uint64_t(E));
            if (e / epn == d) e = (e + epn) % E;
            bool seen = false;
            for (int k = 0; k < j; ++k) seen = seen || placement[size_t(d) * B + k] == e;
            if (!seen) placement[size_t(d) * B + j] = e;
        }
    }
    return placement;
}

}  // namespace

int main(int argc, char** argv) {
    const bool host_only = argc > 1 && std::strcmp(argv[1], "--host-only") == 0;
    int num_devices = 0;
    const bool gpu = !host_only && cudaGetDeviceCount(&num_devices) == cudaSuccess && num_devices > 0;
    const Shape shapes[] = {
        {1, 8, 16, 2, -1, 1},   {2, 8, 16, 2, 1, 4},       {4, 32, 128, 4, 2, 16},     {8, 256, 128, 8, -1, 8},
        {8, 256, 128, 8, 4, 8}, {8, 384, 8192, 8, 4, 128}, {16, 896, 1024, 16, 8, 16}, {64, 896, 256, 8, 2, 1},
    };
    int plans = 0;
    for (const Shape& sh : shapes) {
        Config c;
        c.num_ranks = sh.R, c.num_experts = sh.E, c.num_tokens = sh.S, c.topk = sh.K, c.align = sh.align;
        const Layout l = make_layout(c, PlannerKind::kStatic, {sh.B, 0});
        const int64_t words = make_plan_sizes(l).total_words, global = make_plan_sizes(l).entry_rank;
        int32_t *d_plan = nullptr, *d_table = nullptr;
        void* ws = nullptr;
        if (gpu) {
            FLATEP_CUDA_CHECK(cudaMalloc(&d_plan, size_t(words) * 4));
            FLATEP_CUDA_CHECK(cudaMalloc(&ws, planner::planner_workspace_bytes(l)));
            FLATEP_CUDA_CHECK(cudaMalloc(&d_table, size_t(planner::placement_table_words(l)) * 4));
        }
        for (int m = 0; m < 6; ++m) {
            const std::vector<int32_t> placement = placement_of(l, 17 + uint64_t(m));
            const std::vector<int32_t> table = planner::make_placement_table(l, placement);
            std::vector<int32_t> tpe;
            if (m == 5) {  // adversarial: every entry of every rank on experts 0..K-1 (placed on many ranks above)
                tpe.assign(size_t(sh.R) * sh.E, 0);
                for (int r = 0; r < sh.R; ++r)
                    for (int k = 0; k < sh.K; ++k) tpe[size_t(r) * sh.E + k] = sh.S;
            } else {
                tpe = routing::generate_counts(sh.R, sh.E, sh.S, sh.K, 0.75 * m, 500 + uint64_t(m));
            }
            planner::HostPlan host(l);
            std::copy(tpe.begin(), tpe.end(), host.view.tpe_all);
            planner::plan_counts(l, PlannerKind::kStatic, host.view, table.data());
            const std::string what = "R=" + std::to_string(sh.R) + " E=" + std::to_string(sh.E) +
                                     " S=" + std::to_string(sh.S) + " K=" + std::to_string(sh.K) +
                                     " B=" + std::to_string(l.num_slots) + " matrix " + std::to_string(m);
            const std::string bad = planner::check_plan(l, host.view, placement.data());
            if (!bad.empty()) {
                std::printf("FAIL static planner (host, %s): %s\n", what.c_str(), bad.c_str());
                return 1;
            }
            if (!gpu) continue;
            FLATEP_CUDA_CHECK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
            for (int engine = 0; engine < 2; ++engine) {
                if (engine == 1 && sh.E * sh.R > 4096 && m != 0) continue;  // the serial engine is one thread: sampled
                std::vector<int32_t> init(size_t(words), 0);
                std::copy(tpe.begin(), tpe.end(), init.begin() + make_plan_sizes(l).tpe_all);
                FLATEP_CUDA_CHECK(cudaMemcpy(d_plan, init.data(), size_t(words) * 4, cudaMemcpyHostToDevice));
                planner::launch_planner(l, PlannerKind::kStatic, make_plan_view(l, d_plan), ws,
                                        planner::PlannerEngine(engine), nullptr, d_table);
                std::vector<int32_t> got(static_cast<size_t>(words));
                FLATEP_CUDA_CHECK(cudaMemcpy(got.data(), d_plan, size_t(words) * 4, cudaMemcpyDeviceToHost));
                for (int64_t w = 0; w < global; ++w) {
                    if (got[size_t(w)] != host.view.tpe_all[w]) {
                        std::printf("FAIL static planner (%s engine, %s): %s got %d expected %d\n",
                                    engine ? "serial" : "parallel", what.c_str(),
                                    gpu_test::plan_word_name(l, w).c_str(), got[size_t(w)], host.view.tpe_all[w]);
                        std::printf("  reproduce: test_gpu_static\n");
                        return 1;
                    }
                }
                ++plans;
            }
        }
        if (gpu) {
            cudaFree(d_plan);
            cudaFree(d_table);
            cudaFree(ws);
        }
    }
    if (!gpu) {
        std::printf("PASS static planner: every host plan passes check_plan (CPU checks only)\n");
        if (!host_only) std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    std::printf("PASS static planner: %d GPU plans bitwise equal to the host planner\n", plans);
    return 0;
}
