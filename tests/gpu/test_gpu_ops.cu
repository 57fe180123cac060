// L1/L1b GPU tests: every CUDA op against the CPU backend, R virtual ranks on one GPU (and one rank per GPU where
// several exist). Plain main (the device machine has no GoogleTest): prints PASS/FAIL per case with the first
// mismatch, returns non-zero on failure, exits 0 with "SKIP: no CUDA device" where no GPU exists.
//
//   test_gpu_ops            all cases
//   test_gpu_ops --quick    the small cases only (compute-sanitizer runs)
//   test_gpu_ops --case NAME
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gpu_harness.hpp"
#include "planner/planner.hpp"

using namespace flatep;
using namespace flatep::gpu_test;

namespace {

std::string g_first;  // first mismatch of the current case

template <typename T>
bool compare_words(const char* what, int rank, const T* got, const T* want, int64_t n, int64_t row_len,
                   int64_t row_offset = 0) {
    for (int64_t i = 0; i < n; ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
            char buf[320];
            std::snprintf(buf, sizeof(buf), "%s: rank %d row %lld col %lld: got 0x%llx expected 0x%llx", what, rank,
                          (long long)(i / row_len + row_offset), (long long)(i % row_len),
                          (unsigned long long)(uint64_t)got[i], (unsigned long long)(uint64_t)want[i]);
            if (sizeof(T) == 4 && std::is_floating_point_v<T>) {
                std::snprintf(buf + std::strlen(buf), sizeof(buf) - std::strlen(buf), " (%g vs %g)", double(got[i]),
                              double(want[i]));
            }
            g_first = buf;
            return false;
        }
    }
    return true;
}

bool compare_outputs(const CaseSpec& c, const Layout& l, const std::vector<RankOutputs>& gpu,
                     const std::vector<RankOutputs>& cpu) {
    const int R = l.num_ranks;
    const int64_t H = l.hidden, nvs = l.num_recv_rows, S = l.num_tokens;
    const int s = c.num_tokens < 0 ? l.num_tokens : c.num_tokens;
    const int kc = DeviceCase::kCanaryRows;
    for (int r = 0; r < R; ++r) {
        const RankOutputs &g = gpu[r], &h = cpu[r];
        for (size_t w = 0; w < g.plan.size(); ++w) {
            if (g.plan[w] != h.plan[w]) {
                g_first = "plan: rank " + std::to_string(r) + " " + plan_word_name(l, int64_t(w)) + ": got " +
                          std::to_string(g.plan[w]) + " expected " + std::to_string(h.plan[w]);
                return false;
            }
        }
        const PlanView pv = make_plan_view(l, const_cast<int32_t*>(h.plan.data()));
        const int64_t end = pv.cu_seqlens[int64_t(r) * l.num_groups() + l.num_groups() - 1];
        if (!compare_words("status", r, g.status, h.status, 4, 4)) return false;
        const uint16_t* grecv = c.separate_recv ? g.recv_x.data() + kc * H : g.recv_x.data();
        if (!compare_words("dispatch recv_x", r, grecv, h.recv_x.data(), end * H, H)) return false;
        if (!compare_words("dispatch recv_w", r, g.recv_w.data(), h.recv_w.data(), end, 1)) return false;
        if (c.separate_recv) {
            std::vector<uint16_t> canary(size_t(kc * H), DeviceCase::kCanary);
            if (!compare_words("recv_x canary before", r, g.recv_x.data(), canary.data(), kc * H, H, -kc)) return false;
            const int64_t tail = (nvs + kc - end) * H;
            std::vector<uint16_t> tail_canary(size_t(tail), DeviceCase::kCanary);
            if (!compare_words("recv_x rows past the end / canary after", r, grecv + end * H, tail_canary.data(), tail,
                               H, end))
                return false;
        }
        if (!compare_words("combine out", r, g.out.data(), h.out.data(), int64_t(s) * H, H)) return false;
        {
            const int64_t tail = (S + kc - s) * H;
            std::vector<uint16_t> canary(size_t(tail), DeviceCase::kCanary);
            if (!compare_words("combine out canary", r, g.out.data() + int64_t(s) * H, canary.data(), tail, H, s))
                return false;
        }
        if (c.backward) {
            const uint16_t* gg = g.recv_gx.data() + kc * H;
            if (!compare_words("combine-backward recv", r, gg, h.recv_gx.data(), end * H, H)) return false;
            if (!compare_words("dispatch-backward out", r, g.gx.data(), h.gx.data(), int64_t(s) * H, H)) return false;
            // combine_grad writes every one of the NvS rows (zeros outside real rows) and nothing around them.
            const uint16_t* ggy = g.grad_y.data() + kc * H;
            if (!compare_words("combine_grad grad_y", r, ggy, h.grad_y.data(), nvs * H, H)) return false;
            if (!compare_words("combine_grad grad_weights", r, g.grad_w.data() + kc, h.grad_w.data(), nvs, 1))
                return false;
            std::vector<uint16_t> canary(size_t(kc * H), DeviceCase::kCanary);
            if (!compare_words("combine_grad grad_y canary before", r, g.grad_y.data(), canary.data(), kc * H, H,
                               -kc) ||
                !compare_words("combine_grad grad_y canary after", r, ggy + nvs * H, canary.data(), kc * H, H, nvs))
                return false;
            const std::vector<uint32_t> canary_w(size_t(kc), DeviceCase::kCanaryF32);
            const auto* gw_bits = reinterpret_cast<const uint32_t*>(g.grad_w.data());
            if (!compare_words("combine_grad grad_weights canary before", r, gw_bits, canary_w.data(), kc, 1, -kc) ||
                !compare_words("combine_grad grad_weights canary after", r, gw_bits + kc + nvs, canary_w.data(), kc, 1,
                               nvs))
                return false;
            // write_grads: own groups, used slots; untouched slots keep the canary on both backends.
            const int64_t ge = 2 * int64_t(l.experts_per_rank) * c.grads_elems;
            if (!compare_words("write_grads bf16", r, g.wgrads16.data(), h.wgrads16.data(), ge, c.grads_elems) ||
                !compare_words("write_grads fp32", r, g.wgrads32.data(), h.wgrads32.data(), ge, c.grads_elems))
                return false;
        }
        const int64_t pe = int64_t(l.experts_per_rank) * c.expert_elems;
        if (!compare_words("prefetch slot pool", r, g.slot_pool.data(), h.slot_pool.data(), pe, c.expert_elems))
            return false;
        if (!compare_words("prefetch pull slot pool", r, g.pull_pool.data(), h.slot_pool.data(), pe, c.expert_elems))
            return false;
        if (!compare_words("reduce_grad grads", r, g.grads.data(), h.grads.data(), pe, c.expert_elems)) return false;
        if (!compare_words("reduce_grad pool", r, g.red_pool.data(), h.red_pool.data(), pe, c.expert_elems))
            return false;
    }
    return true;
}

bool check_wait_records(testing::LocalDeviceGroup& group) {
    for (int r = 0; r < group.num_ranks(); ++r) {
        const sync::WaitRecord& w = group.wait_record(r);
        if (w.code != 0) {
            char buf[200];
            std::snprintf(buf, sizeof(buf), "timeout: op %d rank %d waited for peer %d (expected %llu observed %llu)",
                          w.op, w.rank, w.peer, (unsigned long long)w.expected, (unsigned long long)w.observed);
            g_first = buf;
            return false;
        }
    }
    return true;
}

// One step (or, with graph, a captured step replayed twice with new routing written into the same inputs).
bool run_case(const CaseSpec& c, bool graph, bool device_per_rank) {
    const Layout l = make_layout(c.config, c.planner);
    const char* timeout_env = std::getenv("FLATEP_GPU_TEST_TIMEOUT");
    testing::LocalDeviceGroup group(l.num_ranks, device_per_rank,
                                    timeout_env != nullptr ? std::atof(timeout_env) : 20.0);
    DeviceCase dev(c, l, group);
    const int replays = graph ? 2 : 1;
    cudaGraphExec_t exec = nullptr;
    cudaGraph_t graph_obj = nullptr;
    for (int rep = 0; rep < replays; ++rep) {
        const uint64_t seed = c.seed + 101 * rep;
        const StepInputs in = make_inputs(c, l, seed);
        const std::vector<RankOutputs> cpu = run_host(c, l, in);
        dev.upload(in);
        if (!graph) {
            dev.enqueue_step();
        } else {
            if (exec == nullptr) {
                // Capture every rank's stream into one graph: fork from stream 0, join back.
                cudaStream_t s0 = group.stream(0);
                cudaEvent_t fork, join[kMaxRanks];
                FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
                FLATEP_CUDA_CHECK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
                FLATEP_CUDA_CHECK(cudaEventRecord(fork, s0));
                for (int r = 1; r < l.num_ranks; ++r) FLATEP_CUDA_CHECK(cudaStreamWaitEvent(group.stream(r), fork));
                dev.enqueue_step();
                for (int r = 1; r < l.num_ranks; ++r) {
                    FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming));
                    FLATEP_CUDA_CHECK(cudaEventRecord(join[r], group.stream(r)));
                    FLATEP_CUDA_CHECK(cudaStreamWaitEvent(s0, join[r]));
                }
                FLATEP_CUDA_CHECK(cudaStreamEndCapture(s0, &graph_obj));
                FLATEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph_obj, 0));
            }
            FLATEP_CUDA_CHECK(cudaGraphLaunch(exec, group.stream(0)));
        }
        const std::vector<RankOutputs> gpu = dev.download();
        if (!check_wait_records(group)) return false;
        if (!compare_outputs(c, l, gpu, cpu)) {
            if (graph) g_first += " (graph replay " + std::to_string(rep) + ")";
            return false;
        }
    }
    if (exec != nullptr) {
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph_obj);
    }
    return true;
}

// The planner alone: random and adversarial count matrices, both GPU engines against the host planner, at small
// shapes, at the configs benchmarked, and at every shape of MoonEP's sweep (E=896, K 8 and 16, R 8 to 64); each in the
// training layout and, on fewer matrices, the serving layouts (B = 0 with pad rows, 1, 4) and the owner planner.
bool run_planner_sweep(int num_matrices) {
    struct Shape {
        int R, E, S, K, align;
        double cf;
        bool sweep = false;  // MoonEP's sweep: spread_counts, a fixed set of matrices, the serial engine once
    };
    // The last two take the candidate blocks' word-by-word fallbacks: E not a multiple of 4 (the counts' load with
    // the home allocation, the evaluation), and an odd R, whose shared-memory allocation is not 16-byte aligned.
    const Shape shapes[] = {{2, 8, 64, 2, 8, 1.0},       {4, 32, 256, 4, 16, 1.0},    {8, 384, 8192, 8, 128, 1.0},
                            {8, 64, 512, 6, 1, 1.25},    {8, 256, 4096, 8, 128, 1.0}, {16, 64, 128, 4, 4, 1.0},
                            {8, 384, 8192, 8, 128, 1.5}, {64, 128, 64, 4, 1, 1.0},    {2, 10, 64, 2, 4, 1.0},
                            {3, 12, 96, 3, 4, 1.0}};
    std::vector<Shape> all(std::begin(shapes), std::end(shapes));
    for (int R : {8, 16, 32, 64})
        for (int K : {8, 16}) all.push_back(Shape{R, 896, 8192, K, 128, 1.0, true});
    const int num_small = int(sizeof(shapes) / sizeof(shapes[0]));
    constexpr int kSweepMatrices = 7;  // sigmas 0, 0.5, 1, 2, 3, 1 (another seed), one hot expert set
    // Group layouts (Config::num_slots, view_stride = epn + stride_extra) and planner family.
    struct Variant {
        const char* name;
        int num_slots, stride_extra;
        bool owner;
    };
    const Variant variants[] = {{"", -1, 0, false},           {"serving B=0 Q=epn+3", 0, 3, false},
                                {"serving B=1", 1, 0, false}, {"serving B=4", 4, 0, false},
                                {"owner", -1, 0, true},       {"owner B=1 Q=epn+1", 1, 1, true}};
    int done = 0;
    std::map<std::string, int> done_by_path;
    for (const Shape& sh : all) {
        for (const Variant& var : variants) {
            const int epn = sh.E / sh.R;
            if (var.num_slots >= epn) continue;  // B = epn is the training layout
            Config cfg;
            cfg.num_ranks = sh.R;
            cfg.num_experts = sh.E;
            cfg.num_tokens = sh.S;
            cfg.topk = sh.K;
            cfg.hidden = 8;
            cfg.align = sh.align;
            cfg.capacity_factor = sh.cf;
            cfg.num_slots = var.num_slots;
            cfg.view_stride = var.stride_extra > 0 ? epn + var.stride_extra : 0;
            const Layout l = make_layout(cfg, var.owner ? PlannerKind::kOwner : PlannerKind::kBalanced);
            const size_t words = size_t(make_plan_sizes(l).total_words);
            int32_t* d_plan = nullptr;
            void* ws = nullptr;
            FLATEP_CUDA_CHECK(cudaMalloc(&d_plan, words * 4));
            FLATEP_CUDA_CHECK(cudaMalloc(&ws, planner::planner_workspace_bytes(l)));
            const bool training = var.name[0] == '\0';
            const int per_training = sh.sweep ? kSweepMatrices : num_matrices / num_small + 1;
            const int per_shape = training ? per_training : sh.sweep ? 2 : std::max(2, per_training / 4);
            for (int m = 0; m < per_shape; ++m) {
                std::vector<int32_t> tpe;
                const double sigmas[] = {0.0, 0.5, 1.0, 2.0, 3.0};
                if (m % 7 == 6) {  // adversarial: every entry of every rank on one expert (K distinct per token)
                    tpe.assign(size_t(sh.R) * sh.E, 0);
                    for (int r = 0; r < sh.R; ++r)
                        for (int k = 0; k < sh.K; ++k) tpe[size_t(r) * sh.E + (m + k) % sh.E] = sh.S;
                } else if (sh.sweep) {
                    tpe = routing::spread_counts(sh.R, sh.E, sh.S, sh.K, m < 5 ? sigmas[m] : 1.0, 1000 + m);
                } else {
                    tpe = routing::generate_counts(sh.R, sh.E, sh.S, sh.K, sigmas[m % 5], 1000 + m);
                }
                for (int kind = var.owner ? 2 : 0; kind < (var.owner ? 3 : 2); ++kind) {
                    planner::HostPlan host(l);
                    std::copy(tpe.begin(), tpe.end(), host.view.tpe_all);
                    planner::plan_counts(l, PlannerKind(kind), host.view);
                    // The parallel engine under every placement of the balanced planner's candidate path that gives a
                    // distinct path at this shape (kShared off the candidate path: plan_alloc on one thread, sampled
                    // like the serial engine), then the serial engine.
                    const planner::PlannerPlacement placements[] = {
                        planner::PlannerPlacement::kAuto, planner::PlannerPlacement::kCountsGlobal,
                        planner::PlannerPlacement::kGlobal, planner::PlannerPlacement::kShared,
                        planner::PlannerPlacement::kAllocShared};
                    constexpr int kPlacements = int(sizeof(placements) / sizeof(placements[0]));
                    std::vector<std::string> paths_done;
                    for (int variant = 0; variant <= kPlacements; ++variant) {
                        const int engine = variant == kPlacements ? 1 : 0;
                        const bool slow_sample = sh.sweep ? m != 0 : sh.E > 64 && m % 3 != 0;
                        // The serial engine (one GPU thread) is slow: sampled.
                        if (engine == 1 && slow_sample) continue;
                        std::string path = "serial";
                        if (engine == 0) {
                            // The greedy and owner kinds have one parallel path.
                            if (kind != 1 && variant > 0) continue;
                            planner::set_planner_placement(placements[variant]);
                            path = kind != 1 ? planner_name(PlannerKind(kind)) : planner::planner_path_name(l);
                            if (std::find(paths_done.begin(), paths_done.end(), path) != paths_done.end()) continue;
                            if (path == "core" && slow_sample) continue;
                            paths_done.push_back(path);
                        }
                        std::vector<int32_t> init(words, 0);
                        std::copy(tpe.begin(), tpe.end(), init.begin() + make_plan_sizes(l).tpe_all);
                        FLATEP_CUDA_CHECK(cudaMemcpy(d_plan, init.data(), words * 4, cudaMemcpyHostToDevice));
                        planner::launch_planner(l, PlannerKind(kind), make_plan_view(l, d_plan), ws,
                                                planner::PlannerEngine(engine), nullptr);
                        planner::set_planner_placement(planner::PlannerPlacement::kAuto);
                        std::vector<int32_t> got(words);
                        FLATEP_CUDA_CHECK(cudaMemcpy(got.data(), d_plan, words * 4, cudaMemcpyDeviceToHost));
                        const PlanSizes ps = make_plan_sizes(l);
                        const int32_t* want = host.view.tpe_all;
                        for (int64_t w = 0; w < ps.entry_rank; ++w) {  // the global part
                            if (got[w] != want[w]) {
                                g_first = "planner (" + std::string(engine ? "serial" : "parallel") + " " + path +
                                          ", " + planner_name(PlannerKind(kind)) + (training ? "" : ", ") + var.name +
                                          ", R=" + std::to_string(sh.R) + " E=" + std::to_string(sh.E) +
                                          " S=" + std::to_string(sh.S) + " K=" + std::to_string(sh.K) + " matrix " +
                                          std::to_string(m) + "): " + plan_word_name(l, w) + " got " +
                                          std::to_string(got[w]) + " expected " + std::to_string(want[w]);
                                return false;
                            }
                        }
                        ++done;
                        ++done_by_path[training ? path : path + " (" + var.name + ")"];
                    }
                }
            }
            cudaFree(d_plan);
            cudaFree(ws);
        }
    }
    std::printf("  planner sweep: %d plans bitwise equal to the host planner (MoonEP's sweep shapes included):", done);
    for (const auto& [path, n] : done_by_path) std::printf(" %s %d;", path.c_str(), n);
    std::printf("\n");
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    // CUDA_MODULE_LOADING is left as the caller has it: LocalDeviceGroup loads every kernel first.
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    bool quick = false;
    std::string only;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) quick = true;
        if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) only = argv[++i];
    }
    struct Entry {
        CaseSpec spec;
        bool graph = false;
        bool device_per_rank = false;
        bool small = true;
    };
    std::vector<Entry> cases;
    auto add = [&](CaseSpec s, bool graph = false, bool small = true, bool dpr = false) {
        cases.push_back(Entry{s, graph, dpr, small});
    };
    {
        CaseSpec s;
        s.name = "r1_single_rank";
        s.config = make_config(1, 8, 128, 2, 64, 8);
        add(s);
        s.name = "r2_small_weighted";
        s.config = make_config(2, 8, 64, 2, 64, 8);
        add(s);
        s.name = "r4_slack_ragged_int64_zero_copy";
        s.config = make_config(4, 16, 200, 4, 128, 16, 1.25);
        s.num_tokens = 150;
        s.index_bytes = 8;
        s.weighted = false;
        s.separate_recv = false;
        s.sigma = 1.5;
        add(s);
        s = CaseSpec{};
        s.name = "r8_greedy_bad_ids";
        s.config = make_config(8, 64, 512, 8, 256, 128);
        s.planner = PlannerKind::kGreedy;
        s.routing = RoutingKind::kBadIds;
        s.sigma = 2.0;
        add(s);
        // More entries than counts_kernel takes in one block (8192): the general path's histogram over segments,
        // all-gather and routing over several blocks, with bad ids (r8_greedy_bad_ids takes the one-block path)
        s.name = "r8_greedy_bad_ids_segments";
        s.config = make_config(8, 64, 2048, 8, 128, 32);
        add(s);
        s = CaseSpec{};
        s.name = "r8_one_expert_k1";
        s.config = make_config(8, 64, 512, 1, 128, 32);
        s.routing = RoutingKind::kOneExpert;
        add(s);
        s.name = "r4_one_expert_k4";
        s.config = make_config(4, 32, 300, 4, 64, 16);
        add(s);
        s = CaseSpec{};
        s.name = "r4_skewed_h512";
        s.config = make_config(4, 32, 1024, 8, 512, 64);
        s.sigma = 3.0;
        add(s);
        s = CaseSpec{};
        s.name = "r4_graph_fwd_bwd";
        s.config = make_config(4, 32, 256, 4, 128, 16);
        s.backward = true;
        s.sigma = 1.0;
        add(s, /*graph=*/true);
        s.name = "r8_graph_fwd_bwd_slack";
        s.config = make_config(8, 64, 512, 8, 256, 32, 1.25);
        s.sigma = 2.5;
        add(s, /*graph=*/true);
        s = CaseSpec{};
        s.name = "r4_bwd_h264_odd_grads";  // 33 chunks per row (combine_grad), write_grads' element-wise kernel
        s.config = make_config(4, 32, 200, 4, 264, 8, 1.25);
        s.num_tokens = 170;
        s.backward = true;
        s.sigma = 2.0;
        s.grads_elems = 1003;
        add(s);
        // write_grads' grid-stride walk over all groups as one index space: more elements than the capped grid has
        // threads, so a thread carries its position from group to group (entering skipped and zeroed groups too),
        // with 8-element steps and element by element
        s = CaseSpec{};
        s.name = "r4_bwd_write_grads_walk_vec";
        s.config = make_config(4, 32, 256, 4, 128, 16);
        s.backward = true;
        s.sigma = 3.0;
        s.grads_elems = 65544;  // 8193 steps of 8 per group: 16 groups over 66 blocks x 512 threads, ~3.9 items each
        add(s);
        s.name = "r4_bwd_write_grads_walk_scalar";
        s.grads_elems = 20011;  // ~9.5 elements per thread
        add(s);
        s = CaseSpec{};
        s.name = "r4_decode_h7168_row_slices";  // 64 of S=1024 tokens: dispatch's push and combine's pull split rows
        s.config = make_config(4, 32, 1024, 8, 7168, 128);
        s.num_tokens = 64;
        s.sigma = 1.0;
        s.backward = true;
        add(s);
        s = CaseSpec{};
        s.name = "r8_deepep_like_h7168";
        s.config = make_config(8, 256, 1024, 8, 7168, 128);
        s.sigma = 0.0;
        add(s, false, false);
        s = CaseSpec{};
        s.name = "r8_moonep_s8192_e384_h7168_k8";
        s.config = make_config(8, 384, 8192, 8, 7168, 128);
        s.sigma = 1.0;
        s.expert_elems = 4096;
        add(s, false, false);
        s.name = "r8_moonep_one_expert";
        s.routing = RoutingKind::kOneExpert;
        s.weighted = false;
        add(s, false, false);
        // Serving layouts (forward: write_grads is training-only) and the owner planner: plan, dispatch, combine,
        // prefetch of the B slots, bitwise against the CPU backend.
        s = CaseSpec{};
        s.name = "r4_serving_b1_skewed";
        s.config = make_config(4, 32, 256, 4, 128, 16);
        s.config.num_slots = 1;
        s.sigma = 2.5;
        add(s);
        s.name = "r8_serving_b0_pad_rows_ragged";
        s.config = make_config(8, 64, 512, 8, 256, 32);
        s.config.num_slots = 0;
        s.config.view_stride = 9;
        s.num_tokens = 300;
        s.sigma = 2.0;
        add(s);
        s = CaseSpec{};
        s.name = "r8_serving_b4_graph";
        s.config = make_config(8, 64, 512, 8, 256, 16);
        s.config.num_slots = 4;
        s.sigma = 3.0;
        add(s, /*graph=*/true);
        s = CaseSpec{};
        s.name = "r4_owner_fwd_bwd";
        s.config = make_config(4, 32, 64, 4, 128, 16);
        s.planner = PlannerKind::kOwner;
        s.sigma = 1.5;
        s.backward = true;
        add(s);
        s = CaseSpec{};
        s.name = "r8_owner_decode_view_b1_graph";
        s.config = make_config(8, 64, 128, 8, 256, 8);
        s.config.num_slots = 1;
        s.planner = PlannerKind::kOwner;
        s.num_tokens = 16;
        s.sigma = 2.0;
        add(s, /*graph=*/true);
        if (num_devices >= 2) {
            s = CaseSpec{};
            s.name = "r2_gpu_per_rank";
            s.config = make_config(2, 16, 512, 4, 256, 16);
            add(s, false, true, true);
        }
    }
    int failed = 0, run = 0;
    if (only.empty() || only == "planner_sweep") {
        ++run;
        bool ok = false;
        try {
            ok = run_planner_sweep(quick ? 40 : 400);
        } catch (const std::exception& e) {
            g_first = e.what();
        }
        std::printf("%s planner_sweep%s%s\n", ok ? "PASS" : "FAIL", ok ? "" : ": ", ok ? "" : g_first.c_str());
        if (!ok) ++failed;
    }
    for (const Entry& e : cases) {
        if (!only.empty() && only != e.spec.name) continue;
        if (quick && !e.small) continue;
        ++run;
        g_first.clear();
        bool ok = false;
        try {
            ok = run_case(e.spec, e.graph, e.device_per_rank);
        } catch (const std::exception& ex) {
            g_first = ex.what();
        }
        std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", e.spec.name.c_str(), ok ? "" : ": ",
                    ok ? "" : g_first.c_str());
        if (!ok) {
            std::printf("  reproduce: test_gpu_ops --case %s\n", e.spec.name.c_str());
            ++failed;
        }
        std::fflush(stdout);
    }
    std::printf("%d of %d cases passed\n", run - failed, run);
    return failed == 0 ? 0 : 1;
}
