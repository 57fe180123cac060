// Regression tests for what the fuzz targets (fuzz/) and the bad-input review found. Each names its reproducer.
//
// Disabled tests are open bugs in files outside this folder (reported in issue 9); enable them with the fix:
//   flatep_hardening_tests --gtest_also_run_disabled_tests --gtest_filter='FuzzRegression.*'
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "transport/local_host.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

// config_fuzz, crash-9dd1f83f: validate() accepted R=64, E=2147483584 (S=K=H/8=align=1), whose R*E overflows the
// int32 index d*E + e of plan.hpp / planner_core.hpp (and whose tpe_all alone would be 512 GiB). Likewise R=1 with
// E > 2^30 overflows R*2*epn (cu_seqlens index). Fix (src/layout/config.cpp, Config::validate): reject
// int64(num_ranks) * num_experts * 2 > INT32_MAX, or cap E.
TEST(FuzzRegression, ConfigRejectsExpertCountsWhoseIndexProductsOverflowInt32) {
    for (const auto& [R, E] : std::vector<std::pair<int, int>>{{64, 2147483584}, {1, (1 << 30) + 2}}) {
        Config c;
        c.num_ranks = R;
        c.num_experts = E;
        c.num_tokens = 1;
        c.topk = 1;
        c.hidden = 8;
        c.align = 1;
        try {
            c.validate();
            ADD_FAILURE() << "validate() accepted " << c.to_string();
        } catch (const Error& e) {
            EXPECT_EQ(e.category(), ErrorCategory::kInvalidArgument);
            EXPECT_NE(e.message().find("num_experts"), std::string::npos) << e.message();
        }
    }
}

// The largest expert count that does fit keeps every int32 index product in range (what the fix must not reject).
TEST(FuzzRegression, LargestFittingExpertCountKeepsIndexProductsInInt32) {
    Config c;
    c.num_ranks = 64;
    c.num_experts = 64 * ((INT32_MAX / 2) / 64 / 64);
    c.num_tokens = 1;
    c.topk = 1;
    c.hidden = 8;
    c.align = 1;
    ASSERT_NO_THROW(c.validate());
    const Layout l = make_layout(c);
    EXPECT_LE(int64_t(l.num_ranks) * l.num_experts * 2, int64_t(INT32_MAX));
    EXPECT_LE(int64_t(l.num_ranks) * l.num_groups(), int64_t(INT32_MAX));
}

// Review of ExpertPools: ProjectionShape::elems() = rows * cols and the pool sizes epn * elems * 4 are int64 products
// that the constructor does not bound, so {1 << 31, 1 << 31} with epn = 2 overflows int64 (undefined behaviour; with
// the wrap, allocate() gets a meaningless size). Fix (src/runtime/expert_pools.cpp): check with
// __builtin_mul_overflow that epn * rows * cols * 4 fits (and e.g. <= 2^40) before allocating.
TEST(FuzzRegression, ExpertPoolsRejectsProjectionSizesThatOverflow) {
    LocalHostWorld world(1, 5.0);
    try {
        ExpertPools pools(world.transport(0), 2, {{int64_t(1) << 31, int64_t(1) << 31}});
        ADD_FAILURE() << "accepted a 2^62-element projection";
    } catch (const Error& e) {
        EXPECT_EQ(e.category(), ErrorCategory::kInvalidArgument) << e.what();
    }
}

// planner_fuzz seeds as fixed cases: both planners on the extreme shapes of the fuzz ranges (one rank; 16 ranks with
// 128 experts; every entry on one expert; partial rows; align 4096 with epn 1) satisfy check_plan.
TEST(FuzzRegression, PlannersSatisfyDesignConstraintsOnExtremeShapes) {
    struct Case {
        int R, E, S, K, align;
        double factor;
        int hot;       // -1: uniform rows; otherwise every entry of every full row goes to expert `hot`
        bool partial;  // odd rows carry half their entries
    };
    const Case cases[] = {{1, 1, 1, 1, 1, 1.0, -1, false},       {1, 5, 7, 3, 4096, 4.0, 2, false},
                          {16, 128, 48, 32, 128, 1.0, 0, false}, {16, 128, 48, 32, 7, 1.25, -1, true},
                          {8, 8, 32, 1, 4096, 1.0, 7, true},     {3, 96, 5, 32, 1, 4.0, 95, false}};
    for (const Case& cs : cases) {
        Config c;
        c.num_ranks = cs.R, c.num_experts = cs.E, c.num_tokens = cs.S, c.topk = cs.K, c.align = cs.align;
        c.capacity_factor = cs.factor;
        const Layout l = make_layout(c);
        std::vector<int32_t> tpe(size_t(cs.R) * cs.E, 0);
        for (int s = 0; s < cs.R; ++s) {
            const int64_t total = (cs.partial && s % 2 == 1) ? int64_t(cs.S) * cs.K / 2 : int64_t(cs.S) * cs.K;
            for (int64_t i = 0; i < total; ++i) ++tpe[size_t(s) * cs.E + (cs.hot >= 0 ? cs.hot : int(i % cs.E))];
        }
        for (const PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced}) {
            planner::HostPlan plan(l);
            std::copy(tpe.begin(), tpe.end(), plan.view.tpe_all);
            planner::plan_counts(l, kind, plan.view);
            EXPECT_EQ(planner::check_plan(l, plan.view), "") << c.to_string() << " planner " << planner_name(kind);
        }
    }
}

}  // namespace
}  // namespace flatep
