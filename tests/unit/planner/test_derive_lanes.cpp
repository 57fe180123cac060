// derive_rank (planner/derive.hpp) on a lane group of W host threads against the one-lane host derive: the GPU's warp
// runs it with W = 32 lanes of 4 items each, and only the host runs here. Each primitive of the simulated lane group is
// an exchange between two barriers and `sync` is a barrier, so lanes run concurrently between primitives, as a warp's
// lanes do under independent thread scheduling: code that reads another lane's writes without a sync in between, or
// that places items differently with several lanes or items per lane, gives other plans than one lane does.
// Allocations are drawn directly (not planned), with up to epn replicas per rank and equal row counts, so that the
// serving slot choice sees more replicas than slots and more replicas than lanes.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <string>
#include <thread>
#include <vector>

#include "flatep/config.hpp"
#include "planner/derive.hpp"
#include "planner/planner.hpp"
#include "routing/routing.hpp"
#include "unit/planner/thread_lanes.hpp"

namespace flatep {
namespace {

using testing::LaneShared;
using testing::ThreadLanes;

struct RankArrays {
    std::vector<int32_t> group_row, slot_expert, cu_seqlens, loads_after, replicas_in;
};

// derive_rank of every rank of `alloc` on lane group G (W threads, or OneLane on this thread); the slot copy in scratch
// of its own, as on the GPU.
template <class G>
RankArrays derive_ranks(const Layout& l, const std::vector<int32_t>& alloc, planner::PlacementView placed = {}) {
    planner::HostPlan plan(l);
    std::copy(alloc.begin(), alloc.end(), plan.view.alloc);
    std::vector<int32_t> slot_scratch(size_t(l.num_experts), 0);
    planner::DeriveSums sums{};
    if constexpr (G::kWidth == 1) {
        for (int d = 0; d < l.num_ranks; ++d)
            planner::derive_rank(G{}, l, plan.view, plan.view.alloc, slot_scratch.data(), d, sums, placed);
    } else {
        LaneShared<G::kWidth> shared;
        std::vector<std::thread> threads;
        for (int lane = 0; lane < G::kWidth; ++lane) {
            threads.emplace_back([&, lane] {
                const G g{lane, &shared};
                for (int d = 0; d < l.num_ranks; ++d)
                    planner::derive_rank(g, l, plan.view, plan.view.alloc, slot_scratch.data(), d, sums, placed);
            });
        }
        for (std::thread& t : threads) t.join();
    }
    const int64_t R = l.num_ranks, E = l.num_experts;
    RankArrays out;
    out.group_row.assign(plan.view.group_row, plan.view.group_row + R * E);
    out.slot_expert.assign(plan.view.slot_expert, plan.view.slot_expert + R * l.experts_per_rank);
    out.cu_seqlens.assign(plan.view.cu_seqlens, plan.view.cu_seqlens + R * l.num_groups());
    out.loads_after.assign(sums.loads_after, sums.loads_after + R);
    out.replicas_in.assign(sums.replicas_in, sums.replicas_in + R);
    return out;
}

void expect_same(const RankArrays& got, const RankArrays& want, const std::string& what) {
    EXPECT_EQ(got.group_row, want.group_row) << what;
    EXPECT_EQ(got.slot_expert, want.slot_expert) << what;
    EXPECT_EQ(got.cu_seqlens, want.cu_seqlens) << what;
    EXPECT_EQ(got.loads_after, want.loads_after) << what;
    EXPECT_EQ(got.replicas_in, want.replicas_in) << what;
}

// The layout for `planner` of R ranks of epn experts with a random align, slot count (training or serving) and view
// stride.
template <class Below>
Layout random_layout(int R, int epn, Below& below, PlannerKind planner = PlannerKind::kBalanced) {
    Config c;
    c.num_ranks = R;
    c.num_experts = R * epn;
    c.num_tokens = 64;
    c.topk = 1;
    c.align = 1 + below(3) * 3;
    ViewShape view;
    view.num_slots = below(3) == 0 ? -1 : below(epn + 1);
    view.view_stride = below(2) == 0 ? 0 : epn + below(3);
    return make_layout(c, planner, view);
}

TEST(DeriveLanes, WarpShapedLaneGroupsDeriveAsOneLane) {
    uint64_t state = 777;
    auto below = [&](int n) { return int(routing::mix64(state++) % uint64_t(n)); };
    int cases = 0, over_lanes = 0;
    for (int it = 0; it < 120; ++it) {
        const int R = 1 + below(6), epn = 1 + below(it % 3 == 0 ? 70 : 9), E = R * epn;
        const Layout l = random_layout(R, epn, below);
        // Own rows, and up to epn replicas per rank with rows from a small range (ties).
        std::vector<int32_t> alloc(size_t(R) * E, 0);
        for (int d = 0; d < R; ++d) {
            for (int i = 0; i < epn; ++i) alloc[size_t(d) * E + d * epn + i] = below(4) == 0 ? 0 : below(9);
            const int replicas = below(epn + 1);
            for (int k = 0; k < replicas; ++k) {
                const int e = below(E);
                if (e / epn != d) alloc[size_t(d) * E + e] = 1 + below(5);
            }
            int n = 0;
            for (int e = 0; e < E; ++e) n += e / epn != d && alloc[size_t(d) * E + e] > 0;
            over_lanes += n > 4 && n > l.num_slots;
        }
        const std::string what = "it=" + std::to_string(it) + " R=" + std::to_string(R) +
                                 " epn=" + std::to_string(epn) + " B=" + std::to_string(l.num_slots) +
                                 " Q=" + std::to_string(l.view_stride);
        const RankArrays want = derive_ranks<planner::OneLane>(l, alloc);
        expect_same(derive_ranks<ThreadLanes<32, 4>>(l, alloc), want, "32 lanes x 4 items " + what);
        expect_same(derive_ranks<ThreadLanes<4, 1>>(l, alloc), want, "4 lanes x 1 item " + what);
        expect_same(derive_ranks<ThreadLanes<3, 2>>(l, alloc), want, "3 lanes x 2 items " + what);
        if (HasFailure()) return;
        ++cases;
    }
    EXPECT_EQ(cases, 120);
    EXPECT_GT(over_lanes, 20);  // more replicas than slots and than the 4-lane group: multi-pass slot compaction
}

// The static planner's rank task: the slots are the placement (its order, empty slots anywhere), groups of placed
// copies with and without rows; the same arrays on every lane group shape.
TEST(DeriveLanes, StaticPlacementLaneGroupsDeriveAsOneLane) {
    uint64_t state = 4242;
    auto below = [&](int n) { return int(routing::mix64(state++) % uint64_t(n)); };
    for (int it = 0; it < 80; ++it) {
        const int R = 2 + below(5), epn = 1 + below(it % 3 == 0 ? 70 : 9), E = R * epn;
        const Layout l = random_layout(R, epn, below, PlannerKind::kStatic);
        const int B = l.num_slots;
        std::vector<int32_t> placement(size_t(R) * B, -1);
        for (int d = 0; d < R; ++d) {
            for (int j = 0; j < B; ++j) {
                const int e = below(E);
                const auto row = placement.begin() + int64_t(d) * B;
                if (below(5) != 0 && e / epn != d && std::find(row, row + B, e) == row + B)
                    placement[size_t(d) * B + j] = e;
            }
        }
        const std::vector<int32_t> table = planner::make_placement_table(l, placement);
        const planner::PlacementView placed = planner::make_placement_view(l, table.data());
        // Rows on the copies only (some of them empty), as a static plan has.
        std::vector<int32_t> alloc(size_t(R) * E, 0);
        for (int d = 0; d < R; ++d)
            for (int e = 0; e < E; ++e)
                if (placed.copy[size_t(d) * E + e] >= 0 && below(3) != 0) alloc[size_t(d) * E + e] = below(9);
        const std::string what = "it=" + std::to_string(it) + " R=" + std::to_string(R) +
                                 " epn=" + std::to_string(epn) + " B=" + std::to_string(B);
        const RankArrays want = derive_ranks<planner::OneLane>(l, alloc, placed);
        for (int d = 0; d < R; ++d) {
            std::vector<int32_t> row(placement.begin() + int64_t(d) * B, placement.begin() + int64_t(d + 1) * B);
            row.resize(size_t(epn), -1);
            ASSERT_EQ(std::vector<int32_t>(want.slot_expert.begin() + int64_t(d) * epn,
                                           want.slot_expert.begin() + int64_t(d + 1) * epn),
                      row)
                << what;
        }
        expect_same(derive_ranks<ThreadLanes<32, 4>>(l, alloc, placed), want, "32 lanes x 4 items " + what);
        expect_same(derive_ranks<ThreadLanes<3, 2>>(l, alloc, placed), want, "3 lanes x 2 items " + what);
        if (HasFailure()) return;
    }
}

}  // namespace
}  // namespace flatep
