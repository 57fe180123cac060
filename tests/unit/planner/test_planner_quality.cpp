// Planner quality against the exact optimum (issue 6): on a fixed set of generated count matrices whose optimal
// prefetch makespan P was computed offline with the MILP of tools/plan_optimum.py, the balanced planner must reach
// P <= optimum + 1 on every case (the benchmark's criterion is >= 95%), never be worse than the greedy on P or on
// total replicas, and never beat the optimum (which would mean a wrong optimum or an invalid plan).
//
// Reproduce the expected optima: for each row, write the counts routing::generate_counts(R, E, S, K, sigma, seed)
// as {"R","E","S","K","align":1,"capacity_factor":f,"tpe":[[...]]} and run
//   /usr/bin/python3 tools/plan_optimum.py --no-alloc --time-limit 30 case.json
// (every P below was proven optimal: "p_optimal": true).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "planner_test_util.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

using test::make_test_layout;
using test::plan_of;

struct QualityCase {
    int R, E, S, K;
    double sigma;
    uint64_t seed;
    double capacity_factor;
    int optimum_p;
};

// Expected optimum P per case (plan_optimum.py, HiGHS via scipy 1.10).
const QualityCase kCases[] = {
    {4, 16, 128, 2, 0.5, 1, 1.1, 1}, {4, 16, 128, 2, 0.5, 1, 1, 1},   {4, 16, 128, 2, 0.5, 2, 1.1, 1},
    {4, 16, 128, 2, 0.5, 2, 1, 2},   {4, 16, 128, 2, 0.5, 3, 1.1, 1}, {4, 16, 128, 2, 0.5, 3, 1, 1},
    {4, 16, 128, 2, 1.5, 1, 1.1, 1}, {4, 16, 128, 2, 1.5, 1, 1, 2},   {4, 16, 128, 2, 1.5, 2, 1.1, 2},
    {4, 16, 128, 2, 1.5, 2, 1, 2},   {4, 16, 128, 2, 1.5, 3, 1.1, 1}, {4, 16, 128, 2, 1.5, 3, 1, 2},
    {4, 16, 128, 2, 2.5, 1, 1.1, 1}, {4, 16, 128, 2, 2.5, 1, 1, 2},   {4, 16, 128, 2, 2.5, 2, 1.1, 2},
    {4, 16, 128, 2, 2.5, 2, 1, 2},   {4, 16, 128, 2, 2.5, 3, 1.1, 2}, {4, 16, 128, 2, 2.5, 3, 1, 2},
    {8, 32, 256, 4, 0.5, 1, 1.1, 1}, {8, 32, 256, 4, 0.5, 1, 1, 2},   {8, 32, 256, 4, 0.5, 2, 1.1, 1},
    {8, 32, 256, 4, 0.5, 2, 1, 1},   {8, 32, 256, 4, 0.5, 3, 1.1, 1}, {8, 32, 256, 4, 0.5, 3, 1, 1},
    {8, 32, 256, 4, 1.5, 1, 1.1, 2}, {8, 32, 256, 4, 1.5, 1, 1, 2},   {8, 32, 256, 4, 1.5, 2, 1.1, 2},
    {8, 32, 256, 4, 1.5, 2, 1, 2},   {8, 32, 256, 4, 1.5, 3, 1.1, 1}, {8, 32, 256, 4, 1.5, 3, 1, 1},
    {8, 32, 256, 4, 2.5, 1, 1.1, 3}, {8, 32, 256, 4, 2.5, 1, 1, 3},   {8, 32, 256, 4, 2.5, 2, 1.1, 2},
    {8, 32, 256, 4, 2.5, 2, 1, 2},   {8, 32, 256, 4, 2.5, 3, 1.1, 1}, {8, 32, 256, 4, 2.5, 3, 1, 2},
    {8, 64, 512, 2, 0.5, 1, 1.1, 1}, {8, 64, 512, 2, 0.5, 1, 1, 1},   {8, 64, 512, 2, 0.5, 2, 1.1, 1},
    {8, 64, 512, 2, 0.5, 2, 1, 1},   {8, 64, 512, 2, 0.5, 3, 1.1, 1}, {8, 64, 512, 2, 0.5, 3, 1, 2},
    {8, 64, 512, 2, 1.5, 1, 1.1, 2}, {8, 64, 512, 2, 1.5, 1, 1, 2},   {8, 64, 512, 2, 1.5, 2, 1.1, 1},
    {8, 64, 512, 2, 1.5, 2, 1, 1},   {8, 64, 512, 2, 1.5, 3, 1.1, 1}, {8, 64, 512, 2, 1.5, 3, 1, 1},
    {8, 64, 512, 2, 2.5, 1, 1.1, 3}, {8, 64, 512, 2, 2.5, 1, 1, 3},   {8, 64, 512, 2, 2.5, 2, 1.1, 2},
    {8, 64, 512, 2, 2.5, 2, 1, 2},   {8, 64, 512, 2, 2.5, 3, 1.1, 1}, {8, 64, 512, 2, 2.5, 3, 1, 2},
};

std::string describe_case(const QualityCase& c) {
    return "R=" + std::to_string(c.R) + " E=" + std::to_string(c.E) + " S=" + std::to_string(c.S) +
           " K=" + std::to_string(c.K) + " sigma=" + std::to_string(c.sigma) + " seed=" + std::to_string(c.seed) +
           " capacity_factor=" + std::to_string(c.capacity_factor) + " (optimum P " + std::to_string(c.optimum_p) +
           "); reproduce: tools/plan_optimum.py on routing::generate_counts of this case";
}

TEST(PlannerQuality, WithinOneOfTheMilpOptimum) {
    int num_equal = 0, num_within = 0;
    for (const QualityCase& c : kCases) {
        const Layout l = make_test_layout(c.R, c.E, c.S, c.K, 1, c.capacity_factor);
        const std::vector<int32_t> counts = routing::generate_counts(c.R, c.E, c.S, c.K, c.sigma, c.seed);
        auto greedy = plan_of(l, counts, PlannerKind::kGreedy);
        auto balanced = plan_of(l, counts, PlannerKind::kBalanced);
        ASSERT_EQ(planner::check_plan(l, balanced->view), "") << describe_case(c);
        const PlanStats& g = *greedy->view.stats;
        const PlanStats& b = *balanced->view.stats;
        EXPECT_GE(b.makespan, c.optimum_p) << "below the optimum: " << describe_case(c);
        EXPECT_LE(b.makespan, c.optimum_p + 1) << describe_case(c);
        EXPECT_LE(b.makespan, g.makespan) << describe_case(c);
        EXPECT_LE(b.total_replicas, g.total_replicas) << describe_case(c);
        num_equal += b.makespan == c.optimum_p;
        num_within += b.makespan <= c.optimum_p + 1;
    }
    const int n = int(sizeof(kCases) / sizeof(kCases[0]));
    EXPECT_EQ(num_within, n);
    // Measured when this test was written: 46 of the 54 cases reach the optimum exactly (a regression guard).
    EXPECT_GE(num_equal, 46) << "balanced planner reaches the optimum on " << num_equal << " of " << n << " cases";
}

}  // namespace
}  // namespace flatep
