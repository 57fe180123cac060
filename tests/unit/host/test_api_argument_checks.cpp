// Argument checks of the C++ API that the Python front never trips, called as a C++ user would: a Plan's per-rank
// arrays asked for a rank outside the world, a Buffer's plan-slot count, ranks that construct their Buffers with
// different planners, a transport whose bootstrap returns the blobs out of rank order, int64 expert ids beyond
// int32, and ExpertPools' projection indices, shapes and expert ids. Each gives one line naming the argument and
// its value, and the objects stay usable.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/bootstrap_transport.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::failures;
using testing::make_config;
using testing::Outcome;
using testing::outcome_of;
using testing::run_ranks;

constexpr int kInvalid = int(ErrorCategory::kInvalidArgument);
constexpr int kMismatch = int(ErrorCategory::kMismatch);

TEST(ApiArgs, PlanArraysOfARankOutsideTheWorldAreRefused) {
    LocalHostWorld world(1, 10.0);
    Buffer buffer(make_config(1, 2, 2, 1, 8, 1), world.transport(0));
    const int32_t idx[2] = {0, 1};
    const Plan plan = buffer.plan(idx, 4, 2);
    for (const int rank : {-1, 1}) {
        const Outcome slots = outcome_of([&] { plan.slot_expert(rank); });
        EXPECT_EQ(slots.message, "slot_expert: rank must be in [0, 1), got " + std::to_string(rank));
        EXPECT_EQ(slots.category, kInvalid);
        const Outcome cu = outcome_of([&] { plan.cu_seqlens(rank); });
        EXPECT_EQ(cu.message, "cu_seqlens: rank must be in [0, 1), got " + std::to_string(rank));
        EXPECT_EQ(cu.category, kInvalid);
    }
    // Rank 0's arrays: epn = 2 own experts (no replica slot used), 2*epn groups ending at one row each.
    EXPECT_EQ(plan.slot_expert(0).size(), 2u);
    EXPECT_EQ(plan.slot_expert(0)[0], -1);
    ASSERT_EQ(plan.cu_seqlens(0).size(), 4u);
    EXPECT_EQ(plan.cu_seqlens(0)[0], 1);
    EXPECT_EQ(plan.cu_seqlens(0)[1], 2);
}

TEST(ApiArgs, BufferRefusesAPlanSlotCountOutsideZeroTo1024) {
    LocalHostWorld world(1, 10.0);
    for (const int slots : {-1, 1025}) {
        const Outcome o = outcome_of(
            [&] { Buffer b(make_config(1, 2, 2, 1, 8, 1), world.transport(0), PlannerKind::kBalanced, slots); });
        EXPECT_EQ(o.message, "Buffer: num_plan_slots must be in [0, 1024], got " + std::to_string(slots));
        EXPECT_EQ(o.category, kInvalid);
    }
    for (const int slots : {0, 1024}) {
        Buffer b(make_config(1, 2, 2, 1, 8, 1), world.transport(0), PlannerKind::kBalanced, slots);
        EXPECT_EQ(b.num_plan_slots(), slots);
    }
}

TEST(ApiArgs, RanksWithDifferentPlannersFailTheBufferOnEveryRank) {
    const int R = 2;
    LocalHostWorld world(R, 10.0);
    std::vector<Outcome> got(R);
    std::vector<int> rows(R, -1);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        const PlannerKind planner = rank == 0 ? PlannerKind::kGreedy : PlannerKind::kBalanced;
        got[rank] =
            outcome_of([&] { Buffer b(make_config(R, 4, 2, 1, 8, 1, 1.0, rank), world.transport(rank), planner); });
        // The world is still usable: the same planner on both ranks builds and plans.
        Buffer b(make_config(R, 4, 2, 1, 8, 1, 1.0, rank), world.transport(rank), PlannerKind::kGreedy);
        const int32_t idx[2] = {0, 3};
        rows[rank] = b.plan(idx, 4, 2).num_tokens();
    });
    EXPECT_EQ(failures(errors), "");
    EXPECT_EQ(got[0].message, "config mismatch with rank 1: planner: greedy vs balanced");
    EXPECT_EQ(got[1].message, "config mismatch with rank 0: planner: balanced vs greedy");
    EXPECT_EQ(got[0].category, kMismatch);
    EXPECT_EQ(got[1].category, kMismatch);
    EXPECT_EQ(rows, (std::vector<int>{2, 2}));
}

// A bootstrap whose all_gather returns the blobs in reverse rank order (a broken custom transport).
class ReversingBootstrap final : public Bootstrap {
  public:
    explicit ReversingBootstrap(Bootstrap& inner) : inner_(inner) {}
    int rank() const override { return inner_.rank(); }
    int size() const override { return inner_.size(); }
    std::vector<std::string> all_gather(const std::string& blob) override {
        std::vector<std::string> all = inner_.all_gather(blob);
        return {all.rbegin(), all.rend()};
    }

  private:
    Bootstrap& inner_;
};

TEST(ApiArgs, ABootstrapThatMixesUpTheRanksIsAConfigMismatch) {
    const int R = 2;
    LocalHostWorld world(R, 10.0);
    std::vector<Outcome> got(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        auto reversing =
            std::make_shared<testing::BootstrapTransport<ReversingBootstrap>>(world.transport(rank), "reversing");
        got[rank] = outcome_of([&] { Buffer b(make_config(R, 4, 2, 1, 8, 1, 1.0, rank), reversing); });
    });
    EXPECT_EQ(failures(errors), "");
    // Each rank reads its peer's config in its own place first.
    EXPECT_EQ(got[0].message, "config mismatch with rank 0: rank: that rank's config says 1");
    EXPECT_EQ(got[1].message, "config mismatch with rank 0: rank: that rank's config says 1");
    EXPECT_EQ(got[0].category, kMismatch);
    EXPECT_EQ(got[1].category, kMismatch);
}

TEST(ApiArgs, Int64ExpertIdsBeyondInt32AreReportedClampedWithTheirDirection) {
    LocalHostWorld world(1, 10.0);
    Buffer buffer(make_config(1, 2, 2, 1, 8, 1), world.transport(0));
    const std::vector<std::pair<int64_t, std::string>> cases = {
        {-(int64_t(1) << 40), "-2147483648 or below"},
        {int64_t(1) << 40, "2147483647 or above"},
        {int64_t(INT32_MIN), "-2147483648 or below"},
        {-5, "-5"},
    };
    for (const auto& [bad, shown] : cases) {
        const int64_t idx[2] = {1, bad};
        const Plan plan = buffer.plan(idx, 8, 2);
        const Outcome o = outcome_of([&] { buffer.check_status(); });
        EXPECT_EQ(o.message, "rank 0: invalid expert id " + shown +
                                 " at topk_idx flat index 1 (token 1, k 0); ids must be in [0, E=2); the entry was "
                                 "skipped");
        EXPECT_EQ(o.category, kInvalid);
        EXPECT_EQ(plan.entry_ranks()[1], -1);  // skipped
        EXPECT_EQ(plan.entry_ranks()[0], 0);   // the good entry is planned
    }
}

TEST(ApiArgs, ExpertPoolsRefusesEmptyOrOversizedProjectionsAndBadIndices) {
    LocalHostWorld world(1, 10.0);
    const std::shared_ptr<Transport> t = world.transport(0);
    const int64_t big = int64_t(1) << 24, huge = int64_t(1) << 40;
    const std::vector<std::pair<std::string, std::vector<ProjectionShape>>> shapes = {
        {"ExpertPools: projection 1 must have positive rows and cols, got [0][8]", {{2, 8}, {0, 8}}},
        {"ExpertPools: projection 0 must have positive rows and cols, got [8][0]", {{8, 0}}},
        {"ExpertPools: projection 0 must have positive rows and cols, got [-8][-8]", {{-8, -8}}},
        {"ExpertPools: projection 0 of [16777216][16777216] x 2 experts is too large", {{big, big}}},
        {"ExpertPools: projection 0 of [1099511627776][1099511627776] x 2 experts is too large", {{huge, huge}}},
        {"ExpertPools: projection 0 of [1099511627776][1048576] x 2 experts is too large", {{huge, int64_t(1) << 20}}},
    };
    for (const auto& [want, projections] : shapes) {
        const Outcome o = outcome_of([&] { ExpertPools p(t, 2, projections); });
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }

    ExpertPools pools(t, 2, {{2, 8}});
    ExpertLayer layer = pools.register_layer();
    Buffer buffer(make_config(1, 2, 2, 1, 8, 1), t);
    const int32_t idx[2] = {0, 1};
    const Plan plan = buffer.plan(idx, 4, 2);
    std::vector<uint16_t> grad(2 * 2 * 16);
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"projection must be in [0, 1), got -1", [&] { pools.shape(-1); }},
        {"projection must be in [0, 1), got 1", [&] { pools.slot_pool(1); }},
        {"projection must be in [0, 1), got 1", [&] { pools.reduce_pool(1); }},
        {"projection must be in [0, 1), got -1", [&] { layer.weights(-1); }},
        {"projection must be in [0, 1), got 1", [&] { layer.grads(1); }},
        {"view_row: expert must be in [0, E=2), got -1", [&] { pools.view_row(-1); }},
        {"view_row: expert must be in [0, E=2), got 2", [&] { pools.view_row(2); }},
        {"write_grads: projection must be in [0, 1), got -1",
         [&] { pools.write_grads(plan, layer, -1, grad.data(), 2); }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    // Still usable: projection 0's shape, views and gradients.
    EXPECT_EQ(pools.shape(0).cols, 8);
    EXPECT_NE(layer.weights(0), nullptr);
    EXPECT_EQ(layer.grads(0), layer.grads(0));
    grad.assign(grad.size(), 0x3f80);  // bf16 1.0: own expert 0 has a row, so its gradient is written
    pools.write_grads(plan, layer, 0, grad.data(), 2);
    EXPECT_EQ(layer.own_grads(0)[0], 1.0f);
    // Training pools have no serving view: an expert in range reaches the next check.
    EXPECT_EQ(outcome_of([&] { pools.view_row(1); }).message,
              "view_row: the serving view's rows (num_slots < epn); these pools train (num_slots = epn)");
}

TEST(ApiArgs, ForwardOnlyPoolsHaveNoGradientMemory) {
    // Serving pools (B = 1 < epn = 2) and pools with an fp32 projection do not train: no grads, own or viewed.
    LocalHostWorld world(1, 10.0);
    const std::shared_ptr<Transport> t = world.transport(0);
    ExpertPools serving(t, 2, {{2, 8}}, 1);
    ExpertPools scales(t, 2, {{2, 8}, {1, 4, 4}});
    ExpertLayer a = serving.register_layer(), b = scales.register_layer();
    EXPECT_FALSE(serving.trains());
    EXPECT_FALSE(scales.trains());
    for (const ExpertLayer* layer : {&a, &b}) {
        EXPECT_EQ(layer->grads(0), nullptr);
        EXPECT_EQ(layer->own_grads(0), nullptr);
        EXPECT_NE(layer->own_weights(0), nullptr);
    }
    EXPECT_EQ(scales.reduce_pool(1), nullptr);
}

TEST(ApiArgs, ADefaultOrMovedFromLayerHasNoProjection) {
    LocalHostWorld world(1, 10.0);
    ExpertPools pools(world.transport(0), 2, {{2, 8}});
    ExpertLayer real = pools.register_layer();
    EXPECT_FALSE(real.on_device());
    EXPECT_EQ(real.num_projections(), 1);
    ExpertLayer taken = std::move(real);
    const ExpertLayer empty;
    for (const ExpertLayer* layer : {static_cast<const ExpertLayer*>(&real), &empty}) {
        EXPECT_EQ(layer->num_projections(), 0);
        EXPECT_EQ(layer->pools_id(), 0u);
        EXPECT_FALSE(layer->on_device());
        EXPECT_EQ(outcome_of([&] { layer->weights(0); }).message, "projection must be in [0, 0), got 0");
        EXPECT_EQ(outcome_of([&] { layer->own_grads(0); }).message, "projection must be in [0, 0), got 0");
    }
    EXPECT_EQ(taken.pools_id(), pools.id());
    EXPECT_NE(taken.weights(0), nullptr);
}

TEST(ApiArgs, ServingPoolsRefuseAViewStrideOutOfRange) {
    LocalHostWorld world(1, 10.0);
    const std::shared_ptr<Transport> t = world.transport(0);
    const int smallest = ExpertPools(t, 2, {{2, 8}}, 1).view_stride();
    const std::string range = "ExpertPools: view_stride must be 0 (the smallest that fits, " +
                              std::to_string(smallest) + ") or in [" + std::to_string(smallest) + ", " +
                              std::to_string(kMaxViewStride) + "], got ";
    for (const int stride : {-1, smallest - 1, kMaxViewStride + 1}) {
        const Outcome o = outcome_of([&] { ExpertPools p(t, 2, {{2, 8}}, 1, stride); });
        EXPECT_EQ(o.message, range + std::to_string(stride));
        EXPECT_EQ(o.category, kInvalid);
    }
    EXPECT_EQ(ExpertPools(t, 2, {{2, 8}}, 1, smallest + 3).view_stride(), smallest + 3);
}

TEST(ApiArgs, PlacementBytesRefusesAnEmptyPlanOtherPoolsAndARankBelowMinusOne) {
    LocalHostWorld world(1, 10.0);
    const std::shared_ptr<Transport> t = world.transport(0);
    ExpertPools pools(t, 4, {{2, 8}}), fewer(t, 2, {{2, 8}}), serving(t, 4, {{2, 8}}, 1);
    Buffer buffer(make_config(1, 4, 2, 1, 8, 1), t, PlannerKind::kStatic);
    buffer.set_placement(std::vector<int32_t>(4, -1));  // one rank: every expert at home, no replica
    const int32_t idx[2] = {0, 3};
    const Plan plan = buffer.plan(idx, 4, 2);
    EXPECT_EQ(pools.placement_bytes(plan, -1), 0);
    EXPECT_EQ(pools.placement_bytes(plan, 0), 0);
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"placement_bytes: plan is empty (default-constructed); get one from Buffer::plan()",
         [&] { pools.placement_bytes(Plan(), -1); }},
        {"placement_bytes: plan has epn=4 num_slots=4 but the pools have epn=2 num_slots=2",
         [&] { fewer.placement_bytes(plan, -1); }},
        {"placement_bytes: plan has epn=4 num_slots=4 but the pools have epn=4 num_slots=1",
         [&] { serving.placement_bytes(plan, -1); }},
        {"placement_bytes: rank must be in [0, 1) or -1 (every rank), got -2",
         [&] { pools.placement_bytes(plan, -2); }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
}

TEST(ApiArgs, RanksWhosePoolsHaveDifferentSlotsOrStridesFailTheBufferOnEveryRank) {
    // The pools' B and Q come with the Buffer made from them: ranks that passed different ones to their pools (whose
    // allocations round to the same pages: 32-byte experts) meet the difference at the Buffer's config exchange.
    const int R = 2;
    LocalHostWorld world(R, 10.0);
    for (const bool strides : {true, false}) {
        std::vector<Outcome> got(R);
        std::vector<std::string> shape(R);
        const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
            const int smallest = ExpertPools(world.transport(rank), 4, {{2, 8}}, 1).view_stride();
            const int slots = strides || rank == 0 ? 1 : 2, stride = strides && rank == 1 ? smallest + 1 : 0;
            ExpertPools pools(world.transport(rank), 4, {{2, 8}}, slots, stride);
            shape[rank] = std::to_string(pools.num_slots()) + ", " + std::to_string(pools.view_stride());
            got[rank] = outcome_of([&] { Buffer b(make_config(R, 8, 2, 1, 8, 1, 1.0, rank), pools); });
        });
        EXPECT_EQ(failures(errors), "");
        EXPECT_NE(shape[0], shape[1]);
        EXPECT_EQ(got[0].message,
                  "config mismatch with rank 1: num_slots, view_stride: " + shape[0] + " vs " + shape[1]);
        EXPECT_EQ(got[1].message,
                  "config mismatch with rank 0: num_slots, view_stride: " + shape[1] + " vs " + shape[0]);
        EXPECT_EQ(got[0].category, kMismatch);
        EXPECT_EQ(got[1].category, kMismatch);
    }
}

}  // namespace
}  // namespace flatep
