// The CPU data plane (plan, dispatch, combine over R rank threads) against a naive single-threaded reference that
// derives every entry's rank and row (testing::reference_plan: the split rule and group layout of the contract,
// written without FlatEP code), then every rank's receive rows, weights and combine outputs from them and the inputs
// directly (no chains).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "host/op_stats.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "routing/routing.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"
#include "unit/host/reference_plan.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::bits_of;
using testing::random_bf16;
using testing::random_floats;
using testing::run_ranks;

constexpr int kCanaryRows = 3;
constexpr uint16_t kCanaryX = 0xa5a5;
constexpr uint32_t kCanaryWBits = 0xdeadbeef;

float canary_w() { return testing::float_of(kCanaryWBits); }

struct Case {
    int R, epn, S, K, H, align;
    double capacity_factor, sigma;
    uint64_t seed;
    bool partial;         // ranks pass s < S tokens (differing per rank, some 0)
    bool int64_idx;       // topk_idx as int64
    bool topk_weights;    // dispatch gets routing weights (else null: weight 1)
    bool weighted;        // combine multiplies by recv_w
    bool alias;           // dispatch writes into the symmetric receive region
    PlannerKind planner;  // planner used by every rank
    int steps = 2;        // steps on the same buffers (staging reused without reset)
};

std::string describe(const Case& c) {
    std::ostringstream os;
    os << "R=" << c.R << " E=" << c.R * c.epn << " S=" << c.S << " K=" << c.K << " H=" << c.H << " align=" << c.align
       << " cf=" << c.capacity_factor << " sigma=" << c.sigma << " seed=" << c.seed << " partial=" << c.partial
       << " int64=" << c.int64_idx << " topk_weights=" << c.topk_weights << " weighted=" << c.weighted
       << " alias=" << c.alias << " planner=" << int(c.planner);
    return os.str();
}

Config config_of(const Case& c, int rank) {
    Config cfg;
    cfg.num_ranks = c.R;
    cfg.rank = rank;
    cfg.num_experts = c.R * c.epn;
    cfg.num_tokens = c.S;
    cfg.topk = c.K;
    cfg.hidden = c.H;
    cfg.align = c.align;
    cfg.capacity_factor = c.capacity_factor;
    return cfg;
}

// One rank's inputs of one step.
struct RankInput {
    int num_tokens = 0;
    std::vector<int32_t> topk_idx;  // [s][K]
    std::vector<int64_t> topk_idx64;
    std::vector<uint16_t> x;     // [s][H]
    std::vector<float> weights;  // [s][K] or empty
    std::vector<uint16_t> y;     // [NvS][H] expert outputs fed to combine
};

std::vector<RankInput> make_inputs(const Case& c, const Layout& l, int step) {
    const uint64_t seed = c.seed * 1000 + uint64_t(step);
    const std::vector<double> pop = routing::popularity(l.num_experts, c.sigma, seed);
    std::vector<RankInput> in(c.R);
    for (int r = 0; r < c.R; ++r) {
        RankInput& ri = in[r];
        ri.num_tokens = c.partial ? (c.S * (r + 1 + step) + r) % (c.S + 1) : c.S;
        std::vector<int32_t> full(size_t(c.S) * c.K);
        routing::sample_topk(pop, c.S, c.K, seed, r, full.data());
        ri.topk_idx.assign(full.begin(), full.begin() + int64_t(ri.num_tokens) * c.K);
        ri.topk_idx64.assign(ri.topk_idx.begin(), ri.topk_idx.end());
        const uint64_t stream = routing::mix64(seed * 131 + uint64_t(r));
        ri.x = random_bf16(size_t(ri.num_tokens) * c.H, stream ^ 1);
        if (c.topk_weights) ri.weights = random_floats(size_t(ri.num_tokens) * c.K, stream ^ 2, 0.05f, 1.0f);
        ri.y = testing::random_bf16_wide(size_t(l.num_recv_rows) * c.H, stream ^ 3);
    }
    return in;
}

// What one rank produced in one step (receive buffers and out with their canary rows).
struct RankOutput {
    std::vector<uint16_t> recv_x;  // [kCanaryRows + NvS + kCanaryRows][H]
    std::vector<float> recv_w;     // [kCanaryRows + NvS + kCanaryRows]
    std::vector<uint16_t> out;     // [kCanaryRows + S + kCanaryRows][H]
    std::vector<int32_t> alloc, slot_expert, cu_seqlens, entry_rank, entry_row;
    host::OpStats stats;
    bool operator==(const RankOutput& o) const {
        return recv_x == o.recv_x && recv_w == o.recv_w && out == o.out && alloc == o.alloc &&
               slot_expert == o.slot_expert && cu_seqlens == o.cu_seqlens && entry_rank == o.entry_rank &&
               entry_row == o.entry_row;
    }
};

using StepOutputs = std::vector<std::vector<RankOutput>>;  // [step][rank]

StepOutputs run_threaded(const Case& c, const Layout& l, const std::vector<std::vector<RankInput>>& inputs) {
    StepOutputs outputs(c.steps, std::vector<RankOutput>(c.R));
    LocalHostWorld world(c.R, 30.0);
    const int nvs = l.num_recv_rows, H = c.H;
    const std::vector<std::string> errors = run_ranks(c.R, [&](int rank) {
        Buffer buffer(config_of(c, rank), world.transport(rank), c.planner);
        for (int step = 0; step < c.steps; ++step) {
            const RankInput& in = inputs[step][rank];
            RankOutput& o = outputs[step][rank];
            internal::set_op_stats(buffer, &o.stats);
            const Plan plan = c.int64_idx ? buffer.plan(in.topk_idx64.data(), 8, in.num_tokens)
                                          : buffer.plan(in.topk_idx.data(), 4, in.num_tokens);
            o.recv_x.assign(size_t(nvs + 2 * kCanaryRows) * H, kCanaryX);
            o.recv_w.assign(size_t(nvs + 2 * kCanaryRows), canary_w());
            uint16_t* recv_x = c.alias ? buffer.symmetric_recv_x() : o.recv_x.data() + kCanaryRows * H;
            float* recv_w = c.alias ? buffer.symmetric_recv_w() : o.recv_w.data() + kCanaryRows;
            buffer.dispatch(plan, in.x.data(), c.topk_weights ? in.weights.data() : nullptr, recv_x, recv_w);
            if (c.alias) {  // rows past the last group end of the symmetric region are unspecified: copy the rest
                const int end = plan.cu_seqlens(rank).back();
                std::memcpy(o.recv_x.data() + kCanaryRows * H, recv_x, size_t(end) * H * 2);
                std::memcpy(o.recv_w.data() + kCanaryRows, recv_w, size_t(end) * 4);
            }
            o.out.assign(size_t(c.S + 2 * kCanaryRows) * H, kCanaryX);
            buffer.combine(plan, in.y.data(), c.weighted ? recv_w : nullptr, o.out.data() + kCanaryRows * H);
            internal::set_op_stats(buffer, nullptr);
            buffer.check_status();
            auto copy = [](std::span<const int32_t> s) { return std::vector<int32_t>(s.begin(), s.end()); };
            o.alloc = copy(plan.alloc());
            for (int d = 0; d < c.R; ++d) {
                for (int32_t v : plan.slot_expert(d)) o.slot_expert.push_back(v);
                for (int32_t v : plan.cu_seqlens(d)) o.cu_seqlens.push_back(v);
            }
            o.entry_rank = copy(plan.entry_ranks());
            o.entry_row = copy(plan.entry_rows());
        }
    });
    EXPECT_EQ(testing::failures(errors), "");
    return outputs;
}

// Checks one step of the threaded run against the naive reference. The allocation is the planner's choice: it is
// checked against design §4's constraints and against the planner run on the same counts (the Buffer plans what the
// planner plans); everything else (which rank computes each entry, its row, slots, group ends, padding) comes from
// testing::reference_plan, written from the contract without FlatEP code.
void check_step(const Case& c, const Layout& l, const std::vector<RankInput>& in, const std::vector<RankOutput>& out) {
    const int R = c.R, E = l.num_experts, K = c.K, H = c.H, nvs = l.num_recv_rows;
    std::vector<int32_t> tpe(size_t(R) * E, 0);
    std::vector<std::vector<int32_t>> topk(R);
    for (int r = 0; r < R; ++r) {
        for (int32_t e : in[r].topk_idx) ++tpe[size_t(r) * E + e];
        topk[r] = in[r].topk_idx;
    }
    const std::vector<int32_t>& alloc = out[0].alloc;
    ASSERT_EQ(testing::alloc_violation(R, E, l.exact, l.capacity, tpe, alloc), "");
    planner::HostPlan planned(l);  // wiring: the Buffer's allocation is the planner's on the gathered counts
    std::copy(tpe.begin(), tpe.end(), planned.view.tpe_all);
    planner::plan_counts(l, c.planner, planned.view);
    ASSERT_EQ(alloc, std::vector<int32_t>(planned.view.alloc, planned.view.alloc + int64_t(R) * E));
    const testing::ReferencePlan ref = testing::reference_plan(R, E, c.align, alloc, topk);
    const std::vector<std::vector<int32_t>>& ref_rank = ref.entry_rank;
    const std::vector<std::vector<int32_t>>& ref_row = ref.entry_row;
    for (int r = 0; r < R; ++r) {
        ASSERT_EQ(out[r].alloc, alloc) << "rank " << r;
        ASSERT_EQ(out[r].slot_expert, ref.slot_expert) << "rank " << r;
        ASSERT_EQ(out[r].cu_seqlens, ref.cu_seqlens) << "rank " << r;
        ASSERT_EQ(out[r].entry_rank, ref_rank[r]) << "rank " << r;
        ASSERT_EQ(out[r].entry_row, ref_row[r]) << "rank " << r;
    }

    // Dispatch: expected receive buffers, canaries included.
    std::vector<std::vector<uint16_t>> exp_x(R, std::vector<uint16_t>(size_t(nvs + 2 * kCanaryRows) * H, kCanaryX));
    std::vector<std::vector<float>> exp_w(R, std::vector<float>(size_t(nvs + 2 * kCanaryRows), canary_w()));
    std::vector<std::vector<int>> writes(R, std::vector<int>(nvs, 0));
    std::vector<std::vector<char>> real(R, std::vector<char>(nvs, 0));
    for (int d = 0; d < R; ++d) {
        for (int e = 0; e < E; ++e) {
            const int start = ref.group_start[size_t(d) * E + e];
            if (start < 0) continue;
            const int size = alloc[size_t(d) * E + e];
            const int padded = (size + c.align - 1) / c.align * c.align;
            ASSERT_LE(start + padded, nvs) << "rank " << d << " expert " << e;
            for (int r = start; r < start + size; ++r) real[d][r] = 1;
            for (int r = start + size; r < start + padded; ++r) {
                std::fill_n(exp_x[d].begin() + int64_t(kCanaryRows + r) * H, H, uint16_t(0));
                exp_w[d][kCanaryRows + r] = 0.0f;
            }
        }
    }
    int64_t pairs = 0, remote_pairs = 0;
    for (int s = 0; s < R; ++s) {
        for (int t = 0; t < in[s].num_tokens; ++t) {
            std::vector<char> dest_seen(R, 0);
            for (int k = 0; k < K; ++k) {
                const int d = ref_rank[s][t * K + k], row = ref_row[s][t * K + k];
                ASSERT_TRUE(d >= 0 && row >= 0 && row < nvs && real[d][row]) << "entry of rank " << s << " t " << t;
                ++writes[d][row];
                std::copy_n(in[s].x.begin() + int64_t(t) * H, H, exp_x[d].begin() + int64_t(kCanaryRows + row) * H);
                exp_w[d][kCanaryRows + row] = c.topk_weights ? in[s].weights[t * K + k] : 1.0f;
                if (!dest_seen[d]) {
                    dest_seen[d] = 1;
                    ++pairs;
                    if (d != s) ++remote_pairs;
                }
            }
        }
    }
    for (int d = 0; d < R; ++d) {
        for (int r = 0; r < nvs; ++r) ASSERT_EQ(writes[d][r], real[d][r] ? 1 : 0) << "rank " << d << " row " << r;
    }
    for (int d = 0; d < R; ++d) {
        for (size_t i = 0; i < exp_x[d].size(); ++i) {
            ASSERT_EQ(out[d].recv_x[i], exp_x[d][i])
                << "recv_x rank " << d << " row " << int(i / H) - kCanaryRows << " elem " << i % H
                << " (negative / >= NvS=" << nvs << ": canary)";
        }
        for (size_t i = 0; i < exp_w[d].size(); ++i) {
            ASSERT_EQ(bits_of(out[d].recv_w[i]), bits_of(exp_w[d][i]))
                << "recv_w rank " << d << " row " << int(i) - kCanaryRows;
        }
    }

    // Combine: per token, per destination ascending: fp32 partial in ascending k, rounded to bf16; sum, round.
    int64_t pulled = 0, pushed = 0, pushed_remote = 0, written = 0;
    for (int s = 0; s < R; ++s) {
        pushed += out[s].stats.rows_pushed;
        pushed_remote += out[s].stats.rows_pushed_remote;
        pulled += out[s].stats.partials_pulled;
        written += out[s].stats.partials_written;
        std::vector<uint16_t> expect(size_t(c.S + 2 * kCanaryRows) * H, kCanaryX);
        for (int t = 0; t < in[s].num_tokens; ++t) {
            for (int i = 0; i < H; ++i) {
                float acc = 0.0f;
                for (int d = 0; d < R; ++d) {
                    float partial = 0.0f;
                    bool any = false;
                    for (int k = 0; k < K; ++k) {
                        if (ref_rank[s][t * K + k] != d) continue;
                        const int row = ref_row[s][t * K + k];
                        const float y = bf16_to_float(in[d].y[int64_t(row) * H + i]);
                        partial = c.weighted ? std::fma(exp_w[d][kCanaryRows + row], y, partial) : partial + y;
                        any = true;
                    }
                    if (any) acc += bf16_to_float(float_to_bf16(partial));
                }
                expect[int64_t(kCanaryRows + t) * H + i] = float_to_bf16(acc);
            }
        }
        for (size_t i = 0; i < expect.size(); ++i) {
            ASSERT_EQ(out[s].out[i], expect[i]) << "out rank " << s << " row " << int(i / H) - kCanaryRows << " elem "
                                                << i % H << " (s=" << in[s].num_tokens << ")";
        }
    }
    // Dedup: one row crossing per distinct (source, token, destination); one partial each way per such pair.
    EXPECT_EQ(pushed, pairs);
    EXPECT_EQ(pushed_remote, remote_pairs);
    EXPECT_EQ(written, pairs);
    EXPECT_EQ(pulled, pairs);
}

void run_case(const Case& c, bool twice = false) {
    SCOPED_TRACE("repro: build-host/tests/flatep_host_tests --gtest_filter='DataPlane.*'  case " + describe(c));
    const Layout l = make_layout(config_of(c, 0));
    std::vector<std::vector<RankInput>> inputs;
    for (int step = 0; step < c.steps; ++step) inputs.push_back(make_inputs(c, l, step));
    const StepOutputs first = run_threaded(c, l, inputs);
    for (int step = 0; step < c.steps; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        check_step(c, l, inputs[step], first[step]);
        if (::testing::Test::HasFatalFailure()) return;
    }
    if (twice) {
        const StepOutputs second = run_threaded(c, l, inputs);
        for (int step = 0; step < c.steps; ++step) {
            for (int r = 0; r < c.R; ++r) EXPECT_TRUE(first[step][r] == second[step][r]) << "rank " << r;
        }
    }
}

// Many (R, E, S, K, H, align, capacity factor, skew) combinations, generated deterministically.
std::vector<Case> sweep_cases() {
    std::vector<Case> cases;
    const int ranks[] = {1, 2, 3, 4, 8};
    const int aligns[] = {1, 4, 16};
    const double factors[] = {1.0, 1.25, 1.5};
    const double sigmas[] = {0.0, 1.0, 2.5};
    const int hs[] = {8, 24, 64};
    int n = 0;
    for (int R : ranks) {
        for (int a = 0; a < 3; ++a) {
            for (int f = 0; f < 3; ++f, ++n) {
                Case c{};
                c.R = R;
                c.epn = 1 + (n % 4);
                const int E = R * c.epn;
                c.S = (n % 5 == 0) ? 1 : 5 + (n * 7) % 29;
                c.K = 1 + (n * 3) % std::min(E, 6);
                c.H = hs[n % 3];
                c.align = aligns[a];
                c.capacity_factor = factors[f];
                c.sigma = sigmas[(n / 2) % 3];
                c.seed = 17 + uint64_t(n);
                c.partial = n % 4 == 1;
                c.int64_idx = n % 3 == 2;
                c.topk_weights = n % 2 == 0;
                c.weighted = n % 3 != 1;
                c.alias = n % 5 == 3;
                c.planner = n % 4 == 2 ? PlannerKind::kGreedy : PlannerKind::kBalanced;
                c.steps = 2;
                cases.push_back(c);
            }
        }
    }
    return cases;
}

TEST(DataPlane, MatchesNaiveReferenceOverManyConfigs) {
    for (const Case& c : sweep_cases()) {
        run_case(c);
        if (HasFatalFailure()) return;
    }
}

TEST(DataPlane, SkewedRoutingWithManyDuplicatesPerDestination) {
    // epn large and K large: many tokens send several entries to one rank (long chains, dedup matters).
    for (double sigma : {0.0, 1.5, 4.0}) {
        Case c{4, 6, 24, 8, 16, 4, 1.0, sigma, 99, false, false, true, true, false, PlannerKind::kBalanced, 2};
        run_case(c);
        if (HasFatalFailure()) return;
    }
}

TEST(DataPlane, PartialBatchesDifferingPerRank) {
    Case c{4, 2, 20, 3, 16, 4, 1.0, 1.0, 5, true, false, true, true, false, PlannerKind::kBalanced, 3};
    run_case(c);
    Case slack = c;
    slack.capacity_factor = 1.5;
    slack.align = 16;
    run_case(slack);
}

TEST(DataPlane, TwoRunsAreBitwiseEqual) {
    Case c{8, 3, 16, 4, 32, 4, 1.0, 2.0, 7, true, true, true, true, false, PlannerKind::kBalanced, 2};
    run_case(c, /*twice=*/true);
    Case aliased = c;
    aliased.alias = true;
    aliased.R = 3;
    run_case(aliased, /*twice=*/true);
}

}  // namespace
}  // namespace flatep
