// The summation orders design §6 fixes, each on terms whose fp32 sum depends on the order: with e = 2^-24,
// (1 + e) + -1 = 0 (1 + e is a tie that rounds to 1) while (-1 + e) + 1 = e (exact). So the ascending order gives one
// value and every other order the other, and the CPU backend, the bitwise oracle of the kernels, is held to it:
//   combine: a chain's terms in ascending k, then the per-destination partials in ascending destination rank;
//   reduce_grad: the owner's gradient, then the replicas' in ascending (rank, slot).
// The expected bits are worked out by hand; nothing is recomputed with the code under test.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::bits_of;
using testing::failures;
using testing::run_ranks;

const float kTiny = std::ldexp(1.0f, -24);  // e: exact in fp32 and in bf16

constexpr int kH = 8;

// Three terms in the order they must be added, and the sum in that order (by hand: see the header).
struct Terms {
    float a, b, c, sum;
};
const Terms kTiesAway = {1.0f, kTiny, -1.0f, 0.0f};   // (1 + e) + -1 = 0; reversed: (-1 + e) + 1 = e
const Terms kExactGap = {-1.0f, kTiny, 1.0f, kTiny};  // (-1 + e) + 1 = e; reversed: (1 + e) + -1 = 0

Config config(int R, int rank, int E, int S, int K) {
    return Config{.num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = kH, .align = 1};
}

void fill_row(std::vector<uint16_t>& y, int row, float v) {
    for (int i = 0; i < kH; ++i) y[size_t(row) * kH + i] = float_to_bf16(v);
}

// The first element of out's row 0 whose bits differ from bf16(want), or -1.
int first_wrong(const std::vector<uint16_t>& out, float want) {
    for (int i = 0; i < kH; ++i)
        if (out[i] != float_to_bf16(want)) return i;
    return -1;
}

TEST(OrderedSums, CombineAddsAChainInAscendingK) {
    // One rank, one token whose K = 3 entries all land on it (experts 0, 1, 2): one chain, one partial. Entry k's row
    // holds term k; out = bf16(((0 + t0) + t1) + t2). Weighted with weights 1: fma(1, y, acc) rounds as acc + y.
    LocalHostWorld world(1, 10.0);
    Buffer buffer(config(1, 0, 3, 1, 3), world.transport(0));
    const int32_t idx[3] = {0, 1, 2};
    const Plan plan = buffer.plan(idx, 4, 1);
    const int nvs = buffer.num_recv_rows();
    for (const Terms& t : {kTiesAway, kExactGap}) {
        std::vector<uint16_t> y(size_t(nvs) * kH, 0);
        const float term[3] = {t.a, t.b, t.c};
        for (int k = 0; k < 3; ++k) fill_row(y, plan.entry_rows()[k], term[k]);
        std::vector<float> w(nvs, 1.0f);
        std::vector<uint16_t> out(kH, 0xffff);
        buffer.combine(plan, y.data(), nullptr, out.data());
        EXPECT_EQ(first_wrong(out, t.sum), -1) << "unweighted, terms " << t.a << ", " << t.b << ", " << t.c;
        buffer.combine(plan, y.data(), w.data(), out.data());
        EXPECT_EQ(first_wrong(out, t.sum), -1) << "weighted, terms " << t.a << ", " << t.b << ", " << t.c;
    }
}

TEST(OrderedSums, CombineAddsPartialsInAscendingDestinationRank) {
    // R = 3, E = 3 (one expert per rank): rank 0's one token routes to all three experts (the other ranks pass no
    // token), N = 3, targets 1 each, so entry k stays on expert idx[k]'s home rank as the only row there. Rank d's
    // row holds term d, so its partial is that term (exact in bf16) and out = bf16(((0 + p0) + p1) + p2) whatever
    // the k order: idx {2, 0, 1} puts k = 0 on rank 2 and still sums rank 0 first.
    const int R = 3;
    LocalHostWorld world(R, 10.0);
    const int32_t orders[2][3] = {{0, 1, 2}, {2, 0, 1}};
    std::vector<std::pair<int, const Terms*>> cases;  // (order, terms by rank)
    for (int o = 0; o < 2; ++o)
        for (const Terms* t : {&kTiesAway, &kExactGap}) cases.push_back({o, t});
    std::vector<std::vector<uint16_t>> outs(cases.size(), std::vector<uint16_t>(kH, 0xffff));
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Buffer buffer(config(R, rank, 3, 1, 3), world.transport(rank));
        const int nvs = buffer.num_recv_rows();
        for (size_t c = 0; c < cases.size(); ++c) {
            const Plan plan = buffer.plan(orders[cases[c].first], 4, rank == 0 ? 1 : 0);
            ASSERT_EQ(plan.cu_seqlens(rank)[0], 1) << "rank " << rank << ": one row of its own expert";
            const Terms& t = *cases[c].second;
            const float term[3] = {t.a, t.b, t.c};
            std::vector<uint16_t> y(size_t(nvs) * kH, 0);
            fill_row(y, 0, term[rank]);
            buffer.combine(plan, y.data(), nullptr, rank == 0 ? outs[c].data() : nullptr);
        }
    });
    ASSERT_EQ(failures(errors), "");
    for (size_t c = 0; c < cases.size(); ++c) {
        const Terms& t = *cases[c].second;
        EXPECT_EQ(first_wrong(outs[c], t.sum), -1)
            << "topk order " << cases[c].first << ", rank terms " << t.a << ", " << t.b << ", " << t.c;
    }
}

TEST(OrderedSums, ReduceGradAddsTheOwnerThenReplicasInAscendingRank) {
    // R = 3, E = 3, S = 2, K = 1, exact: every rank routes both tokens to expert 0, so rank 0 holds 6 entries against
    // targets of 2, and ranks 1 and 2 each get a replica of expert 0 in slot 0. Element i of the owner's gradient and
    // of the two replicas' gradients holds term a, b, c of one of the two orders: grad = ((a + b) + c).
    const int R = 3, n = 8;  // an expert of 16 bytes of bf16 weights (ExpertPools' size contract)
    LocalHostWorld world(R, 10.0);
    const Terms* per_elem[n] = {&kTiesAway, &kExactGap, &kTiesAway, &kExactGap,
                                &kTiesAway, &kExactGap, &kTiesAway, &kExactGap};
    std::vector<std::vector<float>> own_after(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Buffer buffer(config(R, rank, 3, 2, 1), world.transport(rank));
        ExpertPools pools(world.transport(rank), 1, {{1, n}});
        ExpertLayer layer = pools.register_layer();
        const int32_t idx[2] = {0, 0};
        const Plan plan = buffer.plan(idx, 4, 2);
        ASSERT_EQ(plan.slot_expert(0)[0], -1);
        ASSERT_EQ(plan.slot_expert(1)[0], 0);
        ASSERT_EQ(plan.slot_expert(2)[0], 0);
        float* grads = layer.grads(0);  // [own expert | slot 0]
        for (int i = 0; i < n; ++i) {
            const Terms& t = *per_elem[i];
            grads[i] = rank == 0 ? t.a : 5.0f;  // experts 1 and 2 have no replica: their grads stay as they are
            grads[n + i] = rank == 1 ? t.b : (rank == 2 ? t.c : -7.0f);
        }
        pools.reduce_grad(plan, layer);
        own_after[rank].assign(layer.own_grads(0), layer.own_grads(0) + n);
    });
    ASSERT_EQ(failures(errors), "");
    for (int i = 0; i < n; ++i) {
        const Terms& t = *per_elem[i];
        EXPECT_EQ(bits_of(own_after[0][i]), bits_of(t.sum)) << "element " << i << ": owner " << t.a << ", rank 1 "
                                                            << t.b << ", rank 2 " << t.c << " gave " << own_after[0][i];
        EXPECT_EQ(own_after[1][i], 5.0f);
        EXPECT_EQ(own_after[2][i], 5.0f);
    }
}

}  // namespace
}  // namespace flatep
