// Serving pools on the CPU backend (design §5 "Serving layout"): B < epn slots, the [R*Q + B] weights view whose row
// r*Q + l is rank r's own expert l read in place and whose rows R*Q + j are this rank's slots, the pull prefetch, the
// geometry of the view, and forward-only refusals.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "runtime/serving_view.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::error_message;
using testing::failures;
using testing::run_ranks;

// A keyed value of (expert, projection, element), never zero: a row read from the wrong expert or an unwritten slot
// shows.
uint16_t key(int expert, int projection, int64_t i) {
    return uint16_t(0x1000 + expert * 97 + projection * 31 + (i % 509));
}

TEST(ServingGeometry, RowsLandExactlyAndChunksNeverOverlap) {
    // Small experts on a 4096-byte granularity force pad rows; large ones (a multiple of G) need none.
    for (const int64_t eb : {int64_t(16), int64_t(48), int64_t(1008), int64_t(4096), int64_t(3 * 4096)}) {
        for (const int epn : {1, 3, 8}) {
            for (const int B : {0, 1, epn - 1}) {
                const int R = 4;
                const size_t G = 4096;
                const int64_t q = runtime::serving_stride(R, epn, B, {eb}, G);
                bool ok = false;
                const runtime::ServingGeometry g = runtime::serving_geometry(R, epn, B, eb, G, q, &ok);
                ASSERT_TRUE(ok);
                ASSERT_GE(q, epn);
                for (int r = 0; r <= R; ++r) {
                    ASSERT_EQ(g.offset[r] % G, 0u);
                    ASSERT_EQ(g.offset[r] + g.data_at[r], size_t(r) * size_t(q) * size_t(eb)) << "row of chunk " << r;
                }
                for (int r = 0; r + 1 < R; ++r) ASSERT_GE(g.offset[r + 1], g.offset[r] + g.own_bytes);
                if (B > 0) ASSERT_GE(g.offset[R], g.offset[R - 1] + g.own_bytes);
                // Minimal: one row less does not fit.
                if (q > epn) {
                    bool smaller = true;
                    runtime::serving_geometry(R, epn, B, eb, G, q - 1, &smaller);
                    EXPECT_FALSE(smaller) << "eb " << eb << " epn " << epn << " B " << B;
                }
                if (int64_t(epn) * eb % int64_t(G) == 0) EXPECT_EQ(q, epn) << "no pad rows when epn*eb fills pages";
            }
        }
    }
}

struct ServingCase {
    int R, epn, B, S, K;
};

class ServingPools : public ::testing::TestWithParam<ServingCase> {};

TEST_P(ServingPools, ViewReadsOwnersInPlaceAndPullFillsTheSlots) {
    const ServingCase c = GetParam();
    const int R = c.R, epn = c.epn, E = R * epn, B = c.B, S = c.S, K = c.K;
    const std::vector<ProjectionShape> shapes = {{4, 8}, {8, 2}};  // 64 and 32 bytes per expert: pad rows
    transport::LocalHostWorld world(R, 20.0);
    std::vector<std::vector<int32_t>> slots_of(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        ExpertPools pools(world.transport(rank), epn, shapes, B);
        ASSERT_TRUE(pools.serving());
        ASSERT_FALSE(pools.trains());
        ASSERT_EQ(pools.view_rows(), int64_t(R) * pools.view_stride() + B);
        Config config{
            .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = 8, .align = 1};
        Buffer buffer(config, pools);  // takes the pools' B and Q
        ASSERT_EQ(buffer.num_slots(), B);
        ASSERT_EQ(buffer.view_stride(), pools.view_stride());
        ASSERT_EQ(buffer.num_groups(), pools.view_rows());
        ExpertLayer layer = pools.register_layer();  // collective in serving
        for (int p = 0; p < 2; ++p) {
            const int64_t n = shapes[p].elems();
            for (int l = 0; l < epn; ++l)
                for (int64_t i = 0; i < n; ++i) layer.own_weights(p)[l * n + i] = key(rank * epn + l, p, i);
        }
        // Hot experts on rank 0: every rank routes its tokens to experts 0..K-1, so ranks get replicas of them.
        std::vector<int32_t> idx(size_t(S) * K);
        for (int t = 0; t < S; ++t)
            for (int k = 0; k < K; ++k) idx[size_t(t) * K + k] = (k + (t % 3 == 0 ? rank : 0)) % E;
        const Plan plan = buffer.plan(idx.data(), 4, S);
        pools.prefetch(plan, layer);
        const std::span<const int32_t> se = plan.slot_expert(rank);
        slots_of[rank].assign(se.begin(), se.end());
        for (int p = 0; p < 2; ++p) {
            const int64_t n = shapes[p].elems();
            const uint16_t* view = layer.weights(p);
            // Every byte of the view is mapped, pad rows between the chunks included (a copy of the whole view, as
            // torch's clone() makes, must not fault): here projection 0's chunks leave whole granules between them.
            std::vector<uint16_t> whole(size_t(pools.view_rows() * n));
            std::memcpy(whole.data(), view, whole.size() * sizeof(uint16_t));
            for (int e = 0; e < E; ++e) {
                const int64_t row = pools.view_row(e);
                ASSERT_EQ(row, int64_t(e / epn) * pools.view_stride() + e % epn);
                for (int64_t i = 0; i < n; ++i)
                    ASSERT_EQ(view[row * n + i], key(e, p, i)) << "rank " << rank << " expert " << e << " elem " << i;
            }
            for (int j = 0; j < B; ++j) {
                const int e = se[j];
                const int64_t row = int64_t(R) * pools.view_stride() + j;
                for (int64_t i = 0; i < n; ++i) {
                    ASSERT_EQ(view[row * n + i], e >= 0 ? key(e, p, i) : 0) << "slot " << j << " elem " << i;
                }
            }
        }
        // Forward only.
        EXPECT_NE(error_message([&] { pools.reduce_grad(plan, layer); }).find("forward-only"), std::string::npos);
        EXPECT_EQ(layer.grads(0), nullptr);
    });
    ASSERT_EQ(failures(errors), "");
    for (int r = 0; r < R; ++r) {
        int used = 0;
        for (int j = 0; j < epn; ++j) used += slots_of[r][j] >= 0;
        EXPECT_LE(used, B) << "rank " << r << " uses more slots than B";
        for (int j = B; j < epn; ++j) EXPECT_EQ(slots_of[r][j], -1);
    }
}

INSTANTIATE_TEST_SUITE_P(Slots, ServingPools,
                         ::testing::Values(ServingCase{4, 4, 0, 24, 3}, ServingCase{4, 4, 1, 24, 3},
                                           ServingCase{4, 4, 3, 24, 3}, ServingCase{2, 8, 2, 32, 4}));

// prefetch(plan_ordered = true): the pull has no barrier of its own, so what orders it after the owners' writes is
// the plan op's barrier. Rank 1 (every replica's owner: the hot experts are its own) writes new weights late, just
// before its plan op; the other ranks plan at once and pull: they must read the new weights, never the old ones.
// Two steps, new weights each time. The push refuses plan_ordered.
TEST(ServingPools, PlanOrderedPullSeesWeightsWrittenBeforeThePlan) {
    const int R = 4, epn = 4, E = R * epn, B = 2, S = 24, K = 3;
    const std::vector<ProjectionShape> shapes = {{4, 8}};
    const int64_t n = shapes[0].elems();
    transport::LocalHostWorld world(R, 20.0);
    std::vector<int> pulled(R, 0);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        ExpertPools pools(world.transport(rank), epn, shapes, B);
        Config config{
            .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = 8, .align = 1};
        Buffer buffer(config, pools);
        ExpertLayer layer = pools.register_layer();
        // Every token of every rank goes to rank 1's experts 4, 5, 6: rank 1 overflows, the others take replicas.
        std::vector<int32_t> idx(size_t(S) * K);
        for (int t = 0; t < S; ++t)
            for (int k = 0; k < K; ++k) idx[size_t(t) * K + k] = epn + k;
        for (int step = 1; step <= 2; ++step) {
            if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the late owner
            for (int l = 0; l < epn; ++l)
                for (int64_t i = 0; i < n; ++i) layer.own_weights(0)[l * n + i] = key(rank * epn + l, step, i);
            const Plan plan = buffer.plan(idx.data(), 4, S);
            pools.prefetch(plan, layer, {.options = {.plan_ordered = true}});
            const std::span<const int32_t> se = plan.slot_expert(rank);
            for (int j = 0; j < B; ++j) {
                if (se[j] < 0) continue;
                ++pulled[rank];
                const uint16_t* slot = pools.slot_pool(0) + j * n;
                for (int64_t i = 0; i < n; ++i)
                    ASSERT_EQ(slot[i], key(se[j], step, i)) << "step " << step << " rank " << rank << " slot " << j;
            }
        }
    });
    ASSERT_EQ(failures(errors), "");
    EXPECT_GT(pulled[0] + pulled[2] + pulled[3], 0)
        << "no rank pulled one of rank 1's experts: the test checks nothing";

    transport::LocalHostWorld one(1, 10.0);
    ExpertPools training(one.transport(0), 4, {{4, 8}});  // B = epn: the push
    Config config{.num_ranks = 1, .rank = 0, .num_experts = 4, .num_tokens = 4, .topk = 1, .hidden = 8, .align = 1};
    Buffer buffer(config, one.transport(0));
    ExpertLayer layer = training.register_layer();
    std::vector<int32_t> idx = {0, 1, 2, 3};
    const Plan plan = buffer.plan(idx.data(), 4, 4);
    EXPECT_EQ(error_message([&] { training.prefetch(plan, layer, {.options = {.plan_ordered = true}}); }),
              "prefetch: plan_ordered must be false for a push (training's prefetch needs its two barriers), got true");
}

TEST(ServingPools, PlanAndPoolsMustAgreeOnSlotsAndStride) {
    transport::LocalHostWorld world(1, 10.0);
    ExpertPools pools(world.transport(0), 4, {{4, 8}}, 2);
    Config config{.num_ranks = 1, .rank = 0, .num_experts = 4, .num_tokens = 4, .topk = 1, .hidden = 8, .align = 1};
    Buffer training(config, world.transport(0));  // num_slots = epn
    ExpertLayer layer = pools.register_layer();
    std::vector<int32_t> idx = {0, 1, 2, 3};
    const Plan plan = training.plan(idx.data(), 4, 4);
    const std::string msg = error_message([&] { pools.prefetch(plan, layer); });
    EXPECT_NE(msg.find("plan has num_slots=4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the pools have num_slots=2"), std::string::npos) << msg;
}

TEST(ServingPools, RefusesBadNumSlots) {
    transport::LocalHostWorld world(1, 10.0);
    EXPECT_NE(error_message([&] {
                  ExpertPools(world.transport(0), 4, {{4, 8}}, 5);
              }).find("num_slots (B) must be -1 (= epn) or in [0, epn=4], got 5"),
              std::string::npos);
}

// Pools over another transport must be able to lay out the same groups (the plans' bits then compare): they may take
// a larger view stride than their own mapping needs, and a Buffer made from them takes it.
TEST(ServingPools, ALargerViewStrideIsTakenByTheBuffer) {
    transport::LocalHostWorld world(1, 10.0);
    ExpertPools smallest(world.transport(0), 4, {{4, 8}}, 2);
    const int q = smallest.view_stride() + 5;
    ExpertPools pools(world.transport(0), 4, {{4, 8}}, 2, q);
    EXPECT_EQ(pools.view_stride(), q);
    EXPECT_EQ(pools.view_rows(), q + 2);
    Config config{.num_ranks = 1, .rank = 0, .num_experts = 4, .num_tokens = 4, .topk = 1, .hidden = 8, .align = 1};
    Buffer buffer(config, pools);
    EXPECT_EQ(buffer.view_stride(), q);
    EXPECT_TRUE(buffer.serving());
    EXPECT_EQ(buffer.num_groups(), q + 2);
    ExpertLayer layer = pools.register_layer();
    const std::vector<int32_t> idx = {0, 1, 2, 3};
    const Plan plan = buffer.plan(idx.data(), 4, 4);
    pools.prefetch(plan, layer);  // the plan's groups are the pools' view rows
    EXPECT_EQ(plan.cu_seqlens(0).size(), size_t(q + 2));
}

}  // namespace
}  // namespace flatep
