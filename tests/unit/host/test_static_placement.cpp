// Buffer::set_placement and the static planner through the public API on the CPU backend (R rank threads): bad
// placements (each kind) fail on every rank with one line and leave the Buffer usable with the placement it had; ranks
// that disagree all fail naming the first difference; plans record the placement's epoch and state it as their slot
// table; ExpertPools::placement_bytes and a prefetch of a static plan move exactly the placed replicas (serving's pull
// and training's push).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::failures;
using testing::Outcome;
using testing::outcome_of;
using testing::run_ranks;
using transport::LocalHostWorld;
using Ints = std::vector<int32_t>;

constexpr int kR = 2, kEpn = 4, kE = kR * kEpn, kS = 4, kK = 2;

Config config_of(int rank) {
    Config c;
    c.num_ranks = kR, c.rank = rank, c.num_experts = kE, c.num_tokens = kS, c.topk = kK, c.hidden = 8, c.align = 1;
    return c;
}

// A Buffer of `planner` whose groups have B = num_slots slots (-1: epn), without pools (the internal API).
std::unique_ptr<Buffer> buffer_of(LocalHostWorld& world, int rank, int num_slots, PlannerKind planner) {
    return internal::make_buffer(config_of(rank), world.transport(rank), planner, {num_slots, 0});
}

const int32_t kIdx[kS * kK] = {0, 5, 1, 4, 5, 6, 2, 7};

Ints slots_of(const Plan& plan, int rank) {
    const std::span<const int32_t> s = plan.slot_expert(rank);
    return Ints(s.begin(), s.end());
}

// Each kind of bad placement, the same on every rank: every rank throws kInvalidArgument with the same line, and the
// Buffer keeps the placement it had (none at first: plan() says so; then a good one, which later plans keep using).
TEST(StaticPlacement, BadPlacementsFailOnEveryRankAndKeepThePlacement) {
    const std::vector<std::pair<Ints, std::string>> bad = {
        {{4, -1, 0}, "set_placement: placement must have R*B = 2*2 = 4 entries ([R][B] expert ids, -1 = empty), got 3"},
        {{4, 8, 0, 1}, "set_placement: placement[0][1] = 8 is not an expert id in [0, E=8) or -1 (empty)"},
        {{4, 5, 4, 1}, "set_placement: placement[1][0] = 4 is rank 1's own expert; a slot holds another rank's expert"},
        {{5, 5, 0, 1}, "set_placement: placement[0][1] = 5 repeats placement[0][0] (an expert at most once a rank)"},
    };
    const Ints good = {5, -1, -1, 2};
    LocalHostWorld world(kR, 20.0);
    const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
        const std::unique_ptr<Buffer> made = buffer_of(world, rank, 2, PlannerKind::kStatic);
        Buffer& buffer = *made;
        const Outcome none = outcome_of([&] { buffer.plan(kIdx, 4, kS); });
        EXPECT_EQ(none.message, "plan: the static planner has no placement yet: call set_placement (collective) first");
        for (const auto& [placement, message] : bad) {
            const Outcome o = outcome_of([&] { buffer.set_placement(placement); });
            EXPECT_EQ(o.message, message);
            EXPECT_EQ(o.category, int(ErrorCategory::kInvalidArgument));
        }
        EXPECT_EQ(buffer.placement_epoch(), 0u);
        EXPECT_TRUE(buffer.placement().empty());
        buffer.set_placement(good);
        EXPECT_EQ(buffer.placement_epoch(), 1u);
        for (const auto& [placement, message] : bad)
            EXPECT_EQ(outcome_of([&] { buffer.set_placement(placement); }).message, message);
        EXPECT_EQ(buffer.placement_epoch(), 1u);
        EXPECT_EQ(Ints(buffer.placement().begin(), buffer.placement().end()), good);
        const Plan plan = buffer.plan(kIdx, 4, kS);
        EXPECT_EQ(plan.placement_epoch(), 1u);
        EXPECT_EQ(slots_of(plan, 0), (Ints{5, -1, -1, -1}));
        EXPECT_EQ(slots_of(plan, 1), (Ints{-1, 2, -1, -1}));
        EXPECT_FALSE(buffer.poisoned());
    });
    EXPECT_EQ(failures(errors), "");
}

// Rank 1 passes another placement (or another size): every rank throws kMismatch with the same line naming the first
// difference; the Buffer is not poisoned, and the same placement on every rank then works.
TEST(StaticPlacement, RanksThatDisagreeAllFailNamingTheFirstDifference) {
    const std::vector<std::pair<Ints, std::string>> theirs = {
        {{5, -1, 1, 2},
         "set_placement: ranks disagree on the placement: placement[1][0] is -1 on rank 0 but 1 on rank 1 (every rank "
         "must pass the same placement)"},
        {{5, -1, -1},
         "set_placement: ranks disagree on the placement: rank 0 passed 4 entries, rank 1 passed 3 (every rank must "
         "pass the same placement)"},
    };
    const Ints mine = {5, -1, -1, 2};
    for (const auto& [other, message] : theirs) {
        LocalHostWorld world(kR, 20.0);
        const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
            const std::unique_ptr<Buffer> made = buffer_of(world, rank, 2, PlannerKind::kStatic);
            Buffer& buffer = *made;
            const Outcome o = outcome_of([&] { buffer.set_placement(rank == 1 ? other : mine); });
            EXPECT_EQ(o.message, message) << "rank " << rank;
            EXPECT_EQ(o.category, int(ErrorCategory::kMismatch)) << "rank " << rank;
            EXPECT_EQ(buffer.placement_epoch(), 0u);
            EXPECT_FALSE(buffer.poisoned());
            buffer.set_placement(mine);
            const Plan plan = buffer.plan(kIdx, 4, kS);
            EXPECT_EQ(slots_of(plan, 1), (Ints{-1, 2, -1, -1}));
        });
        EXPECT_EQ(failures(errors), "");
    }
}

TEST(StaticPlacement, OtherPlannersRefuseAPlacement) {
    LocalHostWorld world(kR, 20.0);
    const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
        Buffer buffer(config_of(rank), world.transport(rank), PlannerKind::kBalanced);
        EXPECT_EQ(outcome_of([&] { buffer.set_placement(Ints(kR * kEpn, -1)); }).message,
                  "set_placement: this Buffer's planner is 'balanced'; a placement is for the static planner "
                  "(PlannerKind::kStatic)");
        const Plan plan = buffer.plan(kIdx, 4, kS);  // still usable
        EXPECT_EQ(plan.placement_epoch(), 0u);
    });
    EXPECT_EQ(failures(errors), "");
}

// A keyed value of (expert, projection, element), never zero.
uint16_t key(int expert, int projection, int64_t i) {
    return uint16_t(0x2000 + expert * 97 + projection * 31 + (i % 211));
}

// Prefetch of a static plan moves exactly the placed experts into the slots, in the placement's order (empty slots
// untouched), whether or not a copy has rows this step; placement_bytes counts them. Serving (pull, B = 2) and
// training (push, B = epn).
TEST(StaticPlacement, PrefetchMovesThePlacedReplicasAndPlacementBytesCountsThem) {
    const std::vector<ProjectionShape> shapes = {{4, 8}, {8, 2, 4}};  // 64 and 64 bytes per expert
    for (const int B : {2, -1}) {
        const int slots = B < 0 ? kEpn : B;
        Ints placement(size_t(kR) * slots, -1);
        placement[0] = 6;                  // rank 0 slot 0: expert 6 (no entry routes to it: its copy gets no rows)
        placement[1] = 5;                  // rank 0 slot 1: expert 5
        placement[size_t(slots) + 1] = 0;  // rank 1 slot 1: expert 0
        LocalHostWorld world(kR, 20.0);
        const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
            ExpertPools pools(world.transport(rank), kEpn, shapes, B);
            Buffer buffer(config_of(rank), pools, PlannerKind::kStatic);
            ExpertLayer layer = pools.register_layer();
            for (int p = 0; p < 2; ++p) {
                const int64_t n = shapes[p].elems() * shapes[p].elem_bytes / 2;  // uint16 words
                for (int l = 0; l < kEpn; ++l)
                    for (int64_t i = 0; i < n; ++i) layer.own_weights(p)[l * n + i] = key(rank * kEpn + l, p, i);
            }
            buffer.set_placement(placement);
            const int32_t idx[kS * kK] = {0, 5, 1, 4, 5, 3, 2, 7};
            const Plan plan = buffer.plan(idx, 4, kS);
            pools.prefetch(plan, layer);
            for (int p = 0; p < 2; ++p) {
                const int64_t n = shapes[p].elems() * shapes[p].elem_bytes / 2;
                const uint16_t* slot = pools.slot_pool(p);
                for (int j = 0; j < slots; ++j) {
                    const int e = placement[size_t(rank) * slots + j];
                    for (int64_t i = 0; i < n; ++i)
                        ASSERT_EQ(slot[j * n + i], e >= 0 ? key(e, p, i) : 0) << "rank " << rank << " slot " << j;
                }
            }
            EXPECT_EQ(pools.placement_bytes(plan, rank), (rank == 0 ? 2 : 1) * 128);
            EXPECT_EQ(pools.placement_bytes(plan, -1), 3 * 128);
            EXPECT_EQ(outcome_of([&] { pools.placement_bytes(plan, 2); }).message,
                      "placement_bytes: rank must be in [0, 2) or -1 (every rank), got 2");
        });
        EXPECT_EQ(failures(errors), "") << "B " << B;
    }
}

TEST(StaticPlacement, PlacementBytesNeedsAStaticPlan) {
    LocalHostWorld world(kR, 20.0);
    const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
        ExpertPools pools(world.transport(rank), kEpn, {{4, 8}});
        Buffer buffer(config_of(rank), world.transport(rank));
        const Plan plan = buffer.plan(kIdx, 4, kS);
        EXPECT_EQ(outcome_of([&] { pools.placement_bytes(plan, rank); }).message,
                  "placement_bytes: the plan's planner is 'balanced'; only a static plan has a placement");
    });
    EXPECT_EQ(failures(errors), "");
}

}  // namespace
}  // namespace flatep
