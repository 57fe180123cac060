// Per-op benchmark of the CUDA data plane, R virtual ranks on one GPU (design §9). Per case (shape, routing skew,
// tokens per call s): per op the median time over many iterations (CUDA events, after warm-up) from a common start
// of all ranks to the end of the last, twice: eager (one host thread launching every rank's kernels, so every rank's
// first barrier waits for the last rank's launches) and replayed as one CUDA graph of every rank's stream (the device
// time, what a captured step or one process per GPU sees; the ratios are of this one); bytes moved per rank (each
// byte read or written in device memory once, local rows included), aggregate bandwidth over all ranks against a
// device-to-device copy measured in the same run, the op's ceiling (OpBytes::ceiling: where the busiest rank
// bounds it), and that ceiling with the op's two barriers at the time two barriers alone take (ceiling_with_barriers:
// a small op such as prefetch cannot pass it whatever its kernels do).
// Planner: the planner kernels alone and the whole plan op. Where the pool ops' time goes: rows prefetch.kernels and
// reduce_grad.kernels (the same launches without their barriers), two_barriers (two cross-rank barriers alone),
// two_empty_kernels (two empty one-block kernels a rank: the launches' share of two_barriers) and empty_graph (the
// replay's own fork and join), and a line per case with each rank's replicas pushed, slots held and
// pool kernels timed alone. CSV out.
//
//   ops_bench [--preset moonep,deepep] [shape and skew flags] [--tokens-per-call s,..] [--iters 20] [--warmup 3]
//             [--ffn 1024] [--num-sms 0] [--csv ops_bench.csv] [--memory-gib G]
//   ops_bench --planner-only [--planner-profile] [--seeds 3] [--preset ..] [shape and skew flags] [--csv ..]
//
// Shape and skew flags, presets (moonep, deepep, moonep-sweep, k3): benchmarks/common/flags.hpp, e.g.
// `--preset k3 --ffn 512` (Kimi K3's shape on 8 virtual ranks) or `--preset moonep --maxvio 1` (one MoonEP case).
// --ffn: H', the expert width; prefetch and reduce_grad move H*H' elements per expert. --tokens-per-call: s <= S
// tokens each rank passes (default S; one case per value). --num-sms: every rank's SM budget, the most thread blocks
// one of its launches uses (LocalDeviceGroup; 0: twice SMs / R, so 32 blocks for 8 ranks on an H200's 132 SMs). Routing
// sigmas of --maxvio targets are bisected on min(R, 8) ranks (--sigma-cache keeps them between runs).
// Before it allocates anything it prints each case's estimate of device memory (common/memory.hpp) and refuses, exit
// status 2 and one line, a case that does not fit the GPU's free memory (--memory-gib G: G GiB instead).
// --planner-only: only the planner kernels on host-generated counts of every case (no data plane, no cross-rank
// barrier, so it also runs under a kernel profiler; --seeds routings per case, seeds 42..), graph-timed, with the
// plan's P and replicas, the greedy's, the host planner's time, and whether the GPU plan equals the host planner's
// bitwise (exit status 1 when one does not).
// --planner-profile: also where the planner's time goes, from device stamps (planner::set_planner_profile): for each
// case, medians over a graph of 10 back-to-back planners of the kernels' spans and of the phases of the candidate
// blocks, the greedy block and select_derive_kernel, the slowest candidates, every candidate's end, what stopping
// the candidates select_candidate never reads would save (print_stop_estimate), and the greedy planner kind's phases.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/csv.hpp"
#include "common/cuda_timing.cuh"
#include "common/device_memory.cuh"
#include "common/flags.hpp"
#include "common/kernel_step.cuh"
#include "common/routing_cases.hpp"
#include "internal/api.hpp"

using namespace flatep;

namespace {

__global__ void empty_kernel() {}

using bench::Timing;

// One rank's copy under its SM budget: `blocks` blocks of 512 threads, 8 16-byte words in flight per thread (the
// prefetch kernel's copy).
__global__ void __launch_bounds__(512) rank_copy_kernel(const uint4* src, uint4* dst, int64_t n16) {
    constexpr int kUnroll = 8;
    for (int64_t base = int64_t(blockIdx.x) * 512 * kUnroll + threadIdx.x; base < n16;
         base += int64_t(gridDim.x) * 512 * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (base + u * 512 < n16) v[u] = src[base + u * 512];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (base + u * 512 < n16) dst[base + u * 512] = v[u];
    }
}

constexpr int64_t kRankCopyProbeBytes = int64_t(256) << 20;  // rank_copy_gbps' two buffers

// GB/s (read + write) of rank_copy_kernel with `blocks` blocks over 256 MiB, graph-timed; the other ranks idle.
double rank_copy_gbps(int blocks, cudaStream_t stream) {
    const size_t bytes = size_t(kRankCopyProbeBytes);
    void *a = nullptr, *b = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&a, bytes));
    FLATEP_CUDA_CHECK(cudaMalloc(&b, bytes));
    FLATEP_CUDA_CHECK(cudaMemset(a, 0x5a, bytes));
    const Timing t = bench::time_graph(stream, 10, 2, 5, [&] {
        rank_copy_kernel<<<blocks, 512, 0, stream>>>(static_cast<const uint4*>(a), static_cast<uint4*>(b),
                                                     int64_t(bytes / 16));
    });
    cudaFree(a);
    cudaFree(b);
    return 2.0 * double(bytes) / (t.median_us * 1e-6) / 1e9;
}

// Bytes an op must move, all ranks together and per rank and phase (a barrier separates the phases, so the busiest
// rank of each sets that phase's time), and the op's ceiling on virtual ranks: the ratio to the copy bandwidth it would
// reach if, in every phase, the busiest rank moved its bytes at the copy bandwidth one rank gets under its SM budget
// (rank_copy_gbps, measured) and nothing else cost time, at most 1 (all ranks together share the copy bandwidth). An
// op whose work sits on a few ranks (prefetch, reduce_grad: the owners of the replicated experts) cannot pass it,
// whatever its kernels do.
struct OpBytes {
    double total = 0;
    std::vector<std::vector<double>> phases;  // [phase][rank]
    double ceiling(double rank_copy_gbps, double copy_gbps) const {
        double busiest = 0;
        for (const std::vector<double>& ph : phases) busiest += *std::max_element(ph.begin(), ph.end());
        return busiest > 0 ? std::min(1.0, total / (busiest / rank_copy_gbps) / copy_gbps) : 0;
    }
};
OpBytes make_op_bytes(int num_phases, int num_ranks) {
    OpBytes b;
    b.phases.assign(size_t(num_phases), std::vector<double>(size_t(num_ranks), 0.0));
    return b;
}
void add_bytes(OpBytes& b, int phase, int rank, double bytes) {
    b.phases[size_t(phase)][size_t(rank)] += bytes;
    b.total += bytes;
}

struct Bytes {
    OpBytes dispatch, combine;
    double dispatch_remote_rows = 0;
};

// Bytes the ops must move, from the plans (zero-copy recv: the symmetric region is the output). Dispatch: the push
// (source r: its rows read, one row written per destination, the weights) then the fan-out (destination r: each
// duplicate read from its head and written, padding zeroed, recv_w of every real row); combine: the partial sums
// (destination r: every real row read, one partial row per head written, the weights) then the pull (source r: one
// partial row per destination read, its rows written).
Bytes count_bytes(const Layout& l, std::vector<std::vector<int32_t>>& plans, int num_tokens, bool weighted) {
    const int R = l.num_ranks;
    Bytes b;
    b.dispatch = make_op_bytes(2, R);
    b.combine = make_op_bytes(2, R);
    const double row = double(l.row_bytes());
    for (int r = 0; r < R; ++r) {
        const PlanView p = make_plan_view(l, plans[size_t(r)].data());
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
        add_bytes(b.dispatch, 0, r,
                  num_tokens * row + pairs * row + double(num_tokens) * l.topk * 4 * (weighted ? 2 : 1));
        add_bytes(b.dispatch, 1, r, 2.0 * dups * row + pad * row + real * 4.0);
        add_bytes(b.combine, 0, r, real * row + heads * row + (weighted ? real * 4.0 : 0));
        add_bytes(b.combine, 1, r, pairs * row + num_tokens * row);
        b.dispatch_remote_rows += remote;
    }
    return b;
}

// Prefetch and reduce_grad from the slot table: the owner of every replicated expert pushes each of its replicas (its
// weights read, the slot written: 2 * expert_bytes a replica); reduce_grad's owner reads its gradient and every
// replica's slot, writes its gradient and zeroes the slots ((2 * P_e + 2) * grad_bytes an expert with P_e replicas),
// all in one phase.
void count_pool_bytes(const Layout& l, const int32_t* slot_expert, double expert_bytes, double grad_bytes,
                      OpBytes& prefetch, OpBytes& reduce) {
    const int R = l.num_ranks, epn = l.experts_per_rank;
    prefetch = make_op_bytes(1, R);
    reduce = make_op_bytes(1, R);
    std::vector<int> replicas(size_t(l.num_experts), 0);
    for (int d = 0; d < R; ++d) {
        for (int j = 0; j < epn; ++j) {
            const int e = slot_expert[d * epn + j];
            if (e < 0) continue;
            ++replicas[size_t(e)];
            add_bytes(prefetch, 0, e / epn, 2.0 * expert_bytes);
        }
    }
    for (int e = 0; e < l.num_experts; ++e)
        if (replicas[size_t(e)] > 0) add_bytes(reduce, 0, e / epn, (2.0 * replicas[size_t(e)] + 2.0) * grad_bytes);
}

// --planner-profile: the stamps of kProfileBatch back-to-back planners captured in one graph (as timed above),
// replayed once to warm up and once more into cleared records.
constexpr int kProfileBatch = 10;
using planner::PlannerProfileRecord;

std::vector<PlannerProfileRecord> profile_planner(const Layout& l, PlannerKind kind, const PlanView& view, void* ws,
                                                  cudaStream_t stream) {
    const planner::PlannerProfileSlots slots = planner::planner_profile_slots(l);
    const size_t count = size_t(slots.total) * kProfileBatch;
    PlannerProfileRecord* records = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&records, count * sizeof(PlannerProfileRecord)));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    FLATEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kProfileBatch; ++i) {
        planner::set_planner_profile(records + size_t(i) * slots.total);
        planner::launch_planner(l, kind, view, ws, planner::PlannerEngine::kParallel, stream);
    }
    planner::set_planner_profile(nullptr);
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
            r.globaltimer[planner::kStampDeriveEnd] != 0 ? int(planner::kStampDeriveEnd) : last_stamp_candidate;
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

double median_of(const std::vector<double>& v) { return bench::median(v); }

// What stopping the unneeded candidates early would save, from the ends of candidates [0, end.size()) (us after the
// first block came in) and the host planner's qualities: select_candidate reads the candidates of budget b only while
// no budget below b has an acceptable one, no acceptable path candidate has a makespan below b and the greedy's
// makespan is not below b. So a candidate of budget b is not needed from the first time one of those is known (once the
// greedy's quality is known too: acceptable means no worse than the greedy). Prints the budgets select reads and the
// candidates' end with such stops (each stop priced at one more warp step, 0.5 us).
void print_stop_estimate(const Layout& l, const int32_t* tpe, const std::vector<double>& end, double greedy_end) {
    namespace pc = planner;
    std::vector<int32_t> ws(size_t(pc::planner_workspace_words(l))), alloc(size_t(l.num_ranks) * l.num_experts);
    const pc::Workspace w = pc::make_workspace(l, ws.data());
    pc::greedy_alloc(l, tpe, alloc.data(), w);
    const pc::PlanQuality greedy = pc::evaluate_alloc(l, tpe, alloc.data(), w.num_in, w.num_out);
    auto budget_of = [](int c) {
        return c < pc::kNumPathVariants ? 0 : (c - pc::kNumPathVariants) / pc::kVariantsPerBudget + 1;
    };
    // stop_at[b]: when budget b's candidates are known not to be needed.
    const int max_budget = budget_of(int(end.size()) - 1) + 1;
    std::vector<double> stop_at(size_t(max_budget) + 2, 1e30);
    auto bound = [&](int threshold, double at) {  // budgets above threshold stop at `at`
        for (int b = threshold + 1; b <= max_budget; ++b) stop_at[size_t(b)] = std::min(stop_at[size_t(b)], at);
    };
    bound(greedy.makespan, greedy_end);
    std::vector<pc::PlanQuality> q(end.size(), pc::PlanQuality{pc::kNoCandidate, 0, 0});
    for (size_t c = 0; c < end.size(); ++c) {
        if (pc::build_candidate(l, tpe, w.cand, w, int(c)))
            q[c] = pc::evaluate_alloc(l, tpe, w.cand, w.num_in, w.num_out);
        if (pc::acceptable(greedy, q[c]))
            bound(budget_of(int(c)) == 0 ? q[c].makespan : budget_of(int(c)), std::max(end[c], greedy_end));
    }
    const int kept = pc::select_candidate(greedy, q.data(), int(q.size()));
    double now = greedy_end, stopped = greedy_end;
    int read_up_to = 0;
    for (size_t c = 0; c < end.size(); ++c) {
        now = std::max(now, end[c]);
        const int b = budget_of(int(c));
        const bool stops = b > 0 && stop_at[size_t(b)] + 0.5 < end[c];
        stopped = std::max(stopped, stops ? stop_at[size_t(b)] + 0.5 : end[c]);
        if (!stops) read_up_to = std::max(read_up_to, b);
    }
    std::printf(
        "    stops (estimate): greedy P %d; kept #%d (budget %d); candidates end %.1f us, with stops %.1f us "
        "(budgets up to %d run to their end)\n",
        greedy.makespan, kept, kept < 0 ? -1 : budget_of(kept), now, stopped, read_up_to);
}

// Prints a few lines: balanced planner spans and phases, the slowest candidates, every candidate's end and the stop
// estimate, the greedy planner kind's phases. tpe: the counts the planner ran on (the estimate's host planner).
void print_planner_profile(const Layout& l, const std::vector<PlannerProfileRecord>& balanced,
                           const std::vector<PlannerProfileRecord>& greedy_kind, const int32_t* tpe) {
    using namespace planner;
    const PlannerProfileSlots slots = planner_profile_slots(l);
    const ProfileClock clk = fit_clock(balanced, kStampEvaluated);
    // Values kept per planner run (medians printed): spans, then the phases of the greedy block, of the mean
    // candidate and of select_derive_kernel.
    // clang-format off
    enum { kCand, kGap, kSelect, kTotal, kBuilt, kRun, kGLoad, kGBuild, kGStore, kGEval, kGTotal, kCLoad, kCBuild,
           kCStore, kCEval, kCTotal, kEarly, kSLoad, kSSelect, kSCopy, kSRebuild, kSSums, kSSlots, kSRows, kSStats,
           kGEnd, kSLater, kNum };
    // clang-format on
    std::vector<std::vector<double>> m(kNum);
    std::vector<std::vector<double>> per_index(size_t(slots.candidates)), end_of(size_t(slots.candidates));
    std::vector<int> kept(kProfileBatch, -2), counts(kProfileBatch, 0);
    for (int i = 0; i < kProfileBatch; ++i) {
        const PlannerProfileRecord* r = balanced.data() + size_t(i) * slots.total;
        const PlannerProfileRecord& g = r[slots.greedy];
        const PlannerProfileRecord& s = r[slots.select];
        // The block that computed the statistics (select_derive_kernel over several blocks), else block 0 did.
        const PlannerProfileRecord& mr = r[slots.merge];
        const bool merged = mr.globaltimer[kStampDeriveEnd] != 0;
        const unsigned long long end = merged ? mr.globaltimer[kStampDeriveEnd] : s.globaltimer[kStampDeriveEnd];
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
        for (int c = 0; c < slots.candidates; ++c) {
            const unsigned long long at = r[c].globaltimer[kStampEvaluated];
            if (r[c].globaltimer[kStampEntry] != 0 && at != 0)
                end_of[size_t(c)].push_back(double(at - first_in) * 1e-3);
        }
        // select_derive_kernel may start early (programmatic launch) and wait: its part of the planner begins when
        // its wait returns.
        const unsigned long long waited = s.globaltimer[kStampSelWaited];
        m[kCand].push_back(double(last_out - first_in) * 1e-3);
        m[kGap].push_back(waited > last_out ? double(waited - last_out) * 1e-3 : 0.0);
        m[kSelect].push_back(double(end - waited) * 1e-3);
        m[kEarly].push_back(clk.phase_us(s, kStampEntry, kStampSelWaited));
        m[kTotal].push_back(double(end - first_in) * 1e-3);
        m[kBuilt].push_back(built);
        m[kRun].push_back(run);
        m[kGLoad].push_back(clk.phase_us(g, kStampEntry, kStampLoaded));
        m[kGBuild].push_back(clk.phase_us(g, kStampLoaded, kStampBuilt));
        m[kGStore].push_back(clk.phase_us(g, kStampBuilt, kStampStored));
        m[kGEval].push_back(clk.phase_us(g, kStampStored, kStampEvaluated));
        m[kGTotal].push_back(clk.phase_us(g, kStampEntry, kStampEvaluated));
        m[kGEnd].push_back(double(g.globaltimer[kStampEvaluated] - first_in) * 1e-3);
        const double n = std::max(run, 1);
        m[kCLoad].push_back(sum_load / n);
        m[kCBuild].push_back(sum_build / n);
        m[kCStore].push_back(sum_store / n);
        m[kCEval].push_back(sum_eval / n);
        m[kCTotal].push_back(sum_total / n);
        const int stamps[] = {kStampSelWaited,  kStampSelLoaded,   kStampSelSelected, kStampSelCopied, kStampSelRebuilt,
                              kStampDeriveSums, kStampDeriveSlots, kStampDeriveRows,  kStampDeriveEnd};
        for (int k = 0; k < 7; ++k) m[size_t(kSLoad + k)].push_back(clk.phase_us(s, stamps[k], stamps[k + 1]));
        // The statistics: block 0's, or those of the last block to finish its tasks (by its own clock), which began
        // kSLater after block 0's tasks ended.
        m[kSStats].push_back(merged ? clk.phase_us(mr, kStampEntry, kStampDeriveEnd)
                                    : clk.phase_us(s, kStampDeriveRows, kStampDeriveEnd));
        m[kSLater].push_back(
            merged ? (double(mr.globaltimer[kStampEntry]) - double(s.globaltimer[kStampDeriveRows])) * 1e-3 : 0.0);
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
    // Every candidate's end (evaluated), after the first block of its planner run came in, and whether it built.
    std::printf("\n    candidate ends (index:us, median; x = no plan in the last run):");
    const PlannerProfileRecord* last_run = balanced.data() + size_t(kProfileBatch - 1) * slots.total;
    for (int c = 0; c < slots.candidates; ++c)
        if (!end_of[size_t(c)].empty())
            std::printf(" %d:%.1f%s", c, median_of(end_of[size_t(c)]), last_run[c].flags ? "" : "x");
    std::printf("\n");
    {
        std::vector<double> ends;
        for (int c = 0; c < slots.candidates; ++c) {
            if (end_of[size_t(c)].empty()) break;
            ends.push_back(median_of(end_of[size_t(c)]));
        }
        print_stop_estimate(l, tpe, ends, md(kGEnd));
    }
    // Step traces of the three slowest candidates (last run of the batch): build start to every warp step
    // (WarpExec::single, sum, arg_max) to the build's end.
    const PlannerProfileRecord* last = balanced.data() + size_t(kProfileBatch - 1) * slots.total;
    for (size_t k = 0; k < slow.size() && k < 3; ++k) {
        const int c = slow[k].second;
        const PlannerProfileRecord& cr = last[c];
        if (cr.trace_count < 2) continue;
        // Its phases by the block's own clock: entry, counts loaded, build start (trace[0]: the home allocation done),
        // build end, allocation built (block barrier), stored, evaluated.
        const long long at[] = {cr.clock[kStampEntry],        cr.clock[kStampLoaded], cr.trace[0],
                                cr.trace[cr.trace_count - 1], cr.clock[kStampBuilt],  cr.clock[kStampStored],
                                cr.clock[kStampEvaluated]};
        auto span = [&](int a, int b) { return double(at[b] - at[a]) * clk.ns_per_cycle * 1e-3; };
        std::printf("\n    #%d phases (us): load %.2f home %.2f steps %.2f barrier %.2f store %.2f eval %.2f", c,
                    span(0, 1), span(1, 2), span(2, 3), span(3, 4), span(4, 5), span(5, 6));
        std::printf("\n    trace #%d (%d events, %.1f us):", c, cr.trace_count - 2,
                    double(cr.trace[cr.trace_count - 1] - cr.trace[0]) * clk.ns_per_cycle * 1e-3);
        for (int k = 1; k < cr.trace_count; ++k)
            std::printf(" %.2f", double(cr.trace[k] - cr.trace[k - 1]) * clk.ns_per_cycle * 1e-3);
    }
    std::printf("\n    select_derive %.1f us (started %.1f us before): load %.1f select %.1f copy %.1f rebuild %.1f",
                md(kSelect), md(kEarly), md(kSLoad), md(kSSelect), md(kSCopy), md(kSRebuild));
    std::printf(" | derive pass %.1f (block 0), the last block's sums %.1f after, stats %.1f\n",
                md(kSSums) + md(kSSlots) + md(kSRows), md(kSLater), md(kSStats));
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
    // One block: its warps' ends after its pass starts. Several: those of block 1 (a task block) after its own start
    // (trace[7], by its own SM's clock).
    const long long pass_start = sr.trace[7] != 0 ? sr.trace[7] : sr.clock[planner::kStampSelRebuilt];
    std::printf("    derive warps' ends (us after the pass starts%s):", sr.trace[7] != 0 ? ", task block 1" : "");
    for (int w = 0; w < 32 && sr.trace[8 + w] != 0; ++w)  // the block's warps (the records are cleared first)
        std::printf(" %.2f", double(sr.trace[8 + w] - pass_start) * clk.ns_per_cycle * 1e-3);
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

struct Options {
    std::vector<bench::Case> cases;
    std::vector<int> tokens_per_call;  // empty: S
    int iters = 20, warmup = 3, seeds = 3;
    int num_sms = 0;  // every rank's SM budget, blocks per launch (LocalDeviceGroup's num_sms); 0: twice SMs / R
    bool planner_only = false, planner_profile = false;
    std::string csv = "ops_bench.csv", sigma_cache;
    double memory_gib = 0;  // --memory-gib: 0, the device's free memory
};

// The plan's global part (everything before the per-rank entry arrays): where a GPU plan must equal the host's.
int64_t global_words(const Layout& l) { return make_plan_sizes(l).entry_rank; }

// Planner kernels alone on host-generated counts of every case (--seeds routings each): graph-timed balanced and
// greedy planners, P and replicas of both, the host planner's time, and the GPU plan against the host's, bitwise.
int planner_bench(const Options& o, bench::SigmaTable& sigmas) {
    // clang-format off
    bench::CsvWriter csv(o.csv, {"config", "R", "S", "E", "H", "K", "align", "capacity_factor", "maxvio_target", "sigma",
                                 "seed", "maxvio", "P", "replicas", "P_greedy", "replicas_greedy", "balanced_us",
                                 "balanced_min_us", "greedy_us", "greedy_min_us", "host_balanced_us", "bitwise_host",
                                 "valid", "not_worse_than_greedy", "candidate_path", "timed_runs",
                                 "planner_path"});
    // clang-format on
    std::printf("%-13s %-26s %6s %4s %8s %3s %4s %4s %4s %12s %12s %10s %7s\n", "config", "shape", "maxvio", "seed",
                "realised", "P", "reps", "P_g", "re_g", "balanced_us", "greedy_us", "host_us", "bitwise");
    cudaStream_t stream = nullptr;
    FLATEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int mismatches = 0;
    // Count matrices do not depend on H: the cases that differ only there share them.
    std::map<std::tuple<int, int, int, int, double, uint64_t>, std::vector<int32_t>> counts_of;
    for (const bench::Case& c : o.cases) {
        const Layout l = make_layout(c.shape.config());
        const size_t words = size_t(make_plan_sizes(l).total_words);
        int32_t* d_plan = nullptr;
        void* ws = nullptr;
        FLATEP_CUDA_CHECK(cudaMalloc(&d_plan, words * 4));
        FLATEP_CUDA_CHECK(cudaMalloc(&ws, planner::planner_workspace_bytes(l)));
        for (uint64_t seed = 42; seed < 42 + uint64_t(o.seeds); ++seed) {
            const double sigma = sigmas.sigma(c, seed);
            std::vector<int32_t>& tpe = counts_of[{l.num_ranks, l.num_experts, l.num_tokens, l.topk, sigma, seed}];
            if (tpe.empty())
                tpe = bench::generate_counts_parallel(l.num_ranks, l.num_experts, l.num_tokens, l.topk, sigma, seed);
            std::vector<int32_t> init(words, 0);
            std::copy(tpe.begin(), tpe.end(), init.begin() + make_plan_sizes(l).tpe_all);
            FLATEP_CUDA_CHECK(cudaMemcpy(d_plan, init.data(), words * 4, cudaMemcpyHostToDevice));
            const PlanView view = make_plan_view(l, d_plan);
            auto planner = [&](PlannerKind kind) {
                return [&, kind] {
                    planner::launch_planner(l, kind, view, ws, planner::PlannerEngine::kParallel, stream);
                };
            };
            // A planner slower than 1 ms (the balanced one off its candidate path) is timed over fewer runs.
            const bool slow = bench::time_graph(stream, 1, 1, 1, planner(PlannerKind::kBalanced)).median_us > 1000;
            const int batch = slow ? 1 : 10, iters = slow ? std::min(o.iters, 3) : o.iters;
            const Timing greedy = bench::time_graph(stream, iters, o.warmup, batch, planner(PlannerKind::kGreedy));
            const Timing balanced =
                bench::time_graph(stream, iters, slow ? 1 : o.warmup, batch, planner(PlannerKind::kBalanced));
            FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
            std::vector<int32_t> out(words);
            FLATEP_CUDA_CHECK(cudaMemcpy(out.data(), d_plan, words * 4, cudaMemcpyDeviceToHost));
            const PlanStats& st = *make_plan_view(l, out.data()).stats;
            // The host planner on the same counts: the oracle, and the greedy's P and replicas.
            planner::HostPlan host(l), host_greedy(l);
            std::copy(tpe.begin(), tpe.end(), host.view.tpe_all);
            std::copy(tpe.begin(), tpe.end(), host_greedy.view.tpe_all);
            const Timing host_t =
                bench::time_host(3, 0, [&] { planner::plan_counts(l, PlannerKind::kBalanced, host.view); });
            planner::plan_counts(l, PlannerKind::kGreedy, host_greedy.view);
            const bool bitwise = std::equal(out.begin(), out.begin() + global_words(l), host.view.tpe_all);
            mismatches += !bitwise;
            const PlanStats& gs = *host_greedy.view.stats;
            // The GPU plan's global part checked as a plan (check_plan on the host plan with it copied in: balance,
            // slots, conservation), and no worse than the greedy on P and on replicas.
            planner::HostPlan gpu_plan(l);
            std::copy(out.begin(), out.begin() + global_words(l), gpu_plan.view.tpe_all);
            const std::string bad = planner::check_plan(l, gpu_plan.view);
            const bool not_worse = st.makespan <= gs.makespan && st.total_replicas <= gs.total_replicas;
            if (!bad.empty()) std::printf("FAIL: invalid GPU plan (%s): %s\n", c.shape.label().c_str(), bad.c_str());
            if (!not_worse) std::printf("FAIL: balanced plan worse than the greedy (%s)\n", c.shape.label().c_str());
            mismatches += !bad.empty() || !not_worse;
            const double realised = routing::maxvio(tpe.data(), l.num_ranks, l.num_experts);
            std::printf("%-13s %-26s %6.1f %4d %8.2f %3d %4d %4d %4d %12.1f %12.1f %10.1f %7s\n", c.preset.c_str(),
                        c.shape.label().c_str(), c.skew.maxvio_target(), int(seed), realised, st.makespan,
                        st.total_replicas, gs.makespan, gs.total_replicas, balanced.median_us, greedy.median_us,
                        host_t.median_us, bitwise ? "yes" : "NO");
            csv.row(c.preset, l.num_ranks, l.num_tokens, l.num_experts, l.hidden, l.topk, l.align,
                    c.shape.capacity_factor, c.skew.maxvio_target(), sigma, seed, bench::fixed(realised, 4),
                    st.makespan, st.total_replicas, gs.makespan, gs.total_replicas, bench::fixed(balanced.median_us, 2),
                    bench::fixed(balanced.min_us, 2), bench::fixed(greedy.median_us, 2), bench::fixed(greedy.min_us, 2),
                    bench::fixed(host_t.median_us, 1), int(bitwise), int(bad.empty()), int(not_worse),
                    int(planner::planner_uses_candidate_path(l)), iters * batch, planner::planner_path_name(l));
            if (!planner::planner_uses_candidate_path(l))
                std::printf(
                    "  balanced planner off its candidate path (FLATEP_PLANNER_PLACEMENT=shared): a candidate block "
                    "needs %zu KiB of shared memory (at most 200): planner::plan_alloc ran on one thread\n",
                    planner::planner_candidate_smem_bytes(l) / 1024);
            else
                std::printf("  balanced planner path: %s, %zu KiB of shared memory per candidate block\n",
                            planner::planner_path_name(l), planner::planner_candidate_smem_bytes(l) / 1024);
            if (o.planner_profile && !slow) {
                const auto greedy_kind = profile_planner(l, PlannerKind::kGreedy, view, ws, stream);
                const auto balanced_kind = profile_planner(l, PlannerKind::kBalanced, view, ws, stream);
                print_planner_profile(l, balanced_kind, greedy_kind, tpe.data());
            }
            std::fflush(stdout);
        }
        cudaFree(d_plan);
        cudaFree(ws);
    }
    cudaStreamDestroy(stream);
    if (mismatches > 0)
        std::printf("FAIL: %d GPU plans differ from the host planner's, invalid or worse\n", mismatches);
    return mismatches == 0 ? 0 : 1;
}

// The data plane of one case at s tokens per call: every op timed, bytes from the plans, one CSV row per op.
// The device buffers of a case at s tokens per call: one bf16 projection of H x H' per expert, epn slots, grads.
bench::KernelStepSpec case_spec(const bench::Case& c, int s) {
    bench::KernelStepSpec spec;
    spec.layout = make_layout(c.shape.config());
    spec.tokens.assign(size_t(spec.layout.num_ranks), s);
    spec.expert_bytes = {int64_t(spec.layout.hidden) * c.shape.ffn * 2};
    spec.pool_slots = spec.layout.experts_per_rank;
    spec.grads = true;
    return spec;
}

// copy_bandwidth_gbps' two buffers (its default size; alone, before the cases).
constexpr int64_t kCopyProbeBytes = int64_t(4) << 30;

// The data plane's device memory, per case (--planner-only's plans and workspaces are a few MiB: not checked).
std::vector<bench::MemoryEstimate> data_plane_memory(const std::vector<bench::Case>& cases) {
    std::vector<bench::MemoryEstimate> all;
    bench::MemoryEstimate copy;
    copy.what = "the copy bandwidth probe";
    copy.add("copy buffers", kCopyProbeBytes, 2);
    all.push_back(copy);
    for (const bench::Case& c : cases) {
        bench::MemoryEstimate e = bench::kernel_step_memory(case_spec(c, c.shape.tokens));  // s: no size depends on it
        e.what = "preset " + c.preset + " (" + c.shape.label() + ", ffn " + std::to_string(c.shape.ffn) + ")";
        e.add("rank copy probe", kRankCopyProbeBytes, 2);
        all.push_back(e);
    }
    return all;
}

void data_plane_case(const Options& o, const bench::Case& c, int s, double sigma, double copy_gbps,
                     bench::CsvWriter& csv) {
    const bench::KernelStepSpec spec = case_spec(c, s);
    const Layout& l = spec.layout;
    const int R = l.num_ranks;
    const int64_t expert_elems = int64_t(l.hidden) * c.shape.ffn;
    testing::LocalDeviceGroup group(R, false, 30.0, o.num_sms);
    bench::KernelStep dev(spec, group);
    const double rank_gbps =
        rank_copy_gbps(group.num_sms() > 0 ? group.num_sms() : 2 * kernels::device_sm_count(), group.stream(0));
    std::printf("  one rank's copy under its SM budget (%d blocks): %.0f GB/s\n", group.num_sms(), rank_gbps);
    // Inputs: routing from the generator (sigma, seed 42); data random on the device (never zeros).
    const std::vector<double> pop = routing::popularity(l.num_experts, sigma, 42);
    std::vector<int32_t> all_counts(size_t(R) * l.num_experts, 0), t32(size_t(s) * l.topk);
    for (int r = 0; r < R; ++r) {
        routing::sample_topk(pop, s, l.topk, 42, r, t32.data());
        for (int32_t e : t32) ++all_counts[size_t(r) * l.num_experts + e];
        bench::KernelStep::Rank& p = dev.rank(r);
        FLATEP_CUDA_CHECK(cudaMemcpy(p.topk, t32.data(), t32.size() * 4, cudaMemcpyHostToDevice));
        bench::fill_device_bf16(p.x, int64_t(s) * l.hidden, 100 + r);
        bench::fill_device_bf16(p.weights, int64_t(s) * l.topk * 2, 200 + r);  // bf16 pairs: finite floats
        bench::fill_device_bf16(p.y, int64_t(l.num_recv_rows) * l.hidden, 300 + r);
        bench::fill_device_bf16(p.own[0], int64_t(l.experts_per_rank) * expert_elems, 400 + r);
        bench::fill_device_bf16(p.grads, int64_t(l.experts_per_rank) * expert_elems * 2, 500 + r);
        bench::fill_device_bf16(p.reduce_pool, int64_t(l.experts_per_rank) * expert_elems * 2, 600 + r);
    }
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
    const double maxvio = routing::maxvio(all_counts.data(), R, l.num_experts);
    auto sync = [&](int r) { return dev.sync(r); };
    auto plan_args = [&](int r) { return dev.plan_args(r); };
    auto dispatch_args = [&](int r) { return dev.dispatch_args(r); };
    auto combine_args = [&](int r) { return dev.combine_args(r); };
    auto prefetch_args = [&](int r) { return dev.prefetch_args(r, 0, 1, /*push=*/true); };
    // The same replicas pulled by their holders from the owners' weights (serving's prefetch): one barrier, each rank
    // writes only its own slots.
    auto prefetch_pull_args = [&](int r) { return dev.prefetch_args(r, 0, 1, /*push=*/false); };
    auto reduce_args = [&](int r) { return dev.reduce_args(r); };
    const Timing t_plan = bench::time_ranks(group, o.iters, o.warmup, [&] {
        for (int r = 0; r < R; ++r) runtime::launch_plan(plan_args(r), group.stream(r), group.num_sms());
    });
    // Planner kernels alone (rank 0's counts; every rank runs the same planner on the same input), device time
    // from a graph of 10 back-to-back planners (as in a captured step; no host launch latency).
    const Timing t_planner = bench::time_graph(group.stream(0), o.iters, o.warmup, 10, [&] {
        planner::launch_planner(l, PlannerKind::kBalanced, make_plan_view(l, dev.rank(0).plan), dev.rank(0).workspace,
                                planner::PlannerEngine::kParallel, group.stream(0));
    });
    const Timing t_planner_greedy = bench::time_graph(group.stream(0), o.iters, o.warmup, 10, [&] {
        planner::launch_planner(l, PlannerKind::kGreedy, make_plan_view(l, dev.rank(0).plan), dev.rank(0).workspace,
                                planner::PlannerEngine::kParallel, group.stream(0));
    });
    // Restore rank 0's balanced plan (the greedy run above overwrote its global part).
    planner::launch_planner(l, PlannerKind::kBalanced, make_plan_view(l, dev.rank(0).plan), dev.rank(0).workspace,
                            planner::PlannerEngine::kParallel, group.stream(0));
    group.synchronize();
    auto plan_all = [&] {
        for (int r = 0; r < R; ++r) runtime::launch_plan(plan_args(r), group.stream(r), group.num_sms());
    };
    auto dispatch_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(dispatch_args(r), group.stream(r), group.num_sms());
    };
    auto combine_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(combine_args(r), group.stream(r), group.num_sms());
    };
    auto prefetch_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(prefetch_args(r), group.stream(r), group.num_sms());
    };
    auto prefetch_pull_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(prefetch_pull_args(r), group.stream(r), group.num_sms());
    };
    auto reduce_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(reduce_args(r), group.stream(r), group.num_sms());
    };
    const Timing t_dispatch = bench::time_ranks(group, o.iters, o.warmup, dispatch_all);
    const Timing t_combine = bench::time_ranks(group, o.iters, o.warmup, combine_all);
    const Timing t_prefetch = bench::time_ranks(group, o.iters, o.warmup, prefetch_all);
    const Timing t_prefetch_pull = bench::time_ranks(group, o.iters, o.warmup, prefetch_pull_all);
    const Timing t_reduce = bench::time_ranks(group, std::max(3, o.iters / 4), 1, reduce_all);
    // The same ops replayed as one graph of every rank's stream (no host launch time: the device time of a step).
    constexpr int kGraphBatch = 3;
    const Timing g_plan = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, plan_all);
    const Timing g_dispatch = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, dispatch_all);
    const Timing g_combine = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, combine_all);
    const Timing g_prefetch = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, prefetch_all);
    const Timing g_prefetch_pull = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, prefetch_pull_all);
    const Timing g_reduce = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, reduce_all);
    // Where the pool ops' time goes: their kernels alone (the same launches with sync.num_ranks = 1, so that
    // launch_barrier launches nothing), their two cross-rank barriers alone, and an empty graph of the same fork and
    // join (what the replay itself costs).
    auto without_barriers = [](auto a) {
        a.sync.num_ranks = 1;
        return a;
    };
    const Timing g_prefetch_kernels = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, [&] {
        for (int r = 0; r < R; ++r)
            kernels::launch(without_barriers(prefetch_args(r)), group.stream(r), group.num_sms());
    });
    const Timing g_reduce_kernels = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, [&] {
        for (int r = 0; r < R; ++r) kernels::launch(without_barriers(reduce_args(r)), group.stream(r), group.num_sms());
    });
    const Timing g_barriers = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, [&] {
        for (int r = 0; r < R; ++r) {
            kernels::launch_barrier(sync(r), sync::kOpPrefetch, group.stream(r));
            kernels::launch_barrier(sync(r), sync::kOpPrefetch, group.stream(r));
        }
    });
    const Timing g_empty = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, [] {});
    const Timing g_two_kernels = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, [&] {
        for (int r = 0; r < R; ++r) {
            empty_kernel<<<1, 32, 0, group.stream(r)>>>();
            empty_kernel<<<1, 32, 0, group.stream(r)>>>();
        }
    });
    // Each rank's pool kernels alone (the others launch nothing): the owners' own times, against the op's.
    std::string alone_line[2];
    for (int r = 0; r < R; ++r) {
        const Timing pre = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, [&] {
            kernels::launch(without_barriers(prefetch_args(r)), group.stream(r), group.num_sms());
        });
        const Timing red = bench::time_ranks_graph(group, o.iters, o.warmup, kGraphBatch, [&] {
            kernels::launch(without_barriers(reduce_args(r)), group.stream(r), group.num_sms());
        });
        alone_line[0] += " " + bench::fixed(pre.median_us, 1);
        alone_line[1] += " " + bench::fixed(red.median_us, 1);
    }
    group.synchronize();
    // Bytes, from the plans.
    std::vector<std::vector<int32_t>> plans(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) plans[size_t(r)] = dev.download_plan(r);
    const std::string stuck = dev.wait_failure();
    FLATEP_CHECK_RUNTIME(stuck.empty(), stuck);
    const Bytes bytes = count_bytes(l, plans, s, true);
    const PlanStats& st = *make_plan_view(l, plans[0].data()).stats;
    const double expert_bytes = double(expert_elems) * 2, grad_bytes = double(expert_elems) * 4;
    OpBytes pre_bytes, red_bytes;
    const int32_t* slot_expert = make_plan_view(l, plans[0].data()).slot_expert;
    count_pool_bytes(l, slot_expert, expert_bytes, grad_bytes, pre_bytes, red_bytes);
    // Back from count_pool_bytes' per-rank bytes: a pushed replica is 2 * expert_bytes. Slots held: from the table.
    std::string owns, holds;
    for (int r = 0; r < R; ++r) {
        owns += " " + std::to_string(int(pre_bytes.phases[0][size_t(r)] / (2 * expert_bytes) + 0.5));
        int held = 0;
        for (int j = 0; j < l.experts_per_rank; ++j) held += slot_expert[r * l.experts_per_rank + j] >= 0;
        holds += " " + std::to_string(held);
    }
    std::printf("  per rank: replicas pushed%s | slots held%s | kernels alone (us), prefetch%s | reduce_grad%s\n",
                owns.c_str(), holds.c_str(), alone_line[0].c_str(), alone_line[1].c_str());
    struct Row {
        const char* op;
        Timing t, graph;  // eager (one host thread launching every rank), and replayed as one graph
        OpBytes bytes;    // all ranks
        bool barriers;    // the op opens and closes with a cross-rank barrier (its ".kernels" row: without them)
    };
    const Row rows[] = {{"plan", t_plan, g_plan, {}, false},
                        {"planner", t_planner, t_planner, {}, false},
                        {"planner_greedy", t_planner_greedy, t_planner_greedy, {}, false},
                        {"dispatch", t_dispatch, g_dispatch, bytes.dispatch, true},
                        {"combine", t_combine, g_combine, bytes.combine, true},
                        {"prefetch", t_prefetch, g_prefetch, pre_bytes, true},
                        {"prefetch_pull", t_prefetch_pull, g_prefetch_pull, pre_bytes, false},
                        {"reduce_grad", t_reduce, g_reduce, red_bytes, true},
                        {"prefetch.kernels", g_prefetch_kernels, g_prefetch_kernels, pre_bytes, false},
                        {"reduce_grad.kernels", g_reduce_kernels, g_reduce_kernels, red_bytes, false},
                        {"two_barriers", g_barriers, g_barriers, {}, false},
                        {"empty_graph", g_empty, g_empty, {}, false},
                        {"two_empty_kernels", g_two_kernels, g_two_kernels, {}, false}};
    for (const Row& row : rows) {
        const double gbps = row.bytes.total > 0 ? row.bytes.total / (row.t.median_us * 1e-6) / 1e9 : 0;
        const double graph_gbps = row.bytes.total > 0 ? row.bytes.total / (row.graph.median_us * 1e-6) / 1e9 : 0;
        const double ceiling = row.bytes.ceiling(rank_gbps, copy_gbps);
        // With its two barriers: the ratio if the kernels reached the ceiling and the barriers took what two barriers
        // alone take in this run.
        const double with_barriers =
            row.barriers && ceiling > 0
                ? 1.0 / (1.0 / ceiling + g_barriers.median_us * 1e-6 * copy_gbps * 1e9 / row.bytes.total)
                : ceiling;
        std::printf("%-13s %-26s %5d %6.1f %6.2f %-14s %10.1f %10.1f %12.1f %9.0f %6.2f %6.2f %7.2f %8.2f\n",
                    c.preset.c_str(), c.shape.label().c_str(), s, c.skew.maxvio_target(), maxvio, row.op,
                    row.t.median_us, row.graph.median_us, row.bytes.total / R / 1e6, graph_gbps, gbps / copy_gbps,
                    graph_gbps / copy_gbps, ceiling, with_barriers);
        csv.row(c.preset, bench::fixed(c.skew.maxvio_target(), 2), bench::fixed(maxvio, 4), row.op,
                bench::fixed(row.t.median_us, 2), bench::fixed(row.t.min_us, 2), bench::fixed(row.bytes.total / R, 0),
                bench::fixed(gbps, 1), bench::fixed(copy_gbps, 1), bench::fixed(gbps / copy_gbps, 4), st.total_replicas,
                st.makespan, R, l.num_tokens, s, l.num_experts, l.hidden, l.topk, c.shape.ffn, l.align, sigma,
                bench::fixed(row.graph.median_us, 2), bench::fixed(row.graph.min_us, 2),
                bench::fixed(graph_gbps / copy_gbps, 4), bench::fixed(ceiling, 4), bench::fixed(rank_gbps, 1),
                bench::fixed(with_barriers, 4), group.num_sms());
    }
    std::fflush(stdout);
}

}  // namespace

static int run(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);  // see kernels::preload_all_kernels
    Options o;
    bench::Flags flags("ops_bench", "The CUDA data plane and planner on R virtual ranks of one GPU");
    flags.add_sweep({"moonep", "deepep"}, /*default_ffn=*/1024);
    flags.add_timing(&o.iters, &o.warmup);
    flags.add_csv(&o.csv);
    flags.add("--tokens-per-call", &o.tokens_per_call, "s: tokens each rank passes, <= S (default S), a list sweeps");
    flags.add_switch("--planner-only", &o.planner_only, "only the planner kernels, graph-timed, vs the host planner");
    flags.add_switch("--planner-profile", &o.planner_profile, "with --planner-only: where the planner's time goes");
    flags.add("--seeds", &o.seeds, "--planner-only: routings per case (seeds 42..)", 1, 1000);
    flags.add("--num-sms", &o.num_sms, "every rank's SM budget: blocks per launch at most (0: twice SMs / R)", 0, 2048);
    flags.add("--sigma-cache", &o.sigma_cache, "CSV of routing sigmas found before: read, and appended to");
    flags.add_memory(&o.memory_gib);
    flags.parse(argc, argv);
    o.cases = flags.cases();
    for (const bench::Case& c : o.cases) {
        const Config cfg = flags.validated(c.shape);
        if (cfg.num_ranks > kMaxRanks) flags.fail("--ranks: at most " + std::to_string(kMaxRanks) + " virtual ranks");
        for (int s : o.tokens_per_call)
            if (s < 1 || s > cfg.num_tokens)
                flags.fail("--tokens-per-call " + std::to_string(s) + ": needs 1 <= s <= S (" + c.shape.label() + ")");
    }
    if (o.planner_profile && !o.planner_only) flags.fail("--planner-profile needs --planner-only");
    // The data plane's estimate against --memory-gib before anything else (so also without a GPU), or the device's
    // free memory once there is one.
    if (!o.planner_only && o.memory_gib > 0)
        bench::require_device_fit("ops_bench", data_plane_memory(o.cases), o.memory_gib);
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    if (!o.planner_only && o.memory_gib <= 0) bench::require_device_fit("ops_bench", data_plane_memory(o.cases), 0);
    bench::SigmaTable sigmas(/*bisection_ranks=*/8, o.sigma_cache);
    std::vector<uint64_t> seeds;
    for (int i = 0; i < (o.planner_only ? o.seeds : 1); ++i) seeds.push_back(42 + uint64_t(i));
    sigmas.prepare(o.cases, seeds);
    if (o.planner_only) return planner_bench(o, sigmas);

    const double copy_gbps = bench::copy_bandwidth_gbps(10);
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_gbps);
    bench::CsvWriter csv(o.csv, {"config",
                                 "maxvio_target",
                                 "maxvio",
                                 "op",
                                 "time_us_median",
                                 "time_us_min",
                                 "bytes_per_rank",
                                 "agg_GBps",
                                 "copy_GBps",
                                 "ratio_to_copy",
                                 "replicas",
                                 "makespan",
                                 "R",
                                 "S",
                                 "s",
                                 "E",
                                 "H",
                                 "K",
                                 "ffn",
                                 "align",
                                 "sigma",
                                 "graph_us_median",
                                 "graph_us_min",
                                 "graph_ratio_to_copy",
                                 "ceiling",
                                 "rank_copy_GBps",
                                 "ceiling_with_barriers",
                                 "max_blocks"});
    std::printf("%-13s %-26s %5s %6s %6s %-14s %10s %10s %12s %9s %6s %6s %7s %8s\n", "config", "shape", "s", "target",
                "maxvio", "op", "eager_us", "graph_us", "MB_per_rank", "agg_GB/s", "eager", "ratio", "ceiling",
                "barriers");
    std::printf(
        "(eager: one host thread launching every rank's kernels, its launch time included; graph: every rank's "
        "work replayed as one CUDA graph; ratio: to the copy bandwidth, graph-timed; ceiling: at most 1, the ratio if "
        "the busiest rank of every phase moved its bytes at one rank's copy bandwidth under its SM budget; "
        "barriers: the ceiling with the op's two barriers at what two barriers alone take)\n");
    for (const bench::Case& c : o.cases) {
        const double sigma = sigmas.sigma(c, 42);
        const std::vector<int> calls = o.tokens_per_call.empty() ? std::vector<int>{c.shape.tokens} : o.tokens_per_call;
        for (int s : calls) data_plane_case(o, c, s, sigma, copy_gbps, csv);
    }
    return 0;
}

int main(int argc, char** argv) {
    return bench::run_main("ops_bench", [&] { return run(argc, argv); });
}
