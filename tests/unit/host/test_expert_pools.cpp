// ExpertPools on the CPU backend: the contiguous compute views alias the layer's memory and the shared pools,
// prefetch pushes replicas' weights into the right slots, reduce_grad adds replicas' grads in (rank, slot) order
// and zeroes the consumed slots.
#include <gtest/gtest.h>

#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::failures;
using testing::run_ranks;

TEST(ExpertPools, ComputeViewIsOneRangeOverLayerMemoryThenPool) {
    LocalHostWorld world(1, 10.0);
    const int epn = 3;
    ExpertPools pools(world.transport(0), epn, {{5, 7}, {8, 16}});
    ExpertLayer layer = pools.register_layer();
    ExpertLayer other = pools.register_layer();
    for (int p = 0; p < 2; ++p) {
        const int64_t elems = pools.shape(p).elems();
        uint16_t* view = layer.weights(p);
        float* grads = layer.grads(p);
        // Fresh memory is zero.
        for (int64_t i = 0; i < 2 * epn * elems; ++i) ASSERT_EQ(view[i], 0) << "projection " << p << " elem " << i;
        // Own half: the view and the layer's own mapping are the same memory.
        view[0] = 0x1234;
        view[epn * elems - 1] = 0x2345;
        EXPECT_EQ(layer.own_weights(p)[0], 0x1234);
        EXPECT_EQ(layer.own_weights(p)[epn * elems - 1], 0x2345);
        layer.own_weights(p)[elems] = 0x3456;
        EXPECT_EQ(view[elems], 0x3456);
        // Slot half: the element right after the own experts is slot 0 of the shared pool.
        view[epn * elems] = 0x4567;
        view[2 * epn * elems - 1] = 0x5678;
        EXPECT_EQ(pools.slot_pool(p)[0], 0x4567);
        EXPECT_EQ(pools.slot_pool(p)[epn * elems - 1], 0x5678);
        // Another layer shares the pool but not the own memory.
        EXPECT_EQ(other.weights(p)[epn * elems], 0x4567);
        EXPECT_EQ(other.weights(p)[0], 0);
        // Grads likewise: own grads then the reduce pool.
        grads[1] = 1.5f;
        grads[epn * elems + 2] = -2.5f;
        EXPECT_EQ(layer.own_grads(p)[1], 1.5f);
        EXPECT_EQ(pools.reduce_pool(p)[2], -2.5f);
        pools.reduce_pool(p)[3] = 4.0f;
        EXPECT_EQ(other.grads(p)[epn * elems + 3], 4.0f);
    }
}

TEST(ExpertPools, PrefetchAndReduceGradFollowThePlan) {
    // Skewed routing so the planner places replicas; then check every slot holds its expert's weights and every
    // owner's grads equal own + sum of replica grads in (rank, slot) order (exact fp32 sums of small integers).
    const int R = 4, epn = 2, E = R * epn, S = 16, K = 2;
    const ProjectionShape shapes[2] = {{3, 8}, {4, 4}};
    LocalHostWorld world(R, 10.0);
    std::vector<std::vector<int32_t>> slot_expert(R);
    std::vector<std::vector<std::vector<uint16_t>>> slots(R, std::vector<std::vector<uint16_t>>(2));
    std::vector<std::vector<std::vector<float>>> grads(R, std::vector<std::vector<float>>(2));
    std::vector<std::vector<std::vector<float>>> pools_after(R, std::vector<std::vector<float>>(2));
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Config c;
        c.num_ranks = R;
        c.rank = rank;
        c.num_experts = E;
        c.num_tokens = S;
        c.topk = K;
        c.hidden = 8;
        c.align = 1;
        Buffer buffer(c, world.transport(rank));
        ExpertPools pools(world.transport(rank), epn, {shapes[0], shapes[1]});
        ExpertLayer layer = pools.register_layer();
        // Everyone routes to experts 0 and 1 (rank 0): rank 0 is 4x overloaded, so its experts get replicas.
        std::vector<int32_t> idx(S * K);
        for (int t = 0; t < S; ++t) {
            idx[t * K] = 0;
            idx[t * K + 1] = 1 + (t % 4 == 0 ? 2 : 0);
        }
        const Plan plan = buffer.plan(idx.data(), 4, S);
        for (int d = 0; d < R; ++d)
            for (int32_t e : plan.slot_expert(d)) slot_expert[rank].push_back(e);
        for (int p = 0; p < 2; ++p) {
            const int64_t n = shapes[p].elems();
            // Own weights: expert e, element i = bf16(e * 100 + i); own grads: e + 0.5; replica grads written into
            // the reduce pool half of the view: (rank + 1) * 1000 + slot.
            for (int g = 0; g < epn; ++g) {
                const int e = rank * epn + g;
                for (int64_t i = 0; i < n; ++i) {
                    layer.weights(p)[g * n + i] = float_to_bf16(float(e * 100 + i));
                    layer.grads(p)[g * n + i] = float(e) + 0.5f;
                }
            }
            for (int j = 0; j < epn; ++j) {
                for (int64_t i = 0; i < n; ++i) layer.grads(p)[(epn + j) * n + i] = float((rank + 1) * 1000 + j);
            }
        }
        pools.prefetch(plan, layer);
        pools.reduce_grad(plan, layer);
        for (int p = 0; p < 2; ++p) {
            const int64_t n = shapes[p].elems();
            slots[rank][p].assign(layer.weights(p) + epn * n, layer.weights(p) + 2 * epn * n);
            grads[rank][p].assign(layer.grads(p), layer.grads(p) + epn * n);
            pools_after[rank][p].assign(pools.reduce_pool(p), pools.reduce_pool(p) + epn * n);
        }
    });
    ASSERT_EQ(failures(errors), "");
    int replicas = 0;
    for (int r = 0; r < R; ++r) ASSERT_EQ(slot_expert[r], slot_expert[0]);
    const std::vector<int32_t>& se = slot_expert[0];
    for (int p = 0; p < 2; ++p) {
        const int64_t n = shapes[p].elems();
        for (int d = 0; d < R; ++d) {
            for (int j = 0; j < epn; ++j) {
                const int e = se[d * epn + j];
                for (int64_t i = 0; i < n; ++i) {
                    // Consumed slots are zero after reduce_grad; others keep what the test wrote.
                    const float pool_expect = e >= 0 ? 0.0f : float((d + 1) * 1000 + j);
                    ASSERT_EQ(pools_after[d][p][j * n + i], pool_expect) << "rank " << d << " slot " << j;
                    if (e < 0) continue;
                    ASSERT_EQ(slots[d][p][j * n + i], float_to_bf16(float(e * 100 + i)))
                        << "rank " << d << " slot " << j;
                }
                if (e >= 0 && p == 0) ++replicas;
            }
        }
        for (int owner = 0; owner < R; ++owner) {
            for (int g = 0; g < epn; ++g) {
                const int e = owner * epn + g;
                float expect = float(e) + 0.5f;
                for (int d = 0; d < R; ++d)
                    for (int j = 0; j < epn; ++j)
                        if (se[d * epn + j] == e) expect = expect + float((d + 1) * 1000 + j);
                for (int64_t i = 0; i < n; ++i) ASSERT_EQ(grads[owner][p][g * n + i], expect) << "expert " << e;
            }
        }
    }
    EXPECT_GE(replicas, 2);  // the routing is skewed enough that the test exercises replicas
}

TEST(ExpertPools, RejectsLayersOfOtherPoolsAndMismatchedPlans) {
    LocalHostWorld world(1, 10.0);
    Config c;
    c.num_experts = 2;
    c.num_tokens = 2;
    c.hidden = 8;
    c.align = 1;
    Buffer buffer(c, world.transport(0));
    ExpertPools a(world.transport(0), 2, {{2, 2}});
    ExpertPools b(world.transport(0), 2, {{2, 2}});
    ExpertPools wrong_epn(world.transport(0), 1, {{2, 2}});
    ExpertLayer layer = b.register_layer();
    const int32_t idx[2] = {0, 1};
    const Plan plan = buffer.plan(idx, 4, 2);
    try {
        a.prefetch(plan, layer);
        FAIL() << "no error";
    } catch (const Error& e) {
        EXPECT_EQ(e.category(), ErrorCategory::kMismatch);
        EXPECT_EQ(e.message(), "prefetch: layer was registered with pools " + std::to_string(b.id()) +
                                   ", not with these pools (" + std::to_string(a.id()) + ")");
    }
    ExpertLayer one = wrong_epn.register_layer();
    try {
        wrong_epn.reduce_grad(plan, one);
        FAIL() << "no error";
    } catch (const Error& e) {
        EXPECT_EQ(e.message(), "reduce_grad: plan has R=1 epn=2 but the pools have R=1 epn=1");
    }
}

}  // namespace
}  // namespace flatep
