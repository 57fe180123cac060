// Serving and decode on R virtual ranks of one GPU (issues 43 and 47), at the kernel level (the library's kernels on
// LocalDeviceGroup streams, their Args from common/kernel_step.cuh; no Buffer). Per shape and tokens per call s:
//   step      plan + dispatch + pull prefetch of the B slots (bf16 weights, one projection; plan-ordered, without
//             its barrier, as flatep.nn.MoE serves: PrefetchArgs::plan_ordered) + combine, every rank's
//             stream replayed as one CUDA graph (forked from and joined into rank 0's; each rank's part is what a
//             captured step of one rank runs). The expert GEMM is left out: combine reads fixed expert outputs.
//             Modes: the owner planner (no replicas, no prefetch; its layout sized for decode, S = --owner-tokens,
//             the same [E+B] view as balanced_b<B>), the balanced planner at B = --slots, and at B = epn.
//   plan      the plan op alone, the same graph replay; dispatch and combine alone likewise (over the step's plan).
//   prefetch  the pull of the plan's slots, per mode: bf16 weights; FP8 weights (1 byte) with their fp32 scales of
//             1x128 blocks as a companion projection, in one op (as ExpertPools moves a layer) and, for the A/B, in
//             one op per projection (fp8_op_per_projection: two barriers); at B = epn also the training's push of
//             the same slots; the pull's barrier alone (prefetch.barrier: an op with no slot to fill, the op's fixed
//             part); and bf16 and FP8 plan-ordered (prefetch.bf16.plan_ordered, prefetch.fp8.plan_ordered: no
//             barrier; the plan op's met every rank after its weights were written). Bytes: what the busiest rank
//             pulls into its slots.
//   step.ordered, dispatch.ordered, combine.ordered  dispatch and combine without their entry barriers, as
//             flatep.nn.MoE serves (DispatchArgs / CombineArgs::plan_ordered: ordered by the step's plan op).
//   plan.counts, plan.counts_planner  the plan op's first phases alone: the counts' histogram and all-gather, then
//             the planner too (the plan is then incomplete; timing only).
//   barrier.x3  three barriers in a row on every rank: against prefetch.barrier (one), what a barrier adds inside a
//             chain of kernels.
//   step.no_prefetch, step.fp8  the balanced step without its prefetch, and with the FP8 pair pulled instead of bf16:
//             the prefetch's cost inside a step (the graph's own launch not counted twice).
//   slot_memory  bytes of one rank's slot pool per projection at B and at epn (bf16 and FP8 + scales).
// The table ends with the ratios the issues target: owner decode step / balanced at B (s = 128: at most 0.6), FP8
// prefetch / bf16 (at most 0.55), and B against epn. Timings are medians of --iters replays after --warmup; with
// --batch N a replay holds N calls of the row's op (each forked to and joined from every rank's stream) and the time
// is the replay's / N, so the graph's own launch is shared as a step's graph of every layer shares it.
//
//   serving_bench [--preset deepep,k3] [shape and skew flags] [--tokens-per-call 1,16,128,512,S] [--slots 4]
//                 [--owner-tokens 512] [--ffn 2048] [--iters 20] [--warmup 3] [--batch 1] [--num-sms 0]
//                 [--csv serving_bench.csv] [--memory-gib G]
//   serving_bench --quick     tiny shapes (E=64, H=512, F=256, S=256), a smoke of every row in seconds
//
// Defaults: DeepEP's shape (E=256, H=7168, K=8, uniform routing) and Kimi K3's (E=896, H=7168, K=8, maxvio 1), both
// at S = 4096 on 8 ranks; --ffn F = 2048: one projection of F x H bf16 per expert (a whole expert is three such
// matrices: three times the prefetch bytes). At K3 every rank's pools (own experts and epn slots, bf16 and FP8) take
// 10 GB, 80 GB for 8 ranks, plus 2.7 GB a rank of step buffers at S = 4096: within one H200's 141 GB. Before it
// allocates anything it prints every case's and mode's estimate of device memory (common/memory.hpp) and refuses, exit
// status 2 and one line, one that does not fit the GPU's free memory (--memory-gib G: G GiB instead).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
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

struct Options {
    int iters = 20, warmup = 3;
    std::string csv = "serving_bench.csv";
    std::vector<int> tokens_per_call;  // empty: 1, 16, 128, 512, S
    int num_slots = 4;
    int owner_tokens = 512;
    int num_sms = 0;
    int batch = 1;
    bool quick = false;
    double memory_gib = 0;  // --memory-gib: 0, the device's free memory
};

constexpr int kScaleBlock = 128;  // FP8 weights: one fp32 scale per 1x128 block

struct Mode {
    std::string name;
    PlannerKind planner;
    int num_slots;  // B (-1: epn)
    bool owner;
};

std::string label(const bench::Shape& s) { return s.label() + "_F" + std::to_string(s.ffn); }

// Every rank's inputs of a step at s tokens: routing drawn on the host (sigma, seed 42), the rest random on the device.
void fill_inputs(bench::KernelStep& dev, const Layout& l, int s, double sigma) {
    const std::vector<double> pop = routing::popularity(l.num_experts, sigma, 42);
    std::vector<int32_t> topk(size_t(s) * l.topk);
    for (int r = 0; r < l.num_ranks; ++r) {
        bench::KernelStep::Rank& p = dev.rank(r);
        routing::sample_topk(pop, s, l.topk, 42, r, topk.data());
        FLATEP_CUDA_CHECK(cudaMemcpy(p.topk, topk.data(), topk.size() * 4, cudaMemcpyHostToDevice));
        bench::fill_device_bf16(p.x, int64_t(s) * l.hidden, 100 + r);
        bench::fill_device_bf16(p.weights, int64_t(s) * l.topk * 2, 200 + r);  // bf16 pairs: finite floats
        bench::fill_device_bf16(p.y, int64_t(l.num_recv_rows) * l.hidden, 300 + r);
    }
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
}

// The ops of a serving step, every rank on its stream (no host sync, capturable): plan (or its first phases),
// dispatch (trusting the receive rows' marks once a dispatch set them, as a Buffer does), the pull (or push) of
// projections [first, first + count) in one op (or one op per projection, the form before one op carried several,
// kept for the A/B), combine. plan_ordered: the pull without its barrier; step_ordered: dispatch and combine without
// their entry barriers (as flatep.nn.MoE serves).
struct ServingOps {
    bench::KernelStep& dev;
    testing::LocalDeviceGroup& group;
    bool prefetch_in_step = true, plan_ordered = false, step_ordered = false, marks_set = false;

    void plan(int phases = 3) { dev.enqueue_plan(phases); }
    void dispatch() {
        for (int r = 0; r < group.num_ranks(); ++r) {
            DispatchArgs a = dev.dispatch_args(r);
            a.marks_valid = marks_set;
            a.plan_ordered = step_ordered;
            kernels::launch(a, group.stream(r), group.num_sms());
        }
        marks_set = true;  // stream order: the next dispatch of every rank sees the marks this one wrote
    }
    void prefetch(int first, int count, bool push = false, bool op_per_projection = false) {
        const int step = op_per_projection ? 1 : count;
        for (int q = first; q < first + count; q += step)
            for (int r = 0; r < group.num_ranks(); ++r)
                kernels::launch(dev.prefetch_args(r, q, step, push, plan_ordered), group.stream(r), group.num_sms());
    }
    void combine() {
        for (int r = 0; r < group.num_ranks(); ++r) {
            CombineArgs a = dev.combine_args(r);
            a.plan_ordered = step_ordered;
            kernels::launch(a, group.stream(r), group.num_sms());
        }
    }
    // plan, dispatch, the prefetch of projections [first, first + count) (count 0: none; when the step has one),
    // combine
    void step(int count, int first = 0) {  // count -1: every projection from first
        if (count < 0) count = int(dev.rank(0).own.size()) - first;
        plan();
        dispatch();
        if (prefetch_in_step && count != 0) prefetch(first, count);
        combine();
    }
};

// Slots each rank fills this step (from rank 0's copy of the plan's slot table; every rank's is the same).
std::vector<int> slots_used(const Layout& l, const std::vector<int32_t>& plan) {
    const PlanView v = make_plan_view(l, const_cast<int32_t*>(plan.data()));
    std::vector<int> used(size_t(l.num_ranks), 0);
    for (int d = 0; d < l.num_ranks; ++d)
        for (int j = 0; j < l.num_slots; ++j) used[size_t(d)] += v.slot_expert[d * l.experts_per_rank + j] >= 0;
    return used;
}

class Report {
  public:
    Report(const std::string& path, int batch)
        : batch_(batch),
          csv_(path, {"config",
                      "shape",
                      "s",
                      "mode",
                      "op",
                      "graph_us_median",
                      "graph_us_min",
                      "bytes_per_rank_max",
                      "bytes_per_rank_mean",
                      "slots_used_max",
                      "slots_used_total",
                      "R",
                      "S_layout",
                      "E",
                      "H",
                      "K",
                      "ffn",
                      "B",
                      "sigma",
                      "max_blocks",
                      "batch"}) {
        std::printf("%-8s %-32s %5s %-14s %-16s %10s %10s %13s\n", "config", "shape", "s", "mode", "op", "graph_us",
                    "min_us", "MB_rank_max");
    }
    struct Row {
        const bench::Case* c;
        const Layout* l;
        int s;
        std::string mode, op;
        bench::Timing t;
        double bytes_max = 0, bytes_mean = 0;
        int used_max = 0, used_total = 0;
    };
    void add(const Row& r, double sigma, int max_blocks) {
        std::printf("%-8s %-32s %5d %-14s %-16s %10.1f %10.1f %13.2f\n", r.c->preset.c_str(), label(r.c->shape).c_str(),
                    r.s, r.mode.c_str(), r.op.c_str(), r.t.median_us, r.t.min_us, r.bytes_max / 1e6);
        csv_.row(r.c->preset, label(r.c->shape), r.s, r.mode, r.op, bench::fixed(r.t.median_us, 2),
                 bench::fixed(r.t.min_us, 2), bench::fixed(r.bytes_max, 0), bench::fixed(r.bytes_mean, 0), r.used_max,
                 r.used_total, r.l->num_ranks, r.l->num_tokens, r.l->num_experts, r.l->hidden, r.l->topk,
                 r.c->shape.ffn, r.l->num_slots, sigma, max_blocks, batch_);
        median_[key(*r.c, r.s, r.mode, r.op)] = r.t.median_us;
        bytes_[key(*r.c, r.s, r.mode, r.op)] = r.bytes_max;
        std::fflush(stdout);
    }
    // Median of a row added before (-1: none).
    double us(const bench::Case& c, int s, const std::string& mode, const std::string& op) const {
        auto it = median_.find(key(c, s, mode, op));
        return it == median_.end() ? -1 : it->second;
    }
    double bytes(const bench::Case& c, int s, const std::string& mode, const std::string& op) const {
        auto it = bytes_.find(key(c, s, mode, op));
        return it == bytes_.end() ? -1 : it->second;
    }

  private:
    static std::string key(const bench::Case& c, int s, const std::string& mode, const std::string& op) {
        return c.preset + "|" + label(c.shape) + "|" + std::to_string(s) + "|" + mode + "|" + op;
    }
    int batch_;
    bench::CsvWriter csv_;
    std::map<std::string, double> median_, bytes_;
};

void print_ratio(const char* what, double num, double den, const char* target) {
    if (num < 0 || den <= 0) return;
    std::printf("  %-62s %8.3f   %s\n", what, num / den, target);
}

std::vector<Mode> modes_of(const Options& o) {
    return {{"owner", PlannerKind::kOwner, o.num_slots, true},
            {"balanced_b" + std::to_string(o.num_slots), PlannerKind::kBalanced, o.num_slots, false},
            {"balanced_bepn", PlannerKind::kBalanced, -1, false}};
}

// One projection's bytes per expert: bf16 F x H, and FP8 with its fp32 scales of 1x128 blocks.
std::vector<int64_t> projection_bytes(const bench::Shape& sh) {
    const int64_t elems = int64_t(sh.hidden) * sh.ffn;
    return {elems * 2, elems, elems / kScaleBlock * 4};
}

// A mode's device buffers at s tokens per call (the owner's layout at S = --owner-tokens).
bench::KernelStepSpec mode_spec(const Options& o, const bench::Case& c, const Mode& m, int s) {
    Config cfg = c.shape.config();
    if (m.owner) cfg.num_tokens = o.owner_tokens;
    bench::KernelStepSpec spec;
    spec.layout = make_layout(cfg, m.planner, ViewShape{.num_slots = m.num_slots});
    spec.planner = m.planner;
    spec.tokens.assign(size_t(cfg.num_ranks), s);
    spec.expert_bytes = projection_bytes(c.shape);
    spec.pool_slots = spec.layout.experts_per_rank;  // every rank's pools hold epn slots; the pull fills the first B
    return spec;
}

// Every case's and mode's device memory (one mode's KernelStep at a time; s changes no size).
std::vector<bench::MemoryEstimate> serving_memory(const Options& o, const std::vector<bench::Case>& cases) {
    std::vector<bench::MemoryEstimate> all;
    for (const bench::Case& c : cases) {
        for (const Mode& m : modes_of(o)) {
            bench::MemoryEstimate e = bench::kernel_step_memory(mode_spec(o, c, m, 1));
            e.what = "preset " + c.preset + " (" + c.shape.label() + ", ffn " + std::to_string(c.shape.ffn) + ", " +
                     m.name + ")";
            all.push_back(e);
        }
    }
    return all;
}

void run_case(const Options& o, const bench::Case& c, double sigma, const std::vector<int>& calls, Report& report) {
    const bench::Shape& sh = c.shape;
    const Layout base = make_layout(sh.config());
    const int R = base.num_ranks, epn = base.experts_per_rank, B = o.num_slots;
    const std::vector<int64_t> bytes = projection_bytes(sh);  // bf16; FP8 and its scales
    testing::LocalDeviceGroup group(R, false, 60.0, o.num_sms);
    // Slot memory of one rank: one row per B, bf16 and FP8 with its scales.
    for (int slots : {B, epn}) {
        Report::Row row{&c, &base, 0, slots == epn ? "bepn" : "b" + std::to_string(B), "slot_memory.bf16"};
        row.bytes_max = row.bytes_mean = double(slots) * double(bytes[0]);
        report.add(row, sigma, group.num_sms());
        row.op = "slot_memory.fp8";
        row.bytes_max = row.bytes_mean = double(slots) * double(bytes[1] + bytes[2]);
        report.add(row, sigma, group.num_sms());
    }
    for (int s : calls) {
        for (const Mode& m : modes_of(o)) {
            if (m.owner && s > o.owner_tokens) continue;  // the owner layout is sized for decode
            const bench::KernelStepSpec spec = mode_spec(o, c, m, s);
            const Layout& l = spec.layout;
            bench::KernelStep dev(spec, group);
            for (int q = 0; q < int(bytes.size()); ++q)
                for (int r = 0; r < R; ++r)
                    bench::fill_device_bf16(dev.rank(r).own[size_t(q)], epn * bytes[q] / 2, 1000 + 16 * q + r);
            fill_inputs(dev, l, s, sigma);
            // The pull as nn.MoE serves (plan-ordered); a dispatch trusts the marks an earlier one set, as a Buffer's.
            ServingOps ops{dev, group, /*prefetch_in_step=*/!m.owner, /*plan_ordered=*/!m.owner};
            ops.step(-1);  // eager once: the plans the rows below count, the kernels loaded

            group.synchronize();
            const std::string stuck = dev.wait_failure();
            FLATEP_CHECK_RUNTIME(stuck.empty(), c.preset, " s=", s, " ", m.name, ": ", stuck);
            const std::vector<int> used = slots_used(l, dev.download_plan(0));
            const int used_max = *std::max_element(used.begin(), used.end());
            int used_total = 0;
            for (int u : used) used_total += u;
            auto row = [&](const std::string& op, const bench::Timing& t, int64_t expert_bytes) {
                Report::Row r{&c, &l, s, m.name, op, t};
                r.bytes_max = double(used_max) * double(expert_bytes);
                r.bytes_mean = double(used_total) * double(expert_bytes) / R;
                r.used_max = used_max;
                r.used_total = used_total;
                report.add(r, sigma, group.num_sms());
            };
            auto timed = [&](const std::function<void()>& op) {
                return bench::time_ranks_graph(group, o.iters, o.warmup, o.batch, op);
            };
            // The step pulls the bf16 projection only (the pools also hold the FP8 pair the prefetch rows time).
            row("step", timed([&] { ops.step(/*count=*/1); }), m.owner ? 0 : bytes[0]);
            row("plan", timed([&] { ops.plan(); }), 0);
            row("dispatch", timed([&] { ops.dispatch(); }), 0);  // the step's plan, replayed alone
            row("combine", timed([&] { ops.combine(); }), 0);
            // Dispatch and combine without their entry barriers (DispatchArgs / CombineArgs::plan_ordered: the step's
            // plan op met every rank after its previous step), in the step and alone.
            ops.step_ordered = true;
            row("step.ordered", timed([&] { ops.step(/*count=*/1); }), m.owner ? 0 : bytes[0]);
            row("dispatch.ordered", timed([&] { ops.dispatch(); }), 0);
            row("combine.ordered", timed([&] { ops.combine(); }), 0);
            ops.step_ordered = false;
            // The plan op's phases: the histogram and all-gather of the counts, then the planner too (the rest of the
            // op's time is the routing and the unpack).
            row("plan.counts", timed([&] { ops.plan(1); }), 0);
            row("plan.counts_planner", timed([&] { ops.plan(2); }), 0);
            // Three barriers in a row on every rank (what a barrier adds inside a chain of kernels; prefetch.barrier
            // below is one).
            auto barriers = [&](int n) {
                for (int r = 0; r < R; ++r) {
                    PrefetchArgs a = dev.prefetch_args(r, 0, 1, false);
                    a.num_slots = 0;  // the pull's barrier, then nothing to copy
                    a.plan_ordered = false;
                    for (int i = 0; i < n; ++i) kernels::launch(a, group.stream(r), group.num_sms());
                }
            };
            row("barrier.x3", timed([&] { barriers(3); }), 0);
            if (!m.owner) {
                // The pull with its barrier (the op's default), then plan-ordered.
                ops.plan_ordered = false;
                row("prefetch.bf16", timed([&] { ops.prefetch(0, 1); }), bytes[0]);
                row("prefetch.fp8", timed([&] { ops.prefetch(1, 2); }), bytes[1] + bytes[2]);
                row("prefetch.fp8_op_per_projection",
                    timed([&] { ops.prefetch(1, 2, false, /*op_per_projection=*/true); }), bytes[1] + bytes[2]);
                ops.plan_ordered = true;
                row("prefetch.bf16.plan_ordered", timed([&] { ops.prefetch(0, 1); }), bytes[0]);
                row("prefetch.fp8.plan_ordered", timed([&] { ops.prefetch(1, 2); }), bytes[1] + bytes[2]);
                // The prefetch's cost inside a step: the step without it, and with the FP8 pair instead of bf16.
                row("step.no_prefetch", timed([&] { ops.step(/*count=*/0); }), 0);
                row("step.fp8", timed([&] { ops.step(/*count=*/2, /*first=*/1); }), bytes[1] + bytes[2]);
                // The pull's fixed part: its barrier alone (an op with no slot to fill).
                row("prefetch.barrier", timed([&] { barriers(1); }), 0);
                if (m.num_slots < 0)
                    row("prefetch_push.bf16", timed([&] { ops.prefetch(0, 1, /*push=*/true); }), bytes[0]);
            }
            const std::string late = dev.wait_failure();
            FLATEP_CHECK_RUNTIME(late.empty(), c.preset, " s=", s, " ", m.name, ": ", late);
        }
    }
    // The ratios the issues target.
    const std::string bm = "balanced_b" + std::to_string(B);
    const int S = sh.tokens;
    std::printf("ratios, %s %s (targets from issues 43 and 47):\n", c.preset.c_str(), label(sh).c_str());
    for (int s : calls) {
        const std::string at = " at s=" + std::to_string(s);
        print_ratio(("owner step / " + bm + " step" + at).c_str(), report.us(c, s, "owner", "step"),
                    report.us(c, s, bm, "step"), s == 128 ? "(target <= 0.6)" : "");
        print_ratio(("owner step.ordered / " + bm + " step.ordered" + at).c_str(),
                    report.us(c, s, "owner", "step.ordered"), report.us(c, s, bm, "step.ordered"),
                    s == 128 ? "(target <= 0.6)" : "");
        print_ratio(("owner plan / " + bm + " plan" + at).c_str(), report.us(c, s, "owner", "plan"),
                    report.us(c, s, bm, "plan"), "");
        print_ratio((bm + " step / balanced_bepn step" + at).c_str(), report.us(c, s, bm, "step"),
                    report.us(c, s, "balanced_bepn", "step"), "");
    }
    for (const std::string& mode : {bm, std::string("balanced_bepn")}) {
        print_ratio(("FP8 prefetch / bf16 prefetch, " + mode + " at s=S").c_str(),
                    report.us(c, S, mode, "prefetch.fp8"), report.us(c, S, mode, "prefetch.bf16"), "(target <= 0.55)");
        print_ratio(("FP8 / bf16 prefetch, plan-ordered (no barrier), " + mode + " at s=S").c_str(),
                    report.us(c, S, mode, "prefetch.fp8.plan_ordered"),
                    report.us(c, S, mode, "prefetch.bf16.plan_ordered"), "(target <= 0.55)");
        print_ratio(("bf16 prefetch, plan-ordered / with its barrier, " + mode + " at s=S").c_str(),
                    report.us(c, S, mode, "prefetch.bf16.plan_ordered"), report.us(c, S, mode, "prefetch.bf16"), "");
        print_ratio(("FP8 prefetch, one op per projection / bf16, " + mode + " at s=S").c_str(),
                    report.us(c, S, mode, "prefetch.fp8_op_per_projection"), report.us(c, S, mode, "prefetch.bf16"),
                    "(before: two ops)");
        print_ratio(("FP8 prefetch bytes / bf16, " + mode + " at s=S").c_str(),
                    report.bytes(c, S, mode, "prefetch.fp8"), report.bytes(c, S, mode, "prefetch.bf16"), "");
        // In the step: (step.fp8 - step.no_prefetch) / (step - step.no_prefetch), the prefetch's share of a step.
        const double none = report.us(c, S, mode, "step.no_prefetch");
        if (none > 0)
            print_ratio(("FP8 / bf16 prefetch's cost in the step, " + mode + " at s=S").c_str(),
                        report.us(c, S, mode, "step.fp8") - none, report.us(c, S, mode, "step") - none, "");
        // The floor the op's fixed part leaves: FP8 copying at bf16's rate per byte, plus the barrier's time.
        const double bar = report.us(c, S, mode, "prefetch.barrier"), bf = report.us(c, S, mode, "prefetch.bf16");
        const double bytes_ratio = report.bytes(c, S, mode, "prefetch.fp8") / report.bytes(c, S, mode, "prefetch.bf16");
        if (bar > 0 && bf > bar)
            print_ratio(("FP8 / bf16 floor: barrier + bf16's copy rate, " + mode + " at s=S").c_str(),
                        bar + (bf - bar) * bytes_ratio, bf, "");
    }
    print_ratio(("prefetch " + bm + " / balanced_bepn at s=S").c_str(), report.us(c, S, bm, "prefetch.bf16"),
                report.us(c, S, "balanced_bepn", "prefetch.bf16"), "");
    print_ratio("pull / push prefetch, balanced_bepn at s=S", report.us(c, S, "balanced_bepn", "prefetch.bf16"),
                report.us(c, S, "balanced_bepn", "prefetch_push.bf16"), "");
    print_ratio(("slot memory b" + std::to_string(B) + " / bepn").c_str(), double(B), double(epn), "");
    std::fflush(stdout);
}

}  // namespace

static int run(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    Options o;
    bench::Flags flags("serving_bench", "Serving and decode steps on R virtual ranks of one GPU (issues 43, 47)");
    flags.add_sweep({"deepep", "k3"}, /*default_ffn=*/2048);
    flags.add_timing(&o.iters, &o.warmup);
    flags.add_csv(&o.csv);
    flags.add("--tokens-per-call", &o.tokens_per_call, "s: tokens each rank passes, a list (default 1,16,128,512,S)");
    flags.add("--slots", &o.num_slots, "B: replica slots per rank of the serving rows (B = epn rows run too)", 0, 4096);
    flags.add("--owner-tokens", &o.owner_tokens, "S of the owner planner's layout (capacity R*S*K rows)", 1, 1 << 20);
    flags.add("--batch", &o.batch,
              "ops a graph replay holds (the time is the replay's / batch): 1 charges the graph's launch to the op, "
              "more share it, as a step's graph of every layer's ops does",
              1, 64);
    flags.add("--num-sms", &o.num_sms, "every rank's SM budget: blocks per launch at most (0: twice SMs / R)", 0, 2048);
    flags.add_switch("--quick", &o.quick, "tiny shapes (E=64, H=512, F=256, S=256, s 1,16,64,256): a smoke test");
    flags.add_memory(&o.memory_gib);
    flags.parse(argc, argv);
    // One case per preset and shape: S = 4096 and K = 8 unless given, the preset's first skew unless given.
    std::vector<bench::Case> cases;
    for (bench::Case c : flags.cases()) {
        if (!flags.given("--topk") && c.shape.topk != 8) continue;
        if (!flags.given("--tokens")) c.shape.tokens = 4096;
        if (o.quick) c.shape = bench::Shape{c.shape.ranks, 256, 512, 256, 64, 8, 128, 1.0};
        const bool seen = std::any_of(cases.begin(), cases.end(), [&](const bench::Case& d) {
            return d.preset == c.preset && d.shape.label() == c.shape.label() && d.shape.ffn == c.shape.ffn;
        });
        if (!seen || flags.given("--maxvio") || flags.given("--sigma")) cases.push_back(c);
    }
    if (o.quick) {
        o.tokens_per_call = {1, 16, 64, 256};
        o.owner_tokens = std::min(o.owner_tokens, 64);
        o.iters = std::min(o.iters, 5);
        o.warmup = std::min(o.warmup, 1);
    }
    for (const bench::Case& c : cases) {
        const Config cfg = flags.validated(c.shape);
        const int epn = cfg.num_experts / cfg.num_ranks;
        if (cfg.num_ranks > kMaxRanks) flags.fail("--ranks: at most " + std::to_string(kMaxRanks) + " virtual ranks");
        if (o.num_slots >= epn)
            flags.fail("--slots " + std::to_string(o.num_slots) + ": needs B < epn = " + std::to_string(epn) + " (" +
                       c.shape.label() + "; B = epn rows run anyway)");
        if (int64_t(cfg.hidden) * c.shape.ffn % (kScaleBlock * 4) != 0)
            flags.fail("--ffn " + std::to_string(c.shape.ffn) + ": H*F must be a multiple of 512 (FP8 scales of 1x" +
                       std::to_string(kScaleBlock) + " blocks, 16-byte rows)");
        for (int s : o.tokens_per_call)
            if (s < 1 || s > cfg.num_tokens)
                flags.fail("--tokens-per-call " + std::to_string(s) + ": needs 1 <= s <= S (" + c.shape.label() + ")");
    }
    // The estimate against --memory-gib before anything else (so also without a GPU), or the device's free memory.
    if (o.memory_gib > 0) bench::require_device_fit("serving_bench", serving_memory(o, cases), o.memory_gib);
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    if (o.memory_gib <= 0) bench::require_device_fit("serving_bench", serving_memory(o, cases), 0);
    bench::SigmaTable sigmas(/*bisection_ranks=*/8);
    sigmas.prepare(cases, {42});
    Report report(o.csv, o.batch);
    for (const bench::Case& c : cases) {
        std::vector<int> calls = o.tokens_per_call;
        if (calls.empty()) {
            for (int s : {1, 16, 128, 512})
                if (s < c.shape.tokens) calls.push_back(s);
            calls.push_back(c.shape.tokens);
        }
        run_case(o, c, sigmas.sigma(c, 42), calls, report);
    }
    std::printf("CSV: %s\n", o.csv.c_str());
    return 0;
}

int main(int argc, char** argv) {
    return bench::run_main("serving_bench", [&] { return run(argc, argv); });
}
