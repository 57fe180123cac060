// ExpertPools on the CPU backend: the contiguous compute views alias the layer's memory and the shared pools,
// prefetch pushes replicas' weights into the right slots, reduce_grad adds replicas' grads in (rank, slot) order
// and zeroes the consumed slots; write_grads puts a grouped GEMM's gradients into the grads view the way reduce_grad
// expects them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "ops/prefetch_args.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::error_message;
using testing::failures;
using testing::run_ranks;

TEST(ExpertPools, ComputeViewIsOneRangeOverLayerMemoryThenPool) {
    LocalHostWorld world(1, 10.0);
    const int epn = 3;
    ExpertPools pools(world.transport(0), epn, {{5, 8}, {8, 16}});
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

TEST(ExpertPools, RefusesExpertsNotAMultipleOf16BytesInTheConstructor) {
    // One size contract for both backends (design §5): the constructor refuses what the GPU's prefetch cannot move.
    LocalHostWorld world(1, 10.0);
    try {
        ExpertPools pools(world.transport(0), 2, {{8, 16}, {3, 5}});
        FAIL() << "no error";
    } catch (const Error& e) {
        EXPECT_EQ(e.category(), ErrorCategory::kInvalidArgument);
        EXPECT_EQ(e.message(),
                  "ExpertPools: projection 1 of [3][5] has 30 bytes per expert (bf16), not a multiple of 16; rows * "
                  "cols must be a multiple of 8");
    }
    EXPECT_EQ(error_message([&] {
                  ExpertPools pools(world.transport(0), 2, {{1, 4}});
              }),
              "ExpertPools: projection 0 of [1][4] has 8 bytes per expert (bf16), not a multiple of 16; rows * cols "
              "must be a multiple of 8");
    EXPECT_EQ(error_message([&] { ExpertPools pools(world.transport(0), 3, {{1, 8}, {7, 24}}); }), "(no error)");
}

// An own weight's bits: projection p, expert e, element i (byte copies move any pattern).
uint16_t weight_bits(int p, int e, int64_t i) { return uint16_t(((p * 16 + e) << 8) | (i & 0xff)); }

// Skewed routing so the planner places replicas; then check every slot holds its expert's weights and every owner's
// grads equal own + sum of replica grads in (rank, slot) order (exact fp32 sums of small integers). Weights are bit
// patterns naming projection, expert and element, so a slot filled from the wrong projection, expert or offset shows.
void check_prefetch_and_reduce_grad(const std::vector<ProjectionShape>& shapes) {
    const int R = 4, epn = 2, E = R * epn, S = 16, K = 2;
    const int P = int(shapes.size());
    LocalHostWorld world(R, 10.0);
    std::vector<std::vector<int32_t>> slot_expert(R);
    std::vector<std::vector<std::vector<uint16_t>>> slots(R, std::vector<std::vector<uint16_t>>(P));
    std::vector<std::vector<std::vector<float>>> grads(R, std::vector<std::vector<float>>(P));
    std::vector<std::vector<std::vector<float>>> pools_after(R, std::vector<std::vector<float>>(P));
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        const Config c{
            .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = 8, .align = 1};
        Buffer buffer(c, world.transport(rank));
        ExpertPools pools(world.transport(rank), epn, shapes);
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
        for (int p = 0; p < P; ++p) {
            const int64_t n = shapes[p].elems();
            // Own weights: expert e, element i = bf16(e * 100 + i); own grads: e + 0.5; replica grads written into
            // the reduce pool half of the view: (rank + 1) * 1000 + slot.
            for (int g = 0; g < epn; ++g) {
                const int e = rank * epn + g;
                for (int64_t i = 0; i < n; ++i) {
                    layer.weights(p)[g * n + i] = weight_bits(p, e, i);
                    layer.grads(p)[g * n + i] = float(e) + 0.5f;
                }
            }
            for (int j = 0; j < epn; ++j) {
                for (int64_t i = 0; i < n; ++i) layer.grads(p)[(epn + j) * n + i] = float((rank + 1) * 1000 + j);
            }
        }
        pools.prefetch(plan, layer);
        pools.reduce_grad(plan, layer);
        for (int p = 0; p < P; ++p) {
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
    for (int p = 0; p < P; ++p) {
        const int64_t n = shapes[p].elems();
        for (int d = 0; d < R; ++d) {
            for (int j = 0; j < epn; ++j) {
                const int e = se[d * epn + j];
                for (int64_t i = 0; i < n; ++i) {
                    // Consumed slots are zero after reduce_grad; others keep what the test wrote.
                    const float pool_expect = e >= 0 ? 0.0f : float((d + 1) * 1000 + j);
                    ASSERT_EQ(pools_after[d][p][j * n + i], pool_expect) << "rank " << d << " slot " << j;
                    if (e < 0) continue;
                    ASSERT_EQ(slots[d][p][j * n + i], weight_bits(p, e, i)) << "rank " << d << " slot " << j;
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

TEST(ExpertPools, PrefetchAndReduceGradFollowThePlan) { check_prefetch_and_reduce_grad({{3, 8}, {4, 4}}); }

// More projections than one prefetch op carries (kMaxPrefetchProjections): the pools split them into several ops.
TEST(ExpertPools, PrefetchMovesMoreProjectionsThanOneOpCarries) {
    std::vector<ProjectionShape> shapes;
    for (int p = 0; p < kMaxPrefetchProjections + 2; ++p) shapes.push_back({p % 2 == 0 ? 8 : 3, 8});
    check_prefetch_and_reduce_grad(shapes);
}

TEST(ExpertPools, WriteGradsWritesOwnGroupsAndUsedSlotsOnly) {
    // Skewed routing: rank 0's experts get replicas, experts 2 (rank 1) and 4..7 (ranks 2, 3) get no rows. The GEMM
    // gradient holds NaN in every group without rows (a grouped GEMM need not write them): own ones must come out
    // zero, slot ones untouched (the test pre-fills the grads view with a sentinel). Projection 0 passes bf16,
    // projection 1 fp32 (odd rows).
    const int R = 4, epn = 2, E = R * epn, S = 16, K = 2;
    const ProjectionShape shapes[2] = {{3, 8}, {5, 8}};
    const float kSentinel = -777.25f;
    LocalHostWorld world(R, 10.0);
    std::vector<std::string> mismatch(R);
    std::vector<int> slots_used(R, 0), own_empty(R, 0);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        const Config c{
            .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = 8, .align = 4};
        Buffer buffer(c, world.transport(rank));
        ExpertPools pools(world.transport(rank), epn, {shapes[0], shapes[1]});
        ExpertLayer layer = pools.register_layer();
        std::vector<int32_t> idx(S * K);
        for (int t = 0; t < S; ++t) {
            idx[t * K] = 0;
            idx[t * K + 1] = t % 4 == 0 ? 3 : 1;
        }
        const Plan plan = buffer.plan(idx.data(), 4, S);
        const std::span<const int32_t> cu = plan.cu_seqlens(rank), slots = plan.slot_expert(rank);
        auto has_rows = [&](int g) { return cu[g] > (g == 0 ? 0 : cu[g - 1]); };
        auto value = [&](int p, int g, int64_t i) { return float(p * 1000 + rank * 100 + g * 10) + float(i) * 0.5f; };
        std::ostringstream bad;
        for (int p = 0; p < 2; ++p) {
            const int64_t n = shapes[p].elems();
            for (int64_t i = 0; i < 2 * epn * n; ++i) layer.grads(p)[i] = kSentinel;
            std::vector<uint16_t> g16(size_t(2 * epn * n));
            std::vector<float> g32(size_t(2 * epn * n));
            for (int g = 0; g < 2 * epn; ++g) {
                for (int64_t i = 0; i < n; ++i) {
                    g16[g * n + i] = has_rows(g) ? float_to_bf16(value(p, g, i)) : uint16_t(0x7fc1);
                    g32[g * n + i] = has_rows(g) ? value(p, g, i) : std::nanf("");
                }
            }
            if (p == 0) {
                pools.write_grads(plan, layer, p, g16.data(), 2);
            } else {
                pools.write_grads(plan, layer, p, g32.data(), 4);
            }
            for (int g = 0; g < 2 * epn; ++g) {
                const bool own = g < epn, used = own || slots[g - epn] >= 0;
                if (p == 0 && !own && used) ++slots_used[rank];
                if (p == 0 && own && !has_rows(g)) ++own_empty[rank];
                for (int64_t i = 0; i < n; ++i) {
                    const float v = p == 0 ? bf16_to_float(float_to_bf16(value(p, g, i))) : value(p, g, i);
                    const float want = !used ? kSentinel : (has_rows(g) ? v : 0.0f);
                    const float got = layer.grads(p)[g * n + i];
                    if (std::memcmp(&got, &want, 4) != 0 && bad.str().empty()) {
                        bad << "projection " << p << " group " << g << " elem " << i << ": got " << got << " expected "
                            << want;
                    }
                }
            }
        }
        // reduce_grad on top: owners get own + replicas' grads; consumed slots zero, unused slots untouched.
        pools.reduce_grad(plan, layer);
        for (int p = 0; p < 2 && bad.str().empty(); ++p) {
            const int64_t n = shapes[p].elems();
            for (int j = 0; j < epn; ++j) {
                const float want = slots[j] >= 0 ? 0.0f : kSentinel;
                for (int64_t i = 0; i < n; ++i) {
                    if (pools.reduce_pool(p)[j * n + i] != want && bad.str().empty())
                        bad << "after reduce_grad: projection " << p << " slot " << j << " elem " << i;
                }
            }
        }
        mismatch[rank] = bad.str();
        // Own gradients after the reduction (element 0 of every group is a small integer, exact in bf16).
        for (int p = 0; p < 2; ++p) {
            const int64_t n = shapes[p].elems();
            for (int g = 0; g < epn; ++g) {
                float expect = has_rows(g) ? value(p, g, 0) : 0.0f;
                const int e = rank * epn + g;
                for (int d = 0; d < R; ++d) {
                    for (int j = 0; j < epn; ++j) {
                        if (plan.slot_expert(d)[j] != e) continue;
                        // Rank d's slot j group (epn + j) had rows (a used slot always does): its element 0 value.
                        expect = expect + float(p * 1000 + d * 100 + (epn + j) * 10);
                    }
                }
                if (layer.own_grads(p)[g * n] != expect && mismatch[rank].empty()) {
                    std::ostringstream os;
                    os << "after reduce_grad: projection " << p << " expert " << e << " elem 0: got "
                       << layer.own_grads(p)[g * n] << " expected " << expect;
                    mismatch[rank] = os.str();
                }
            }
        }
    });
    ASSERT_EQ(failures(errors), "");
    int used = 0, empty = 0;
    for (int r = 0; r < R; ++r) {
        EXPECT_EQ(mismatch[r], "") << "rank " << r;
        used += slots_used[r];
        empty += own_empty[r];
    }
    EXPECT_GE(used, 2);        // replicas exercised
    EXPECT_GE(empty, 2);       // own groups without rows exercised
    EXPECT_LT(used, R * epn);  // some slots unused (left untouched)
}

TEST(ExpertPools, WriteGradsAccumulateAddsOwnGroupsWithRowsAndOverwritesSlots) {
    // Two micro-batches into the same own grads (Megatron's main_grad): the first writes (fp32), the second
    // accumulates a bf16 gradient. Own groups with rows: first + float(second) in one fp32 add; own groups without
    // rows: untouched by the accumulating call (the first call zeroed them, then the test plants a marker); slots:
    // overwritten by the second call when used and with rows, untouched otherwise.
    const int R = 4, epn = 2, E = R * epn, S = 16, K = 2;
    const ProjectionShape shape{3, 8};
    const float kSentinel = -777.25f, kMarker = 12.5f;
    LocalHostWorld world(R, 10.0);
    std::vector<std::string> mismatch(R);
    std::vector<int> adds(R, 0), untouched(R, 0);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        const Config c{
            .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = 8, .align = 4};
        Buffer buffer(c, world.transport(rank));
        ExpertPools pools(world.transport(rank), epn, {shape});
        ExpertLayer layer = pools.register_layer();
        std::vector<int32_t> idx(S * K);
        for (int t = 0; t < S; ++t) {
            idx[t * K] = 0;
            idx[t * K + 1] = t % 4 == 0 ? 3 : 1;
        }
        const Plan plan = buffer.plan(idx.data(), 4, S);
        const std::span<const int32_t> cu = plan.cu_seqlens(rank), slots = plan.slot_expert(rank);
        auto has_rows = [&](int g) { return cu[g] > (g == 0 ? 0 : cu[g - 1]); };
        const int64_t n = shape.elems();
        std::vector<float> first(size_t(2 * epn * n));
        std::vector<uint16_t> second(size_t(2 * epn * n));
        for (int64_t i = 0; i < 2 * epn * n; ++i) {
            first[i] = 0.1f * float(i) + float(rank);
            second[i] = float_to_bf16(1.0f / 3.0f + float(i % 7));  // not exact in the sum: one rounding shows
        }
        for (int64_t i = 0; i < 2 * epn * n; ++i) layer.grads(0)[i] = kSentinel;
        pools.write_grads(plan, layer, 0, first.data(), 4);
        for (int g = 0; g < epn; ++g) {
            if (!has_rows(g)) std::fill_n(layer.grads(0) + g * n, n, kMarker);
        }
        std::vector<float> before(layer.grads(0), layer.grads(0) + 2 * epn * n);
        pools.write_grads(plan, layer, 0, second.data(), 2, /*accumulate=*/true);
        std::ostringstream bad;
        for (int g = 0; g < 2 * epn; ++g) {
            const bool own = g < epn, used = own || slots[g - epn] >= 0;
            if (own) (has_rows(g) ? adds : untouched)[rank] += 1;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t at = g * n + i;
                const float add = bf16_to_float(second[at]);
                float want = before[at];
                if (own && has_rows(g)) want = before[at] + add;
                if (!own && used && has_rows(g)) want = add;
                const float got = layer.grads(0)[at];
                if (std::memcmp(&got, &want, 4) != 0 && bad.str().empty())
                    bad << "group " << g << " elem " << i << ": got " << got << " expected " << want;
            }
        }
        mismatch[rank] = bad.str();
    });
    ASSERT_EQ(failures(errors), "");
    int total_adds = 0, total_untouched = 0;
    for (int r = 0; r < R; ++r) {
        EXPECT_EQ(mismatch[r], "") << "rank " << r;
        total_adds += adds[r];
        total_untouched += untouched[r];
    }
    EXPECT_GE(total_adds, 2);
    EXPECT_GE(total_untouched, 2);
}

TEST(ExpertPools, WriteGradsRejectsBadArguments) {
    LocalHostWorld world(1, 10.0);
    const Config c{.num_experts = 2, .num_tokens = 2, .hidden = 8, .align = 1};
    Buffer buffer(c, world.transport(0));
    ExpertPools pools(world.transport(0), 2, {{2, 4}});
    ExpertPools other(world.transport(0), 2, {{2, 4}});
    ExpertLayer layer = pools.register_layer();
    ExpertLayer foreign = other.register_layer();
    const int32_t idx[2] = {0, 1};
    const Plan plan = buffer.plan(idx, 4, 2);
    std::vector<uint16_t> grad(32);  // [2*epn][2][4]
    EXPECT_EQ(error_message([&] { pools.write_grads(plan, layer, 1, grad.data(), 2); }),
              "write_grads: projection must be in [0, 1), got 1");
    EXPECT_EQ(error_message([&] { pools.write_grads(plan, layer, 0, grad.data(), 8); }),
              "write_grads: grad_bytes must be 2 (bf16) or 4 (fp32), got 8");
    EXPECT_EQ(error_message([&] { pools.write_grads(plan, layer, 0, nullptr, 2); }), "write_grads: grad is null");
    EXPECT_EQ(error_message([&] { pools.write_grads(Plan(), layer, 0, grad.data(), 2); }),
              "write_grads: plan is empty (default-constructed); get one from Buffer::plan()");
    EXPECT_EQ(error_message([&] { pools.write_grads(plan, foreign, 0, grad.data(), 2); }),
              "write_grads: layer was registered with pools " + std::to_string(other.id()) +
                  ", not with these pools (" + std::to_string(pools.id()) + ")");
    EXPECT_EQ(error_message([&] { pools.write_grads(plan, layer, 0, grad.data(), 2); }), "(no error)");
}

TEST(ExpertPools, RejectsLayersOfOtherPoolsAndMismatchedPlans) {
    LocalHostWorld world(1, 10.0);
    const Config c{.num_experts = 2, .num_tokens = 2, .hidden = 8, .align = 1};
    Buffer buffer(c, world.transport(0));
    ExpertPools a(world.transport(0), 2, {{2, 4}});
    ExpertPools b(world.transport(0), 2, {{2, 4}});
    ExpertPools wrong_epn(world.transport(0), 1, {{2, 4}});
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
