// L1/L1b GPU tests: every op through the public Buffer and ExpertPools, R virtual ranks on one GPU (and one rank per
// GPU where several exist), bitwise against the same step on the CPU backend; and the GPU planner alone against the
// host planner. Plain main (the device machine has no GoogleTest): prints PASS/FAIL per case with the first
// mismatch, returns non-zero on failure, exits 0 with "SKIP: no CUDA device" where no GPU exists.
//
//   test_gpu_ops            all cases
//   test_gpu_ops --quick    the small cases only (compute-sanitizer runs)
//   test_gpu_ops --case NAME
//   test_gpu_ops --cpu      the step's "device" side on the CPU backend too (the harness itself; no GPU needed)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gpu_harness.hpp"
#include "planner/gpu_planner.cuh"

using namespace flatep;
using namespace flatep::gpu_test;

namespace {

std::string g_first;  // first mismatch of the current case

// One step of every op of a case on a World, through Buffer and ExpertPools: plan (device: into storage read back
// whole), write_grads (backward: a bf16 gradient, and an fp32 one with the bf16 one accumulated on top), dispatch,
// prefetch, combine; backward: dispatch of the output gradient, combine_grad, combine (dispatch's backward);
// reduce_grad. Serving layouts (B < epn) pull their B slots and have no gradients. Canary rows around every separate
// output must come back untouched.
class OpsStep {
  public:
    OpsStep(const CaseSpec& c, World& world, int view_stride)
        : c_(c),
          world_(world),
          serving_(c.view.num_slots >= 0 && c.view.num_slots < c.config.num_experts / c.config.num_ranks) {
        std::vector<ProjectionShape> shapes = {{1, c.expert_elems}};
        if (c.backward && !serving_) shapes.insert(shapes.end(), 2, ProjectionShape{1, c.grads_elems});
        for (RankObjects& o : make_rank_objects(world, c.config, c.view, c.planner, shapes, view_stride))
            ranks_.push_back(Rank{std::move(o)});
        const Buffer& b0 = *ranks_[0].buffer;
        const int64_t S = c.config.num_tokens, H = c.config.hidden, nvs = b0.num_recv_rows();
        const int64_t ge = 2 * int64_t(b0.experts_per_rank()) * c.grads_elems + 8;
        for (Rank& k : ranks_) {
            k.topk = world.alloc<int64_t>(S * c.config.topk);
            k.x = world.alloc<uint16_t>(S * H);
            k.weights = world.alloc<float>(S * c.config.topk);
            k.recv = world.alloc<uint16_t>((nvs + 2 * kCanaryRows) * H);
            k.recv_w = world.alloc<float>(nvs);
            k.y = world.alloc<uint16_t>(nvs * H);
            k.out = world.alloc<uint16_t>((S + kCanaryRows) * H);
            if (!c.backward) continue;
            k.gout = world.alloc<uint16_t>(S * H);
            k.recv_g = world.alloc<uint16_t>((nvs + 2 * kCanaryRows) * H);
            k.gy = world.alloc<uint16_t>(nvs * H);
            k.gx = world.alloc<uint16_t>((S + kCanaryRows) * H);
            k.grad_y = world.alloc<uint16_t>((nvs + 2 * kCanaryRows) * H);
            k.grad_w = world.alloc<float>(nvs + 2 * kCanaryRows);
            k.wgrad16 = world.alloc<uint16_t>(ge);
            k.wgrad32 = world.alloc<float>(ge);
        }
    }
    ~OpsStep() { world_.synchronize(); }  // the kernels done before the memory goes
    int view_stride() const { return ranks_[0].buffer->view_stride(); }

    // The inputs of a step (seeded; the same on every World) into the world's memory, canaries around the outputs.
    void upload(uint64_t seed) {
        const std::vector<std::vector<int64_t>> topk = make_routing(c_, seed);
        const int s = c_.tokens_of(), K = c_.config.topk, epn = ranks_[0].buffer->experts_per_rank();
        const int64_t H = c_.config.hidden, S = c_.config.num_tokens, nvs = ranks_[0].buffer->num_recv_rows();
        for (int r = 0; r < world_.num_ranks(); ++r) {
            Rank& k = ranks_[size_t(r)];
            const uint64_t base = seed * 1000 + uint64_t(r) * 16;
            if (c_.index_bytes == 8) {
                world_.put(k.topk, topk[size_t(r)]);
            } else {
                world_.put(reinterpret_cast<int32_t*>(k.topk),
                           std::vector<int32_t>(topk[size_t(r)].begin(), topk[size_t(r)].end()));
            }
            if (k.storage != nullptr) world_.fill(k.storage, k.buffer->plan_words(), 0);
            world_.put(k.x, random_bf16(s * H, base + 1));
            world_.put(k.weights, random_f32(int64_t(s) * K, base + 2, -1.f, 1.f));
            world_.put(k.y, random_bf16(nvs * H, base + 3));
            world_.fill(k.recv, (nvs + 2 * kCanaryRows) * H, kCanary);
            world_.fill(k.recv_w, nvs, 0.0f);
            world_.fill(k.out, (S + kCanaryRows) * H, kCanary);
            for (int p = 0; p < k.pools->num_projections(); ++p) {  // slots empty, and (training) the gradients
                const int64_t n = k.pools->shape(p).elems();
                if (k.pools->num_slots() > 0) world_.fill(k.pools->slot_pool(p), k.pools->num_slots() * n, uint16_t(0));
                if (p == 0) world_.put(k.layer.own_weights(0), random_bf16(epn * n, base + 6));
                if (p == 0 && !serving_) world_.put(k.layer.own_grads(0), random_f32(epn * n, base + 7, -1.f, 1.f));
                if (p == 0 && !serving_) world_.put(k.pools->reduce_pool(0), random_f32(epn * n, base + 8, -1.f, 1.f));
                if (p > 0) world_.fill(k.layer.grads(p), 2 * epn * n, canary_f32());  // untouched slots keep it
            }
            if (!c_.backward) continue;
            world_.put(k.gout, random_bf16(s * H, base + 4));
            world_.put(k.gy, random_bf16(nvs * H, base + 5));
            world_.fill(k.recv_g, (nvs + 2 * kCanaryRows) * H, kCanary);
            world_.fill(k.gx, (S + kCanaryRows) * H, kCanary);
            world_.fill(k.grad_y, (nvs + 2 * kCanaryRows) * H, kCanary);
            world_.fill(k.grad_w, nvs + 2 * kCanaryRows, canary_f32());
            const int64_t ge = 2 * int64_t(epn) * c_.grads_elems;
            world_.put(grad16(k), random_bf16(ge, base + 9));
            world_.put(grad32(k), random_f32(ge, base + 10, -1.f, 1.f));
        }
    }

    // Every rank's ops (device: enqueued, capturable). Bad ids: every rank's status read after the plan (a
    // synchronising point, so not in a graph), as the CPU backend reports them after its plan.
    void run() {
        world_.run([&](int r) { plan(r); });
        if (c_.routing == RoutingKind::kBadIds) {
            world_.synchronize();
            world_.run(
                [&](int r) { ranks_[size_t(r)].status = status_of(*ranks_[size_t(r)].buffer, world_.launch(r)); });
        }
        world_.run([&](int r) { ops(r); });
    }

    Outputs download() {
        world_.synchronize();
        Outputs outs(size_t(world_.num_ranks()));
        const int64_t H = c_.config.hidden, S = c_.config.num_tokens, nvs = ranks_[0].buffer->num_recv_rows();
        for (int r = 0; r < world_.num_ranks(); ++r) {
            Rank& k = ranks_[size_t(r)];
            std::vector<Blob>& o = outs[size_t(r)];
            const std::string status = k.status.empty() ? status_of(*k.buffer, world_.launch(r)) : k.status;
            o.push_back(blob("status", std::vector<char>(status.begin(), status.end()), 1));
            const std::vector<int32_t> words = plan_words(world_, *k.buffer, k.plan, k.storage);
            o.push_back(blob("plan", words, int64_t(words.size())));
            const int num_groups = k.buffer->num_groups();
            const int64_t end = make_plan_view(internal::layout(*k.buffer), const_cast<int32_t*>(words.data()))
                                    .cu_seqlens[int64_t(r) * num_groups + num_groups - 1];
            if (c_.separate_recv) {
                o.push_back(
                    blob("dispatch recv_x (canary rows around)", world_.get(k.recv, (nvs + 2 * kCanaryRows) * H), H));
            } else {  // zero copy: rows past the last group end hold what the region held
                o.push_back(blob("dispatch recv_x", world_.get(k.buffer->symmetric_recv_x(), end * H), H));
            }
            o.push_back(blob("dispatch recv_w", world_.get(k.recv_w, nvs), 1));
            o.push_back(blob("combine out (canary rows past s)", world_.get(k.out, (S + kCanaryRows) * H), H));
            if (c_.backward) {
                o.push_back(blob("combine-backward recv", world_.get(k.recv_g, (nvs + 2 * kCanaryRows) * H), H));
                o.push_back(blob("dispatch-backward out", world_.get(k.gx, (S + kCanaryRows) * H), H));
                o.push_back(blob("combine_grad grad_y", world_.get(k.grad_y, (nvs + 2 * kCanaryRows) * H), H));
                o.push_back(blob("combine_grad grad_weights", world_.get(k.grad_w, nvs + 2 * kCanaryRows), 1));
            }
            for (int p = 0; p < k.pools->num_projections(); ++p) {
                const int64_t n = k.pools->shape(p).elems(), epn = k.pools->experts_per_rank();
                const std::string at = " of projection " + std::to_string(p);
                o.push_back(
                    blob("prefetch slot pool" + at, world_.get(k.pools->slot_pool(p), k.pools->num_slots() * n), n));
                if (serving_) continue;
                o.push_back(
                    blob("write_grads / reduce_grad own grads" + at, world_.get(k.layer.own_grads(p), epn * n), n));
                o.push_back(blob("reduce_grad pool" + at, world_.get(k.pools->reduce_pool(p), epn * n), n));
            }
        }
        return outs;
    }

    const Layout& layout() const { return internal::layout(*ranks_[0].buffer); }

  private:
    struct Rank : RankObjects {
        std::string status;
        int64_t* topk = nullptr;
        uint16_t *x = nullptr, *recv = nullptr, *y = nullptr, *out = nullptr, *gout = nullptr, *recv_g = nullptr;
        uint16_t *gy = nullptr, *gx = nullptr, *grad_y = nullptr, *wgrad16 = nullptr;
        float *weights = nullptr, *recv_w = nullptr, *grad_w = nullptr, *wgrad32 = nullptr;
    };
    // The gradients write_grads reads: one element past an aligned start when the case wants them misaligned.
    uint16_t* grad16(Rank& k) const { return k.wgrad16 + (c_.misaligned_grads ? 1 : 0); }
    float* grad32(Rank& k) const { return k.wgrad32 + (c_.misaligned_grads ? 1 : 0); }

    void plan(int r) {
        Rank& k = ranks_[size_t(r)];
        k.status.clear();
        k.plan = k.buffer->plan(k.topk, c_.index_bytes, c_.tokens_of(), k.storage, world_.launch(r));
    }
    void ops(int r) {
        Rank& k = ranks_[size_t(r)];
        Buffer& b = *k.buffer;
        const Launch L = world_.launch(r);
        const int64_t H = c_.config.hidden;
        uint16_t* recv_x = c_.separate_recv ? k.recv + kCanaryRows * H : b.symmetric_recv_x();
        if (c_.backward && !serving_) {  // local, right after the plan
            k.pools->write_grads(k.plan, k.layer, 1, grad16(k), 2, false, L);
            k.pools->write_grads(k.plan, k.layer, 2, grad32(k), 4, false, L);
            k.pools->write_grads(k.plan, k.layer, 2, grad16(k), 2, true, L);  // accumulated on top
        }
        b.dispatch(k.plan, k.x, c_.weighted ? k.weights : nullptr, recv_x, k.recv_w, L);
        k.pools->prefetch(k.plan, k.layer, L);
        b.combine(k.plan, k.y, c_.weighted ? k.recv_w : nullptr, k.out, L);
        if (c_.backward) {
            uint16_t* recv_g = k.recv_g + kCanaryRows * H;
            b.dispatch(k.plan, k.gout, nullptr, recv_g, nullptr, L);
            // y = the forward's rows when they are separate (past the last group end they hold NaN canaries that
            // must not be read).
            b.combine_grad(k.plan, recv_g, c_.separate_recv ? recv_x : k.y, k.recv_w, k.grad_y + kCanaryRows * H,
                           k.grad_w + kCanaryRows, L);
            b.combine(k.plan, k.gy, nullptr, k.gx, L);
        }
        if (!serving_) k.pools->reduce_grad(k.plan, k.layer, L);
    }

    CaseSpec c_;
    World& world_;
    bool serving_;
    std::vector<Rank> ranks_;
};

// Both sides' outputs: the status each rank's check_status reports, the plan words (the first difference named by
// its array), then every output.
bool compare_outputs(const Layout& l, const Outputs& got, const Outputs& want) {
    for (size_t r = 0; r < want.size(); ++r) {
        const std::string gs(got[r][0].bytes.begin(), got[r][0].bytes.end());
        const std::string ws(want[r][0].bytes.begin(), want[r][0].bytes.end());
        if (gs != ws) {
            g_first = "status of rank " + std::to_string(r) + ": '" + gs + "', expected '" + ws + "'";
            return false;
        }
        const std::vector<uint8_t>&g = got[r][1].bytes, &w = want[r][1].bytes;
        for (size_t i = 0; i < w.size() && i < g.size(); i += 4) {
            if (std::memcmp(&g[i], &w[i], 4) == 0) continue;
            int32_t gv, wv;
            std::memcpy(&gv, &g[i], 4);
            std::memcpy(&wv, &w[i], 4);
            g_first = "plan: rank " + std::to_string(r) + " " + plan_word_name(l, int64_t(i / 4)) + ": got " +
                      std::to_string(gv) + " expected " + std::to_string(wv);
            return false;
        }
    }
    g_first = compare(got, want);
    return g_first.empty();
}

// One step (with graph: captured on the first and replayed with new routing written into the same inputs), the
// "device" side on the GPU (or, with --cpu, on the CPU backend), against a fresh CPU-backend world each step.
bool run_case(const CaseSpec& c, bool graph, bool device_per_rank, bool cpu) {
    std::vector<int> devices;
    for (int d = 0; device_per_rank && d < c.config.num_ranks; ++d) devices.push_back(d);
    World world(c.config.num_ranks, !cpu, devices);
    OpsStep dev(c, world, 0);  // the smallest view stride the world's pools allow
    cudaGraphExec_t exec = nullptr;
    for (int rep = 0; rep < (graph ? 2 : 1); ++rep) {
        const uint64_t seed = c.seed + 101 * rep;
        World host_world(c.config.num_ranks, false);
        OpsStep host(c, host_world, dev.view_stride());  // the device pools' view stride: the same groups
        host.upload(seed);
        host.run();
        dev.upload(seed);
        if (graph && !cpu) {
            if (exec == nullptr) exec = world.capture([&] { dev.run(); });
            world.replay(exec);
        } else {
            dev.run();
        }
        if (!compare_outputs(dev.layout(), dev.download(), host.download())) {
            if (graph) g_first += " (graph replay " + std::to_string(rep) + ")";
            return false;
        }
    }
    if (exec != nullptr) cudaGraphExecDestroy(exec);
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
    // Group layouts (ViewShape: num_slots, view_stride = epn + stride_extra) and planner family.
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
            const ViewShape view{var.num_slots, var.stride_extra > 0 ? epn + var.stride_extra : 0};
            const Layout l = make_layout(cfg, var.owner ? PlannerKind::kOwner : PlannerKind::kBalanced, view);
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
    bool quick = false, cpu = false;
    std::string only;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) quick = true;
        if (std::strcmp(argv[i], "--cpu") == 0) cpu = true;
        if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) only = argv[++i];
    }
    int num_devices = 0;
    if (!cpu && (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0)) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
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
        s.grads_elems = 1000;
        s.misaligned_grads = true;
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
        s.grads_elems = 20008;  // ~9.5 elements per thread
        s.misaligned_grads = true;
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
        s.view.num_slots = 1;
        s.sigma = 2.5;
        add(s);
        s.name = "r8_serving_b0_pad_rows_ragged";
        s.config = make_config(8, 64, 512, 8, 256, 32);
        s.view.num_slots = 0;  // pad rows between the ranks' view rows where the mapping granularity needs them
        s.num_tokens = 300;
        s.sigma = 2.0;
        add(s);
        s = CaseSpec{};
        s.name = "r8_serving_b4_graph";
        s.config = make_config(8, 64, 512, 8, 256, 16);
        s.view.num_slots = 4;
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
        s.view.num_slots = 1;
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
    if (!cpu && (only.empty() || only == "planner_sweep")) {
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
            ok = run_case(e.spec, e.graph, e.device_per_rank, cpu);
        } catch (const std::exception& ex) {
            g_first = ex.what();
        }
        std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", e.spec.name.c_str(), ok ? "" : ": ",
                    ok ? "" : g_first.c_str());
        if (!ok) {
            std::printf("  reproduce: test_gpu_ops --case %s%s\n", e.spec.name.c_str(), cpu ? " --cpu" : "");
            ++failed;
        }
        std::fflush(stdout);
    }
    std::printf("%d of %d cases passed%s\n", run - failed, run, cpu ? " (both sides on the CPU backend)" : "");
    return failed == 0 ? 0 : 1;
}
