// Per-op benchmark of the CUDA data plane, R virtual ranks on one GPU (design §9): MoonEP config at maxvio
// 0.2/1/10/20 and the DeepEP config. Per op: median time over many iterations (CUDA events, after warm-up) from a
// common start of all ranks to the end of the last, bytes moved per rank (each byte read or written in device
// memory once, local rows included), aggregate bandwidth over all ranks against a device-to-device copy measured in
// the same run. Planner: the planner kernel alone and the whole plan op. CSV out.
//
//   ops_bench [--csv out.csv] [--iters 20] [--warmup 3] [--hp 1024] [--quick] [--config moonep|deepep]
//             [--planner-only [--planner-profile] [--maxvio 0.2,1,10,20,-1] [--seeds 3]]
// --planner-only: only the planner kernels on the host-generated counts of each config (--maxvio: the MoonEP config's
// maxvio targets, -1 = the DeepEP config; --seeds: routings per target) (no data plane, no cross-rank
// barrier, so it also runs under a kernel profiler), graph-timed, with the plan's P and replicas.
// --planner-profile: also where the planner's time goes, from device stamps (kernels::set_planner_profile): for each
// config, medians over a graph of 10 back-to-back planners of the kernels' spans and of the phases of the candidate
// blocks, the greedy block and select_derive_kernel, the slowest candidates, and the greedy planner kind's phases.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "gpu_harness.hpp"

using namespace flatep;
using namespace flatep::gpu_test;

namespace {

__global__ void fill_bf16_kernel(uint16_t* dst, int64_t n, uint64_t seed) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        uint64_t z = seed * 0x9e3779b97f4a7c15ull + uint64_t(i);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        dst[i] = uint16_t(((z & 1) << 15) | ((110 + (z >> 1) % 23) << 7) | ((z >> 8) & 0x7f));
    }
}
void fill_device_bf16(void* dst, int64_t n, uint64_t seed) {
    fill_bf16_kernel<<<1024, 256>>>(static_cast<uint16_t*>(dst), n, seed);
    FLATEP_CUDA_CHECK_LAUNCH();
}

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Median time (us) of `op` enqueued on every rank stream, from a common start to the last rank's end.
struct Timing {
    float median_us, min_us;
};
Timing time_op(LocalDeviceGroup& group, int iters, int warmup, const std::function<void()>& op) {
    const int R = group.num_ranks();
    cudaStream_t s0 = group.stream(0);
    cudaEvent_t start, stop, fork, join[kMaxRanks];
    FLATEP_CUDA_CHECK(cudaEventCreate(&start));
    FLATEP_CUDA_CHECK(cudaEventCreate(&stop));
    FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    for (int r = 0; r < R; ++r) FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming));
    std::vector<float> times;
    for (int it = 0; it < warmup + iters; ++it) {
        group.synchronize();
        FLATEP_CUDA_CHECK(cudaEventRecord(start, s0));
        FLATEP_CUDA_CHECK(cudaEventRecord(fork, s0));
        for (int r = 1; r < R; ++r) FLATEP_CUDA_CHECK(cudaStreamWaitEvent(group.stream(r), fork));
        op();
        for (int r = 1; r < R; ++r) {
            FLATEP_CUDA_CHECK(cudaEventRecord(join[r], group.stream(r)));
            FLATEP_CUDA_CHECK(cudaStreamWaitEvent(s0, join[r]));
        }
        FLATEP_CUDA_CHECK(cudaEventRecord(stop, s0));
        FLATEP_CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        FLATEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (it >= warmup) times.push_back(ms * 1000.f);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaEventDestroy(fork);
    for (int r = 0; r < R; ++r) cudaEventDestroy(join[r]);
    return Timing{median(times), *std::min_element(times.begin(), times.end())};
}

// Device time of a single-stream op without host launch latency: `batch` launches of op captured in one CUDA graph,
// the graph replayed; per-op time = replay time / batch (kernel-to-kernel gaps inside the graph included).
Timing time_graph(cudaStream_t stream, int iters, int warmup, int batch, const std::function<void()>& op) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    FLATEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < batch; ++i) op();
    FLATEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FLATEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t start, stop;
    FLATEP_CUDA_CHECK(cudaEventCreate(&start));
    FLATEP_CUDA_CHECK(cudaEventCreate(&stop));
    std::vector<float> times;
    for (int it = 0; it < warmup + iters; ++it) {
        FLATEP_CUDA_CHECK(cudaEventRecord(start, stream));
        FLATEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        FLATEP_CUDA_CHECK(cudaEventRecord(stop, stream));
        FLATEP_CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        FLATEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (it >= warmup) times.push_back(ms * 1000.f / float(batch));
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return Timing{median(times), *std::min_element(times.begin(), times.end())};
}

double copy_bandwidth_gbps(int iters) {
    const size_t bytes = size_t(4) << 30;
    void *a = nullptr, *b = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&a, bytes));
    FLATEP_CUDA_CHECK(cudaMalloc(&b, bytes));
    fill_device_bf16(a, int64_t(bytes / 2), 7);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> times;
    for (int it = 0; it < iters + 2; ++it) {
        cudaEventRecord(e0);
        FLATEP_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (it >= 2) times.push_back(ms);
    }
    cudaFree(a);
    cudaFree(b);
    return 2.0 * double(bytes) / (double(median(times)) * 1e-3) / 1e9;  // read + write
}

struct Bytes {
    double dispatch = 0, combine = 0;  // all ranks together
    double dispatch_remote_rows = 0;
};

// Bytes the ops must move, from the plans (zero-copy recv: the symmetric region is the output).
Bytes count_bytes(const Layout& l, const std::vector<RankOutputs>& outs, int num_tokens, bool weighted) {
    Bytes b;
    const double row = double(l.row_bytes());
    for (int r = 0; r < l.num_ranks; ++r) {
        const PlanView p = make_plan_view(l, const_cast<int32_t*>(outs[r].plan.data()));
        int64_t pairs = 0, remote = 0;
        for (int t = 0; t < num_tokens; ++t) {
            for (int k = 0; k < l.topk; ++k) {
                const int d = p.entry_rank[t * l.topk + k];
                if (d < 0) continue;
                bool seen = false;
                for (int k0 = 0; k0 < k && !seen; ++k0) seen = p.entry_rank[t * l.topk + k0] == d;
                if (!seen) {
                    ++pairs;
                    if (d != r) ++remote;
                }
            }
        }
        int64_t real = 0, heads = 0, pad = 0;
        const int32_t* cu = p.cu_seqlens + int64_t(r) * l.num_groups();
        for (int g = 0; g < l.num_groups(); ++g) {
            const int32_t start = g == 0 ? 0 : cu[g - 1];
            for (int32_t row_idx = start; row_idx < cu[g]; ++row_idx) {
                if (p.row_head[row_idx] < 0) {
                    ++pad;
                } else {
                    ++real;
                    if (p.row_head[row_idx] == row_idx) ++heads;
                }
            }
        }
        const int64_t dups = real - heads;
        b.dispatch += num_tokens * row + pairs * row + 2.0 * dups * row + pad * row +
                      double(num_tokens) * l.topk * 4 * (weighted ? 2 : 1) + real * 4.0;
        b.combine += real * row + heads * row + pairs * row + num_tokens * row + (weighted ? real * 4.0 : 0);
        b.dispatch_remote_rows += remote;
    }
    return b;
}

Config make_config(int R, int E, int S, int K, int H) {
    Config c;
    c.num_ranks = R;
    c.num_experts = E;
    c.num_tokens = S;
    c.topk = K;
    c.hidden = H;
    c.align = 128;
    return c;
}

// --planner-profile: the stamps of kProfileBatch back-to-back planners captured in one graph (as timed above),
// replayed once to warm up and once more into cleared records.
constexpr int kProfileBatch = 10;
using kernels::PlannerProfileRecord;

std::vector<PlannerProfileRecord> profile_planner(const Layout& l, PlannerKind kind, const PlanView& view, void* ws,
                                                  cudaStream_t stream) {
    const kernels::PlannerProfileSlots slots = kernels::planner_profile_slots(l);
    const size_t count = size_t(slots.total) * kProfileBatch;
    PlannerProfileRecord* records = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&records, count * sizeof(PlannerProfileRecord)));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    FLATEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kProfileBatch; ++i) {
        kernels::set_planner_profile(records + size_t(i) * slots.total);
        kernels::launch_planner(l, kind, view, ws, kernels::PlannerEngine::kParallel, stream);
    }
    kernels::set_planner_profile(nullptr);
    FLATEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FLATEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    FLATEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FLATEP_CUDA_CHECK(cudaMemsetAsync(records, 0, count * sizeof(PlannerProfileRecord), stream));
    FLATEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<PlannerProfileRecord> host(count);
    FLATEP_CUDA_CHECK(cudaMemcpy(host.data(), records, count * sizeof(PlannerProfileRecord), cudaMemcpyDeviceToHost));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(records);
    return host;
}

// Phase times of the records: SM clock deltas (one SM per record, fine-grained) converted to ns with the clock rate
// fitted over all records against %globaltimer (whose resolution may be coarse), or the device's rated clock.
struct ProfileClock {
    double ns_per_cycle;
    double phase_us(const PlannerProfileRecord& r, int from, int to) const {
        if (r.globaltimer[from] == 0 || r.globaltimer[to] == 0) return 0;
        return double(r.clock[to] - r.clock[from]) * ns_per_cycle * 1e-3;
    }
};
ProfileClock fit_clock(const std::vector<PlannerProfileRecord>& recs, int last_stamp_candidate) {
    double ns = 0, cycles = 0;
    for (const PlannerProfileRecord& r : recs) {
        const int last =
            r.globaltimer[kernels::kStampDeriveEnd] != 0 ? int(kernels::kStampDeriveEnd) : last_stamp_candidate;
        if (r.globaltimer[0] == 0 || r.globaltimer[last] == 0) continue;
        const double span = double(r.globaltimer[last] - r.globaltimer[0]);
        if (span < 2000) continue;
        ns += span;
        cycles += double(r.clock[last] - r.clock[0]);
    }
    int khz = 0;
    cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
    const double rated = khz > 0 ? 1e6 / khz : 1.0;
    const double fitted = cycles > 0 ? ns / cycles : 0;
    // Trust the fit only when it is plausible (0.5x .. 2x of the rated clock).
    return ProfileClock{fitted > 0.5 * rated && fitted < 2 * rated ? fitted : rated};
}

double median_of(std::vector<double> v) { return v.empty() ? 0.0 : median(std::vector<float>(v.begin(), v.end())); }

// Prints a few lines: balanced planner spans and phases, the slowest candidates, the greedy planner kind's phases.
void print_planner_profile(const Layout& l, const std::vector<PlannerProfileRecord>& balanced,
                           const std::vector<PlannerProfileRecord>& greedy_kind) {
    using namespace kernels;
    const PlannerProfileSlots slots = planner_profile_slots(l);
    const ProfileClock clk = fit_clock(balanced, kStampEvaluated);
    // Values kept per planner run (medians printed): spans, then the phases of the greedy block, of the mean
    // candidate and of select_derive_kernel.
    // clang-format off
    enum { kCand, kGap, kSelect, kTotal, kBuilt, kRun, kGLoad, kGBuild, kGStore, kGEval, kGTotal, kCLoad, kCBuild,
           kCStore, kCEval, kCTotal, kEarly, kSLoad, kSSelect, kSCopy, kSRebuild, kSSums, kSSlots, kSRows, kSStats,
           kNum };
    // clang-format on
    std::vector<std::vector<double>> m(kNum);
    std::vector<std::vector<double>> per_index(size_t(slots.candidates));
    std::vector<int> kept(kProfileBatch, -2), counts(kProfileBatch, 0);
    for (int i = 0; i < kProfileBatch; ++i) {
        const PlannerProfileRecord* r = balanced.data() + size_t(i) * slots.total;
        const PlannerProfileRecord& g = r[slots.greedy];
        const PlannerProfileRecord& s = r[slots.select];
        unsigned long long first_in = g.globaltimer[kStampEntry], last_out = g.globaltimer[kStampEvaluated];
        double sum_load = 0, sum_build = 0, sum_store = 0, sum_eval = 0, sum_total = 0;
        int run = 0, built = 0;
        for (int c = 0; c < slots.candidates; ++c) {
            const PlannerProfileRecord& cr = r[c];
            if (cr.globaltimer[kStampEntry] == 0 || cr.globaltimer[kStampEvaluated] == 0) continue;
            first_in = std::min(first_in, cr.globaltimer[kStampEntry]);
            last_out = std::max(last_out, cr.globaltimer[kStampEvaluated]);
            ++run;
            built += cr.flags;
            sum_load += clk.phase_us(cr, kStampEntry, kStampLoaded);
            sum_build += clk.phase_us(cr, kStampLoaded, kStampBuilt);
            sum_store += clk.phase_us(cr, kStampBuilt, kStampStored);
            sum_eval += clk.phase_us(cr, kStampStored, kStampEvaluated);
            const double total = clk.phase_us(cr, kStampEntry, kStampEvaluated);
            sum_total += total;
            per_index[size_t(c)].push_back(total);
        }
        // select_derive_kernel may start early (programmatic launch) and wait: its part of the planner begins when
        // its wait returns.
        const unsigned long long waited = s.globaltimer[kStampSelWaited];
        m[kCand].push_back(double(last_out - first_in) * 1e-3);
        m[kGap].push_back(waited > last_out ? double(waited - last_out) * 1e-3 : 0.0);
        m[kSelect].push_back(clk.phase_us(s, kStampSelWaited, kStampDeriveEnd));
        m[kEarly].push_back(clk.phase_us(s, kStampEntry, kStampSelWaited));
        m[kTotal].push_back(double(s.globaltimer[kStampDeriveEnd] - first_in) * 1e-3);
        m[kBuilt].push_back(built);
        m[kRun].push_back(run);
        m[kGLoad].push_back(clk.phase_us(g, kStampEntry, kStampLoaded));
        m[kGBuild].push_back(clk.phase_us(g, kStampLoaded, kStampBuilt));
        m[kGStore].push_back(clk.phase_us(g, kStampBuilt, kStampStored));
        m[kGEval].push_back(clk.phase_us(g, kStampStored, kStampEvaluated));
        m[kGTotal].push_back(clk.phase_us(g, kStampEntry, kStampEvaluated));
        const double n = std::max(run, 1);
        m[kCLoad].push_back(sum_load / n);
        m[kCBuild].push_back(sum_build / n);
        m[kCStore].push_back(sum_store / n);
        m[kCEval].push_back(sum_eval / n);
        m[kCTotal].push_back(sum_total / n);
        const int stamps[] = {kStampSelWaited,  kStampSelLoaded,   kStampSelSelected, kStampSelCopied, kStampSelRebuilt,
                              kStampDeriveSums, kStampDeriveSlots, kStampDeriveRows,  kStampDeriveEnd};
        for (int k = 0; k < 8; ++k) m[size_t(kSLoad + k)].push_back(clk.phase_us(s, stamps[k], stamps[k + 1]));
        kept[size_t(i)] = s.index;
        counts[size_t(i)] = s.count;
    }
    auto md = [&](int k) { return median_of(m[size_t(k)]); };
    std::printf("  profile (median of %d): planner %.1f us = candidates %.1f (first block in -> last out) + gap %.1f",
                kProfileBatch, md(kTotal), md(kCand), md(kGap));
    std::printf(" (-> select's wait returns) + select_derive %.1f; %d of %d candidates built; kept #%d of %d;",
                md(kSelect), int(md(kBuilt)), int(md(kRun)), kept[0], counts[0]);
    std::printf(" clock %.2f GHz\n", 1.0 / clk.ns_per_cycle);
    std::printf("    greedy block %.1f us: load %.1f greedy %.1f store %.1f eval %.1f", md(kGTotal), md(kGLoad),
                md(kGBuild), md(kGStore), md(kGEval));
    std::printf(" | candidate mean %.1f us: load %.1f build %.1f store %.1f eval %.1f\n", md(kCTotal), md(kCLoad),
                md(kCBuild), md(kCStore), md(kCEval));
    std::vector<std::pair<double, int>> slow;
    for (int c = 0; c < slots.candidates; ++c)
        if (!per_index[size_t(c)].empty()) slow.push_back({median_of(per_index[size_t(c)]), c});
    std::sort(slow.begin(), slow.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::printf("    slowest candidates (index: us):");
    for (size_t k = 0; k < slow.size() && k < 6; ++k) std::printf(" #%d: %.1f", slow[k].second, slow[k].first);
    // Step traces of the three slowest candidates (last run of the batch): build start to every warp step
    // (WarpExec::single, sum, arg_max) to the build's end.
    const PlannerProfileRecord* last = balanced.data() + size_t(kProfileBatch - 1) * slots.total;
    for (size_t k = 0; k < slow.size() && k < 3; ++k) {
        const int c = slow[k].second;
        const PlannerProfileRecord& cr = last[c];
        if (cr.trace_count < 2) continue;
        std::printf("\n    trace #%d (%d events, %.1f us):", c, cr.trace_count - 2,
                    double(cr.trace[cr.trace_count - 1] - cr.trace[0]) * clk.ns_per_cycle * 1e-3);
        for (int k = 1; k < cr.trace_count; ++k)
            std::printf(" %.2f", double(cr.trace[k] - cr.trace[k - 1]) * clk.ns_per_cycle * 1e-3);
    }
    std::printf("\n    select_derive %.1f us (started %.1f us before): load %.1f select %.1f copy %.1f rebuild %.1f",
                md(kSelect), md(kEarly), md(kSLoad), md(kSSelect), md(kSCopy), md(kSRebuild));
    std::printf(" | derive pass %.1f stats %.1f\n", md(kSSums) + md(kSSlots) + md(kSRows), md(kSStats));
    // Inside select_derive (last run of the batch): the warp selection's phases (trace[4] its start, trace[0..3]
    // the ends of: path scan, lowest budget, budget scan, butterfly) and every derive warp's end of its tasks.
    const PlannerProfileRecord& sr = last[slots.select];
    if (sr.trace_count == 5) {
        std::printf("    select phases (us):");
        long long prev = sr.trace[4];
        for (int k = 0; k < 4; ++k) {
            std::printf(" %.2f", double(sr.trace[k] - prev) * clk.ns_per_cycle * 1e-3);
            prev = sr.trace[k];
        }
        std::printf("\n");
    }
    std::printf("    derive warps' ends (us after the pass starts):");
    for (int w = 0; w < 32; ++w)
        std::printf(" %.2f", double(sr.trace[8 + w] - sr.clock[kernels::kStampSelRebuilt]) * clk.ns_per_cycle * 1e-3);
    std::printf("\n");
    // Greedy planner kind: planner_parallel_kernel.
    const ProfileClock gclk = fit_clock(greedy_kind, kStampEvaluated);
    std::vector<std::vector<double>> gm(7);
    const int gstamps[] = {kStampEntry,       kStampSelLoaded,  kStampSelSelected, kStampDeriveSums,
                           kStampDeriveSlots, kStampDeriveRows, kStampDeriveEnd};
    for (int i = 0; i < kProfileBatch; ++i) {
        const PlannerProfileRecord& r = greedy_kind[size_t(i) * slots.total + size_t(slots.parallel)];
        for (int k = 0; k < 6; ++k) gm[size_t(k)].push_back(gclk.phase_us(r, gstamps[k], gstamps[k + 1]));
        gm[6].push_back(gclk.phase_us(r, kStampEntry, kStampDeriveEnd));
    }
    std::printf("    greedy kind %.1f us: home %.1f greedy %.1f | derive pass %.1f stats %.1f\n", median_of(gm[6]),
                median_of(gm[0]), median_of(gm[1]), median_of(gm[2]) + median_of(gm[3]) + median_of(gm[4]),
                median_of(gm[5]));
}

// Planner kernels alone on the counts of the MoonEP config (maxvio 0.2/1/10/20, 3 seeds) and the DeepEP config.
int planner_bench(int iters, int warmup, bool profile, const std::vector<double>& maxvios, int num_seeds) {
    std::printf("%-7s %6s %4s %8s %3s %4s %12s %12s\n", "config", "maxvio", "seed", "realised", "P", "reps",
                "balanced_us", "greedy_us");
    cudaStream_t stream = nullptr;
    FLATEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto layout_of = [](double mv) {
        return make_layout(mv < 0 ? make_config(8, 256, 4096, 8, 7168) : make_config(8, 384, 8192, 8, 7168));
    };
    // The routings' sigmas (a bisection each, seconds on the host) for every (maxvio, seed), searched in parallel.
    std::vector<std::future<double>> sigmas;
    for (double mv : maxvios) {
        for (uint64_t seed = 42; seed < 42 + uint64_t(num_seeds); ++seed) {
            const Layout l = layout_of(mv);
            sigmas.push_back(std::async(std::launch::async, [mv, seed, l] {
                return mv < 0 ? 0.0
                              : routing::sigma_for_maxvio(mv, l.num_ranks, l.num_experts, l.num_tokens, l.topk, seed);
            }));
        }
    }
    size_t next_sigma = 0;
    for (double mv : maxvios) {
        const Layout l = layout_of(mv);
        const size_t words = size_t(make_plan_sizes(l).total_words);
        int32_t* d_plan = nullptr;
        void* ws = nullptr;
        FLATEP_CUDA_CHECK(cudaMalloc(&d_plan, words * 4));
        FLATEP_CUDA_CHECK(cudaMalloc(&ws, kernels::plan_workspace_bytes(l)));
        for (uint64_t seed = 42; seed < 42 + uint64_t(num_seeds); ++seed) {
            const double sigma = sigmas[next_sigma++].get();
            const std::vector<int32_t> tpe =
                routing::generate_counts(l.num_ranks, l.num_experts, l.num_tokens, l.topk, sigma, seed);
            std::vector<int32_t> init(words, 0);
            std::copy(tpe.begin(), tpe.end(), init.begin() + make_plan_sizes(l).tpe_all);
            FLATEP_CUDA_CHECK(cudaMemcpy(d_plan, init.data(), words * 4, cudaMemcpyHostToDevice));
            const PlanView view = make_plan_view(l, d_plan);
            auto planner = [&](PlannerKind kind) {
                return [&, kind] {
                    kernels::launch_planner(l, kind, view, ws, kernels::PlannerEngine::kParallel, stream);
                };
            };
            const Timing greedy = time_graph(stream, iters, warmup, 10, planner(PlannerKind::kGreedy));
            const Timing balanced = time_graph(stream, iters, warmup, 10, planner(PlannerKind::kBalanced));
            FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
            std::vector<int32_t> out(words);
            FLATEP_CUDA_CHECK(cudaMemcpy(out.data(), d_plan, words * 4, cudaMemcpyDeviceToHost));
            const PlanStats& st = *make_plan_view(l, out.data()).stats;
            std::printf("%-7s %6.1f %4d %8.2f %3d %4d %12.1f %12.1f\n", mv < 0 ? "deepep" : "moonep", mv, int(seed),
                        routing::maxvio(tpe.data(), l.num_ranks, l.num_experts), st.makespan, st.total_replicas,
                        balanced.median_us, greedy.median_us);
            if (profile) {
                const auto greedy_kind = profile_planner(l, PlannerKind::kGreedy, view, ws, stream);
                const auto balanced_kind = profile_planner(l, PlannerKind::kBalanced, view, ws, stream);
                print_planner_profile(l, balanced_kind, greedy_kind);
            }
            std::fflush(stdout);
        }
        cudaFree(d_plan);
        cudaFree(ws);
    }
    cudaStreamDestroy(stream);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);  // see kernels::preload_all_kernels
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    std::string csv_path = "ops_bench.csv";
    int iters = 20, warmup = 3, hp = 1024;
    bool quick = false, planner_only = false, planner_profile = false;
    std::string only_config;  // --config moonep|deepep: that config's rows only
    std::vector<double> planner_maxvios = {0.2, 1.0, 10.0, 20.0, -1.0};  // -1: the DeepEP config
    int planner_seeds = 3;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--maxvio") && i + 1 < argc) {
            planner_maxvios.clear();
            std::string list = argv[++i];
            for (size_t at = 0; at <= list.size();) {
                const size_t comma = std::min(list.find(',', at), list.size());
                planner_maxvios.push_back(std::atof(list.substr(at, comma - at).c_str()));
                at = comma + 1;
            }
        }
        if (!std::strcmp(argv[i], "--seeds") && i + 1 < argc) planner_seeds = std::atoi(argv[++i]);
        if (!std::strcmp(argv[i], "--planner-only")) planner_only = true;
        if (!std::strcmp(argv[i], "--planner-profile")) planner_profile = true;
        if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv_path = argv[++i];
        if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
        if (!std::strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = std::atoi(argv[++i]);
        if (!std::strcmp(argv[i], "--hp") && i + 1 < argc) hp = std::atoi(argv[++i]);
        if (!std::strcmp(argv[i], "--quick")) quick = true;
        if (!std::strcmp(argv[i], "--config") && i + 1 < argc) only_config = argv[++i];
    }
    if (planner_only) return planner_bench(iters, warmup, planner_profile, planner_maxvios, planner_seeds);
    const double copy_gbps = copy_bandwidth_gbps(10);
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_gbps);
    FILE* csv = std::fopen(csv_path.c_str(), "w");
    FLATEP_CHECK_RUNTIME(csv != nullptr, "cannot open ", csv_path);
    std::fprintf(csv,
                 "config,maxvio_target,maxvio,op,time_us_median,time_us_min,bytes_per_rank,agg_GBps,copy_GBps,"
                 "ratio_to_copy,replicas,makespan\n");

    struct Bench {
        std::string name;
        Config config;
        double maxvio;  // < 0: uniform
    };
    std::vector<Bench> benches;
    for (double mv : {0.2, 1.0, 10.0, 20.0}) benches.push_back({"moonep", make_config(8, 384, 8192, 8, 7168), mv});
    benches.push_back({"deepep", make_config(8, 256, 4096, 8, 7168), -1.0});
    if (quick) benches = {{"moonep", make_config(8, 384, 8192, 8, 7168), 1.0}};
    if (!only_config.empty()) {
        std::erase_if(benches, [&](const Bench& b) { return b.name != only_config; });
        FLATEP_CHECK(!benches.empty(), "--config must be moonep or deepep, got '", only_config, "'");
    }

    std::printf("%-7s %6s %6s %-12s %10s %12s %9s %6s\n", "config", "target", "maxvio", "op", "median_us",
                "MB_per_rank", "agg_GB/s", "ratio");
    for (const Bench& bench : benches) {
        const Layout l = make_layout(bench.config);
        CaseSpec spec;
        spec.name = bench.name;
        spec.config = bench.config;
        spec.separate_recv = false;
        spec.weighted = true;
        spec.expert_elems = int64_t(l.hidden) * hp;
        spec.sigma = bench.maxvio < 0 ? 0.0
                                      : routing::sigma_for_maxvio(bench.maxvio, l.num_ranks, l.num_experts,
                                                                  l.num_tokens, l.topk, 42);
        spec.seed = 42;
        LocalDeviceGroup group(l.num_ranks, false, 30.0);
        DeviceCase dev(spec, l, group);
        // Inputs: routing from the generator; data random on the device (never zeros).
        const auto topk = make_routing(spec, spec.seed);
        std::vector<int32_t> all_counts(size_t(l.num_ranks) * l.num_experts, 0);
        for (int r = 0; r < l.num_ranks; ++r) {
            std::vector<int32_t> t32(topk[r].begin(), topk[r].end());
            for (int32_t e : t32) ++all_counts[size_t(r) * l.num_experts + e];
            auto& p = dev.ranks[r];
            FLATEP_CUDA_CHECK(cudaMemcpy(p.topk, t32.data(), t32.size() * 4, cudaMemcpyHostToDevice));
            fill_device_bf16(p.x, int64_t(l.num_tokens) * l.hidden, 100 + r);
            fill_device_bf16(p.weights, int64_t(l.num_tokens) * l.topk * 2, 200 + r);  // bf16 pairs: finite floats
            fill_device_bf16(p.y, int64_t(l.num_recv_rows) * l.hidden, 300 + r);
            fill_device_bf16(p.expert_w, int64_t(l.experts_per_rank) * spec.expert_elems, 400 + r);
            fill_device_bf16(p.grads, int64_t(l.experts_per_rank) * spec.expert_elems * 2, 500 + r);
            fill_device_bf16(dev.red_regions[r].local, int64_t(l.experts_per_rank) * spec.expert_elems * 2, 600 + r);
        }
        FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
        const double maxvio = routing::maxvio(all_counts.data(), l.num_ranks, l.num_experts);
        const int R = l.num_ranks;
        auto sync = [&](int r) {
            return group.sync_args(r, dev.regions, dev.sym.barrier_offset, dev.sym.status_offset);
        };
        auto plan_args = [&](int r) {
            PlanArgs a{};
            a.layout = l;
            a.rank = r;
            a.num_tokens = l.num_tokens;
            a.topk_idx = dev.ranks[r].topk;
            a.index_bytes = 4;
            a.planner = PlannerKind::kBalanced;
            for (int p = 0; p < R; ++p) a.peers[p] = dev.regions[r].peers[p];
            a.plan = make_plan_view(l, dev.ranks[r].plan);
            a.sync = sync(r);
            a.workspace = dev.ranks[r].workspace;
            return a;
        };
        auto dispatch_args = [&](int r) {
            DispatchArgs a{};
            a.layout = l;
            a.rank = r;
            a.x = dev.ranks[r].x;
            a.topk_weights = dev.ranks[r].weights;
            a.plan = make_plan_view(l, dev.ranks[r].plan);
            for (int p = 0; p < R; ++p) a.peers[p] = dev.regions[r].peers[p];
            a.recv_x = dev.ranks[r].recv_x;
            a.recv_w = dev.ranks[r].recv_w;
            a.sync = sync(r);
            return a;
        };
        auto combine_args = [&](int r) {
            CombineArgs a{};
            a.layout = l;
            a.rank = r;
            a.y = dev.ranks[r].y;
            a.weights = dev.ranks[r].recv_w;
            a.plan = make_plan_view(l, dev.ranks[r].plan);
            for (int p = 0; p < R; ++p) a.peers[p] = dev.regions[r].peers[p];
            a.out = dev.ranks[r].out_alloc;
            a.sync = sync(r);
            return a;
        };
        auto prefetch_args = [&](int r) {
            PrefetchArgs a{};
            a.rank = r;
            a.num_ranks = R;
            a.experts_per_rank = l.experts_per_rank;
            a.expert_bytes = spec.expert_elems * 2;
            a.slot_expert = make_plan_view(l, dev.ranks[r].plan).slot_expert;
            a.weights = reinterpret_cast<const uint8_t*>(dev.ranks[r].expert_w);
            for (int p = 0; p < R; ++p) a.slot_pools[p] = dev.slot_regions[r].peers[p];
            a.sync = sync(r);
            return a;
        };
        auto reduce_args = [&](int r) {
            GradReduceArgs a{};
            a.rank = r;
            a.num_ranks = R;
            a.experts_per_rank = l.experts_per_rank;
            a.expert_elems = spec.expert_elems;
            a.slot_expert = make_plan_view(l, dev.ranks[r].plan).slot_expert;
            a.grads = dev.ranks[r].grads;
            for (int p = 0; p < R; ++p) a.reduce_pools[p] = reinterpret_cast<float*>(dev.red_regions[r].peers[p]);
            a.sync = sync(r);
            return a;
        };
        const Timing t_plan = time_op(group, iters, warmup, [&] {
            for (int r = 0; r < R; ++r) kernels::launch(plan_args(r), group.stream(r));
        });
        // Planner kernels alone (rank 0's counts; every rank runs the same planner on the same input), device time
        // from a graph of 10 back-to-back planners (as in a captured step; no host launch latency).
        const Timing t_planner = time_graph(group.stream(0), iters, warmup, 10, [&] {
            kernels::launch_planner(l, PlannerKind::kBalanced, make_plan_view(l, dev.ranks[0].plan),
                                    dev.ranks[0].workspace, kernels::PlannerEngine::kParallel, group.stream(0));
        });
        const Timing t_planner_greedy = time_graph(group.stream(0), iters, warmup, 10, [&] {
            kernels::launch_planner(l, PlannerKind::kGreedy, make_plan_view(l, dev.ranks[0].plan),
                                    dev.ranks[0].workspace, kernels::PlannerEngine::kParallel, group.stream(0));
        });
        // Restore rank 0's balanced plan (the greedy run above overwrote its global part).
        kernels::launch_planner(l, PlannerKind::kBalanced, make_plan_view(l, dev.ranks[0].plan), dev.ranks[0].workspace,
                                kernels::PlannerEngine::kParallel, group.stream(0));
        group.synchronize();
        const Timing t_dispatch = time_op(group, iters, warmup, [&] {
            for (int r = 0; r < R; ++r) kernels::launch(dispatch_args(r), group.stream(r));
        });
        const Timing t_combine = time_op(group, iters, warmup, [&] {
            for (int r = 0; r < R; ++r) kernels::launch(combine_args(r), group.stream(r));
        });
        const Timing t_prefetch = time_op(group, iters, warmup, [&] {
            for (int r = 0; r < R; ++r) kernels::launch(prefetch_args(r), group.stream(r));
        });
        const Timing t_reduce = time_op(group, std::max(3, iters / 4), 1, [&] {
            for (int r = 0; r < R; ++r) kernels::launch(reduce_args(r), group.stream(r));
        });
        // Bytes, from the plans.
        std::vector<RankOutputs> outs(R);
        for (int r = 0; r < R; ++r) {
            outs[r].plan.resize(size_t(make_plan_sizes(l).total_words));
            FLATEP_CUDA_CHECK(
                cudaMemcpy(outs[r].plan.data(), dev.ranks[r].plan, outs[r].plan.size() * 4, cudaMemcpyDeviceToHost));
        }
        for (int r = 0; r < R; ++r) {
            const WaitRecord& w = group.wait_record(r);
            FLATEP_CHECK_RUNTIME(w.code == 0, "timeout in op ", w.op, " rank ", w.rank, " peer ", w.peer);
        }
        const Bytes bytes = count_bytes(l, outs, l.num_tokens, true);
        const PlanStats& st = *make_plan_view(l, outs[0].plan.data()).stats;
        double pre_bytes = 0, red_bytes = 0;
        for (int d = 0; d < R; ++d) {
            pre_bytes += 2.0 * st.replicas_in[d] * double(spec.expert_elems) * 2;  // read + write per replica
            // owner: read grad + each slot, write grad; then the slot zeroed
            red_bytes += st.replicas_in[d] * double(spec.expert_elems) * 4 * 2;
            red_bytes += 2.0 * st.replicas_out[d] * 0;  // grads of owners with replicas: read+write once per expert
        }
        for (int d = 0; d < R; ++d) {
            std::vector<char> has(size_t(l.experts_per_rank), 0);
            const int32_t* se = make_plan_view(l, outs[d].plan.data()).slot_expert;
            for (int i = 0; i < R * l.experts_per_rank; ++i)
                if (se[i] >= 0 && se[i] / l.experts_per_rank == d) has[se[i] % l.experts_per_rank] = 1;
            for (char h : has) red_bytes += h ? 2.0 * double(spec.expert_elems) * 4 : 0;
        }
        struct Row {
            const char* op;
            Timing t;
            double bytes;  // all ranks
        };
        const Row rows[] = {{"plan", t_plan, 0},
                            {"planner", t_planner, 0},
                            {"planner_greedy", t_planner_greedy, 0},
                            {"dispatch", t_dispatch, bytes.dispatch},
                            {"combine", t_combine, bytes.combine},
                            {"prefetch", t_prefetch, pre_bytes},
                            {"reduce_grad", t_reduce, red_bytes}};
        for (const Row& row : rows) {
            const double gbps = row.bytes > 0 ? row.bytes / (row.t.median_us * 1e-6) / 1e9 : 0;
            std::printf("%-7s %6.1f %6.2f %-12s %10.1f %12.1f %9.0f %6.2f\n", bench.name.c_str(), bench.maxvio, maxvio,
                        row.op, row.t.median_us, row.bytes / R / 1e6, gbps, gbps / copy_gbps);
            std::fprintf(csv, "%s,%.2f,%.4f,%s,%.2f,%.2f,%.0f,%.1f,%.1f,%.4f,%d,%d\n", bench.name.c_str(), bench.maxvio,
                         maxvio, row.op, row.t.median_us, row.t.min_us, row.bytes / R, gbps, copy_gbps,
                         gbps / copy_gbps, st.total_replicas, st.makespan);
        }
        std::fflush(stdout);
        std::fflush(csv);
    }
    std::fclose(csv);
    return 0;
}
