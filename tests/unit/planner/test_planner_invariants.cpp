// Planner invariants on generated and adversarial count matrices: check_plan (design §4 constraints 1-4, every
// derived array, placement bijection, stats) for both planners, balanced never worse than greedy on P and replicas,
// determinism, and check_plan's detection of corrupted plans.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "planner_test_util.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

using test::describe;
using test::make_test_layout;
using test::plan_of;

// Deterministic small PRNG for random matrices (splitmix64 from the routing module).
struct Rng {
    uint64_t state;
    uint64_t next() { return routing::mix64(state++); }
    int below(int n) { return int(next() % uint64_t(n)); }
};

// Plans with both planners, checks both, compares them. Returns the number of failures (reported by gtest).
void check_both(const Layout& l, const std::vector<int32_t>& counts, const std::string& what) {
    auto greedy = plan_of(l, counts, PlannerKind::kGreedy);
    auto balanced = plan_of(l, counts, PlannerKind::kBalanced);
    const std::string g = planner::check_plan(l, greedy->view), b = planner::check_plan(l, balanced->view);
    ASSERT_EQ(g, "") << describe(l, PlannerKind::kGreedy) << " " << what;
    ASSERT_EQ(b, "") << describe(l, PlannerKind::kBalanced) << " " << what;
    const PlanStats& gs = *greedy->view.stats;
    const PlanStats& bs = *balanced->view.stats;
    ASSERT_LE(bs.makespan, gs.makespan) << describe(l, PlannerKind::kBalanced) << " " << what;
    ASSERT_LE(bs.total_replicas, gs.total_replicas) << describe(l, PlannerKind::kBalanced) << " " << what;
    if (l.exact) {
        ASSERT_LE(bs.max_load_after - bs.min_load_after, 1) << what;
    } else {
        ASSERT_LE(bs.max_load_after, l.capacity) << what;
        // Slack mode replicates only what is needed: no replica when every group fits.
        if (gs.max_load_before <= l.capacity) {
            ASSERT_EQ(gs.total_replicas, 0) << what;
            ASSERT_EQ(bs.total_replicas, 0) << what;
        }
    }
}

TEST(PlannerInvariants, GeneratedRoutings) {
    int cases = 0;
    const double sigmas[] = {0.0, 0.5, 1.0, 2.0, 3.0};
    const double factors[] = {1.0, 1.1, 1.25, 1.5};
    const int aligns[] = {1, 4, 128};
    for (int R : {2, 3, 4, 8}) {
        for (int epn : {1, 2, 4, 8}) {
            const int E = R * epn;
            for (int K : {1, 2, 4}) {
                if (K > E) continue;
                for (double sigma : sigmas) {
                    for (uint64_t seed : {1, 2}) {
                        const int S = 24;
                        const std::vector<int32_t> counts = routing::generate_counts(R, E, S, K, sigma, seed);
                        for (int fi = 0; fi < 4; ++fi) {
                            const Layout l = make_test_layout(R, E, S, K, aligns[(fi + seed) % 3], factors[fi]);
                            check_both(l, counts, "sigma=" + std::to_string(sigma) + " seed=" + std::to_string(seed));
                            if (HasFatalFailure()) return;
                            ++cases;
                        }
                    }
                }
            }
        }
    }
    EXPECT_GE(cases, 1000);
}

// Random matrices with arbitrary skew: each rank spreads S*K (or, for partial batches, fewer) entries over a random
// subset of experts with random weights.
TEST(PlannerInvariants, RandomMatrices) {
    Rng rng{12345};
    int cases = 0;
    for (int it = 0; it < 1500; ++it) {
        const int R = 1 + rng.below(8);
        const int epn = 1 + rng.below(6);
        const int E = R * epn;
        const int K = 1 + rng.below(std::min(E, 4));
        const int S = 1 + rng.below(40);
        const bool partial = rng.below(4) == 0;
        const int hot = rng.below(E);
        std::vector<int32_t> counts(size_t(R) * E, 0);
        for (int s = 0; s < R; ++s) {
            const int entries = partial ? rng.below(S * K + 1) : S * K;
            const int mode = rng.below(3);
            for (int i = 0; i < entries; ++i) {
                int e = rng.below(E);
                if (mode == 1 && rng.below(2) == 0) e = hot;                       // one hot expert
                if (mode == 2) e = (e % epn) + epn * (rng.below(3) == 0 ? s : 0);  // hot rank 0 / own rank
                ++counts[size_t(s) * E + e];
            }
        }
        const double factor = 1.0 + 0.1 * rng.below(6);
        static const int kAligns[] = {1, 4, 128};
        const int align = kAligns[rng.below(3)];
        const Layout l = make_test_layout(R, E, S, K, align, factor);
        check_both(l, counts, "random it=" + std::to_string(it));
        if (HasFatalFailure()) return;
        ++cases;
    }
    EXPECT_EQ(cases, 1500);
}

// Adversarial matrices named in the issue.
TEST(PlannerInvariants, Adversarial) {
    struct Shape {
        int R, E, S, K;
    };
    const Shape shapes[] = {{8, 64, 32, 4}, {8, 8, 16, 1}, {4, 16, 16, 4}, {4, 4, 8, 2}, {2, 2, 5, 2},
                            {8, 16, 8, 2},  {1, 4, 8, 2},  {16, 32, 8, 2}, {3, 9, 7, 3}};
    for (const Shape& sh : shapes) {
        const int R = sh.R, E = sh.E, S = sh.S, K = sh.K, epn = E / R, sk = S * K;
        std::vector<std::pair<std::string, std::vector<int32_t>>> mats;
        auto fill = [&](const char* name, auto value_of) {
            std::vector<int32_t> c(size_t(R) * E, 0);
            for (int s = 0; s < R; ++s)
                for (int e = 0; e < E; ++e) c[size_t(s) * E + e] = value_of(s, e);
            mats.emplace_back(name, c);
        };
        // All entries of every rank to expert 0 (K=1 only is a valid routing, but counts are what the planner sees).
        fill("all to one expert", [&](int, int e) { return e == 0 ? sk : 0; });
        fill("all to the last expert", [&](int, int e) { return e == E - 1 ? sk : 0; });
        // All entries to rank 0's experts, spread evenly (remainder to the first ones).
        fill("all to one rank", [&](int, int e) { return e < epn ? sk / epn + (e < sk % epn ? 1 : 0) : 0; });
        // Every rank routes only to its own experts: perfectly local, nothing to move.
        fill("all local", [&](int s, int e) { return e / epn == s ? sk / epn + (e % epn < sk % epn ? 1 : 0) : 0; });
        // Half the experts empty, the rest even.
        fill("empty experts", [&](int, int e) {
            const int live = (E + 1) / 2;
            return e % 2 == 0 ? sk / live + ((e / 2) < sk % live ? 1 : 0) : 0;
        });
        // Partial batches: rank s passes s/R of its tokens, all to rank R-1's first expert.
        fill("partial, one expert", [&](int s, int e) { return e == E - epn ? (sk * s) / R : 0; });
        // Empty step.
        fill("empty step", [&](int, int) { return 0; });
        // Partial, ranks differ, to the next rank's experts.
        fill("partial, shifted", [&](int s, int e) {
            const int n = sk - s;
            return e / epn == (s + 1) % R && n > 0 ? n / epn + (e % epn < n % epn ? 1 : 0) : 0;
        });
        for (const auto& [name, counts] : mats) {
            for (double factor : {1.0, 1.25, 1.5}) {
                for (int align : {1, 4, 128}) {
                    const Layout l = make_test_layout(R, E, S, K, align, factor);
                    check_both(l, counts, name);
                    if (HasFatalFailure()) return;
                }
            }
        }
    }
}

TEST(PlannerInvariants, MaxvioSweepAtReferenceScaleRatio) {
    // The reference config's shape (R=8, E=384, K=8) with fewer tokens, over the benchmark's maxvio targets.
    const int R = 8, E = 384, S = 256, K = 8;
    for (double target : {0.2, 1.0, 10.0, 20.0}) {
        const double sigma = target < 5 ? target * 0.25 : 1.3 + target * 0.03;  // rough; realised maxvio varies
        for (uint64_t seed : {7, 8}) {
            const std::vector<int32_t> counts = routing::generate_counts(R, E, S, K, sigma, seed);
            for (double factor : {1.0, 1.05, 1.25}) {
                const Layout l = make_test_layout(R, E, S, K, 128, factor);
                check_both(l, counts, "maxvio target " + std::to_string(target));
                if (HasFatalFailure()) return;
            }
        }
    }
}

// Issue 22's shapes: MoonEP's sweep at Kimi K3's expert count (E=896, S=8192, R 8..64, K 8 and 16, align 128), with
// the seven matrices the GPU planner is held to bitwise on the device (test_gpu_ops --case planner_sweep): spread
// counts of sigma 0, 0.5, 1, 2, 3 and 1 (another seed), and K hot experts shared by every rank. Every plan is checked
// and the balanced one is never worse than the greedy, here in CI.
TEST(PlannerInvariants, MoonEpSweepAtK3Experts) {
    const int E = 896, S = 8192;
    const double sigmas[] = {0.0, 0.5, 1.0, 2.0, 3.0, 1.0};
    for (int R : {8, 16, 32, 64}) {
        for (int K : {8, 16}) {
            const Layout l = make_test_layout(R, E, S, K, 128);
            for (int m = 0; m < 7; ++m) {
                std::vector<int32_t> counts;
                if (m == 6) {
                    counts.assign(size_t(R) * E, 0);
                    for (int r = 0; r < R; ++r)
                        for (int k = 0; k < K; ++k) counts[size_t(r) * E + size_t(m + k) % E] = S;
                } else {
                    counts = routing::spread_counts(R, E, S, K, sigmas[m], 1000 + uint64_t(m));
                }
                check_both(l, counts, "matrix " + std::to_string(m));
                if (HasFatalFailure()) return;
            }
        }
    }
}

TEST(PlannerInvariants, DeterministicBitwise) {
    const Layout l = make_test_layout(8, 64, 64, 4, 4);
    for (uint64_t seed : {1, 2, 3}) {
        const std::vector<int32_t> counts = routing::generate_counts(8, 64, 64, 4, 1.5, seed);
        for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced}) {
            auto a = plan_of(l, counts, kind);
            auto b = plan_of(l, counts, kind);
            const int64_t global_words = make_plan_sizes(l).entry_rank;  // everything before the per-rank part
            ASSERT_TRUE(std::equal(a->view.tpe_all, a->view.tpe_all + global_words, b->view.tpe_all))
                << describe(l, kind) << " seed " << seed;
        }
    }
}

// At low skew the balanced planner chains donors and receivers (few replicas in and out per rank), which the
// one-donor greedy does not: a regression guard on the quality that the benchmarks report (deterministic inputs;
// measured: greedy P = 3, 4, 3, 3 vs balanced 2, 1, 2, 2).
TEST(PlannerInvariants, BalancedBeatsGreedyAtLowSkew) {
    const Layout l = make_test_layout(8, 384, 1024, 8, 128);
    for (uint64_t seed : {1, 2, 3, 4}) {
        const std::vector<int32_t> counts = routing::generate_counts(8, 384, 1024, 8, 0.05, seed);
        auto g = plan_of(l, counts, PlannerKind::kGreedy);
        auto b = plan_of(l, counts, PlannerKind::kBalanced);
        EXPECT_LT(b->view.stats->makespan, g->view.stats->makespan) << "seed " << seed;
        EXPECT_LE(b->view.stats->makespan, 2) << "seed " << seed;
        EXPECT_LE(b->view.stats->total_replicas, g->view.stats->total_replicas) << "seed " << seed;
    }
}

// check_plan must notice a single corrupted word in any array.
TEST(PlannerInvariants, CheckPlanDetectsCorruption) {
    const Layout l = make_test_layout(4, 16, 32, 4, 4);
    const std::vector<int32_t> counts = routing::generate_counts(4, 16, 32, 4, 1.5, 3);
    auto plan = plan_of(l, counts, PlannerKind::kBalanced);
    PlanView& p = plan->view;
    ASSERT_EQ(planner::check_plan(l, p), "");
    ASSERT_GT(p.stats->total_replicas, 0);
    const int E = l.num_experts, epn = l.experts_per_rank;
    auto expect_caught = [&](int32_t* word, int32_t delta, const char* what, const char* needle) {
        const int32_t saved = *word;
        *word += delta;
        const std::string msg = planner::check_plan(l, p);
        EXPECT_NE(msg.find(needle), std::string::npos) << what << ": got \"" << msg << "\"";
        *word = saved;
        ASSERT_EQ(planner::check_plan(l, p), "") << "restoring " << what;
    };
    int replica_slot = -1;
    for (int i = 0; i < l.num_ranks * epn; ++i)
        if (p.slot_expert[i] >= 0) replica_slot = i;
    ASSERT_GE(replica_slot, 0);
    const int d = replica_slot / epn, e = p.slot_expert[replica_slot];
    expect_caught(&p.alloc[d * E + e], 1, "alloc +1", "conservation: expert");
    expect_caught(&p.alloc[d * E + e], -p.alloc[d * E + e], "alloc to 0", "conservation: expert");
    expect_caught(&p.slot_expert[replica_slot], 1, "slot +1", "slot_expert[");
    expect_caught(&p.cu_seqlens[1], 1, "cu_seqlens +1", "cu_seqlens[0][1]");
    expect_caught(&p.keep[d * E + e], 1, "keep +1", "keep[");
    expect_caught(&p.spill_start[3 * E + 5], 1, "spill_start +1", "spill_start[3][5]");
    expect_caught(&p.take_start[d * E + e], 1, "take_start +1", "take_start[");
    expect_caught(&p.group_row[d * E + e], 4, "group_row +4", "group_row[");
    expect_caught(&p.stats->makespan, 1, "stats.makespan +1", "stats.makespan");
    expect_caught(&p.stats->replicas_in[d], 1, "stats.replicas_in", "stats.replicas_in[");
    // Moving one entry between two home groups keeps conservation but breaks balance.
    {
        const int32_t a = p.alloc[0 * E + 0];
        p.alloc[0 * E + 0] = a + 1;
        p.alloc[1 * E + 0] -= 1;
        const std::string msg = planner::check_plan(l, p);
        EXPECT_TRUE(msg.find("balance:") != std::string::npos || msg.find("negative") != std::string::npos) << msg;
        p.alloc[0 * E + 0] = a;
        p.alloc[1 * E + 0] += 1;
    }
    // Too many replicas on one rank.
    {
        auto fat = plan_of(l, counts, PlannerKind::kBalanced);
        PlanView& q = fat->view;
        // Rank 0 takes one entry of every expert of rank 1 from its home: loads become unbalanced too, but the slot
        // check comes first in check_plan's order for this rank (conservation holds).
        for (int x = epn; x < 2 * epn; ++x) {
            if (q.alloc[1 * E + x] > 0) {
                q.alloc[1 * E + x] -= 1;
                q.alloc[0 * E + x] += 1;
            }
        }
        EXPECT_NE(planner::check_plan(l, q), "");
    }
    // Counts that do not fit: negative and too large.
    {
        const int32_t saved = p.tpe_all[2];
        p.tpe_all[2] = -3;
        EXPECT_EQ(planner::check_plan(l, p), "counts: tpe_all[0][2] = -3 is negative");
        p.tpe_all[2] = saved;
    }
}

TEST(PlannerInvariants, ValidateCountsMessages) {
    const Layout l = make_test_layout(2, 4, 4, 2);
    std::vector<int32_t> c = {8, 0, 0, 0, 2, 2, 2, 2};
    EXPECT_EQ(planner::validate_counts(l, c.data()), "");
    EXPECT_EQ(planner::validate_counts(l, nullptr), "tpe_all is null");
    c[5] = -1;
    EXPECT_EQ(planner::validate_counts(l, c.data()), "tpe_all[1][1] = -1 is negative");
    c[5] = 3;
    EXPECT_EQ(planner::validate_counts(l, c.data()), "tpe_all row 1 sums to 9, above S*K = 8 (S=4, K=2)");
    // planner::plan_counts refuses them with the same message.
    planner::HostPlan plan(l);
    std::copy(c.begin(), c.end(), plan.view.tpe_all);
    try {
        planner::plan_counts(l, PlannerKind::kBalanced, plan.view);
        ADD_FAILURE() << "planner::plan_counts accepted a row above S*K";
    } catch (const Error& e) {
        EXPECT_EQ(e.message(), "tpe_all row 1 sums to 9, above S*K = 8 (S=4, K=2)");
    }
}

TEST(PlannerInvariants, RouteEntriesErrors) {
    const Layout l = make_test_layout(2, 4, 4, 2);
    auto plan = plan_of(l, {2, 2, 2, 2, 2, 2, 2, 2}, PlannerKind::kBalanced);
    const std::vector<int32_t> ids = {0, 0, 0, 1, 1, 1, 2, 3};  // three entries to e0, but tpe_all[0][0] = 2
    auto message_of = [&](auto&& fn) -> std::string {
        try {
            fn();
        } catch (const Error& e) {
            return e.message();
        }
        return "";
    };
    EXPECT_EQ(
        message_of([&] { planner::route_entries(l, plan->view, 0, ids.data(), 4, 4); }),
        "topk_idx of rank 0 routes more than tpe_all[0][0] = 2 entries to expert 0 (counts and routing disagree)");
    EXPECT_EQ(message_of([&] { planner::route_entries(l, plan->view, 0, ids.data(), 2, 4); }),
              "plan: index_bytes must be 4 (int32) or 8 (int64), got 2");
    EXPECT_EQ(message_of([&] { planner::route_entries(l, plan->view, 2, ids.data(), 4, 4); }),
              "plan: rank must be in [0, 2), got 2");
    EXPECT_EQ(message_of([&] { planner::route_entries(l, plan->view, 0, ids.data(), 4, 5); }),
              "plan: num_tokens must be in [0, S=4], got 5");
}

}  // namespace
}  // namespace flatep
