// The CPU backend end to end (plan, dispatch, combine over R rank threads) in serving mode (B < epn slots, the view
// groups), with the owner planner and with the static planner (a fixed placement), against training mode on the same
// inputs and against testing::reference_plan (the group layout of layout/layout.hpp's contract, written without
// FlatEP code).
//
// Exactness across modes: x holds small integers and the routing weights are 0.5, 1 or 2, so every product and every
// partial sum of combine (y = the dispatched rows, weighted by recv_w) is exact in fp32 and in bf16: a token's output
// is sum_k w_k * x_t bitwise, wherever its rows were computed. So every mode must give the same bits, and these bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "host/op_stats.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "routing/routing.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"
#include "unit/host/reference_plan.hpp"

namespace flatep {
namespace {

using testing::bits_of;
using testing::run_ranks;

constexpr uint16_t kCanaryX = 0xa5a5;

struct Shape {
    int R, epn, S, K, H, align;
    double sigma;
    uint64_t seed;
    bool partial;  // ranks pass s < S tokens (some 0)
};

struct Mode {
    std::string name;
    PlannerKind planner;
    int num_slots;                   // ViewShape::num_slots (B)
    int view_stride;                 // ViewShape::view_stride (Q)
    std::vector<int32_t> placement;  // the static planner's [R][B]
};

// A valid placement of B slots a rank (B = -1: epn), drawn from `seed`: each slot empty one time in four, else an
// expert of another rank not yet in the row, in no particular order.
std::vector<int32_t> placement_of(const Shape& sh, int num_slots, uint64_t seed) {
    const int R = sh.R, epn = sh.epn, E = R * epn, B = num_slots < 0 ? epn : num_slots;
    std::vector<int32_t> placement(size_t(R) * B, -1);
    for (int d = 0; d < R; ++d) {
        for (int j = 0; j < B && R > 1; ++j) {
            if (routing::mix64(seed + uint64_t(d * 131 + j)) % 4 == 0) continue;
            for (int tries = 0; tries < 16; ++tries) {
                const int e = int(routing::mix64(seed * 7 + uint64_t(d * 1009 + j * 31 + tries)) % uint64_t(E));
                const auto row = placement.begin() + int64_t(d) * B;
                if (e / epn != d && std::find(row, row + B, e) == row + B) {
                    placement[size_t(d) * B + j] = e;
                    break;
                }
            }
        }
    }
    return placement;
}

std::vector<Mode> modes_of(const Shape& sh) {
    const int epn = sh.epn;
    std::vector<Mode> modes = {{"training", PlannerKind::kBalanced, -1, 0, {}}};
    modes.push_back({"serving B=0", PlannerKind::kBalanced, 0, 0, {}});
    if (epn > 1) modes.push_back({"serving B=1 Q=epn+1", PlannerKind::kGreedy, 1, epn + 1, {}});
    if (epn > 2) modes.push_back({"serving B=epn-1", PlannerKind::kBalanced, epn - 1, 0, {}});
    modes.push_back({"owner", PlannerKind::kOwner, -1, 0, {}});
    modes.push_back({"owner B=0 Q=epn+2", PlannerKind::kOwner, 0, epn + 2, {}});
    modes.push_back({"static B=epn", PlannerKind::kStatic, -1, 0, placement_of(sh, -1, sh.seed)});
    if (epn > 1)
        modes.push_back(
            {"static B=epn-1 Q=epn+1", PlannerKind::kStatic, epn - 1, epn + 1, placement_of(sh, epn - 1, sh.seed + 1)});
    modes.push_back({"static B=0", PlannerKind::kStatic, 0, 0, {}});
    return modes;
}

// The static planner's allocation, from its rule (design §4): e's copies are its home and the ranks whose slots hold
// it, ascending; each gets floor(T_e / n), and the T_e mod n copies from copy e mod n on, cyclically, one more.
std::vector<int32_t> static_alloc_of(int R, int E, int B, const std::vector<int32_t>& tpe,
                                     const std::vector<int32_t>& placement) {
    const int epn = E / R;
    std::vector<int32_t> alloc(size_t(R) * E, 0);
    for (int e = 0; e < E; ++e) {
        std::vector<int> copies;
        int t = 0;
        for (int d = 0; d < R; ++d) {
            t += tpe[size_t(d) * E + e];
            const auto row = placement.begin() + int64_t(d) * B;
            if (e / epn == d || std::find(row, row + B, e) != row + B) copies.push_back(d);
        }
        const int n = int(copies.size());
        for (int i = 0; i < t; ++i) ++alloc[size_t(copies[size_t((e % n + i) % n)]) * E + e];  // round-robin from e % n
    }
    return alloc;
}

Config config_of(const Shape& sh, const Mode& m, int rank) {
    Config c;
    c.num_ranks = sh.R;
    c.rank = rank;
    c.num_experts = sh.R * sh.epn;
    c.num_tokens = sh.S;
    c.topk = sh.K;
    c.hidden = sh.H;
    c.align = sh.align;
    return c;
}

struct RankInput {
    int num_tokens = 0;
    std::vector<int32_t> topk_idx;  // [s][K]
    std::vector<uint16_t> x;        // [s][H] small integers
    std::vector<float> weights;     // [s][K] in {0.5, 1, 2}
};

std::vector<RankInput> make_inputs(const Shape& sh) {
    const int E = sh.R * sh.epn;
    const std::vector<double> pop = routing::popularity(E, sh.sigma, sh.seed);
    std::vector<RankInput> in(size_t(sh.R));
    for (int r = 0; r < sh.R; ++r) {
        RankInput& ri = in[size_t(r)];
        ri.num_tokens = sh.partial ? (sh.S * (r + 1) + r) % (sh.S + 1) : sh.S;
        std::vector<int32_t> full(size_t(sh.S) * sh.K);
        routing::sample_topk(pop, sh.S, sh.K, sh.seed, r, full.data());
        ri.topk_idx.assign(full.begin(), full.begin() + int64_t(ri.num_tokens) * sh.K);
        const uint64_t stream = routing::mix64(sh.seed * 977 + uint64_t(r));
        for (int64_t i = 0; i < int64_t(ri.num_tokens) * sh.H; ++i)
            ri.x.push_back(float_to_bf16(float(int(routing::mix64(stream + uint64_t(i)) % 9) - 4)));
        static const float kWeights[] = {0.5f, 1.0f, 2.0f};
        for (int64_t i = 0; i < int64_t(ri.num_tokens) * sh.K; ++i)
            ri.weights.push_back(kWeights[routing::mix64(~stream + uint64_t(i)) % 3]);
    }
    return in;
}

struct RankOutput {
    std::vector<int32_t> alloc, slot_expert, cu_seqlens, entry_rank, entry_row;
    std::vector<uint16_t> recv_x;  // [NvS][H]
    std::vector<float> recv_w;     // [NvS]
    std::vector<uint16_t> out;     // [s][H]
    int num_groups = 0, num_recv_rows = 0;
    host::OpStats stats;
};

std::vector<RankOutput> run_mode(const Shape& sh, const Mode& m, const std::vector<RankInput>& in) {
    std::vector<RankOutput> outputs(static_cast<size_t>(sh.R));
    transport::LocalHostWorld world(sh.R, 30.0);
    const std::vector<std::string> errors = run_ranks(sh.R, [&](int rank) {
        // Any B and Q the layout accepts, without pools (the internal API's Buffer of a given view shape).
        const std::unique_ptr<Buffer> made = internal::make_buffer(config_of(sh, m, rank), world.transport(rank),
                                                                   m.planner, {m.num_slots, m.view_stride});
        Buffer& buffer = *made;
        if (m.planner == PlannerKind::kStatic) buffer.set_placement(m.placement);
        const RankInput& ri = in[size_t(rank)];
        RankOutput& o = outputs[size_t(rank)];
        const Layout& l = internal::layout(buffer);
        o.num_groups = l.num_groups();
        o.num_recv_rows = l.num_recv_rows;
        const Plan plan = buffer.plan(ri.topk_idx.data(), 4, ri.num_tokens);
        internal::set_op_stats(buffer, &o.stats);
        o.recv_x.assign(size_t(l.num_recv_rows) * sh.H, kCanaryX);
        o.recv_w.assign(size_t(l.num_recv_rows), -1.0f);
        buffer.dispatch(plan, ri.x.data(), ri.weights.data(), o.recv_x.data(), o.recv_w.data());
        // The identity expert: y = the dispatched rows, combined with their routing weights.
        o.out.assign(size_t(ri.num_tokens) * sh.H, kCanaryX);
        buffer.combine(plan, o.recv_x.data(), o.recv_w.data(), o.out.data());
        internal::set_op_stats(buffer, nullptr);
        buffer.check_status();
        auto copy = [](std::span<const int32_t> s) { return std::vector<int32_t>(s.begin(), s.end()); };
        o.alloc = copy(plan.alloc());
        for (int d = 0; d < sh.R; ++d) {
            for (int32_t v : plan.slot_expert(d)) o.slot_expert.push_back(v);
            for (int32_t v : plan.cu_seqlens(d)) o.cu_seqlens.push_back(v);
        }
        o.entry_rank = copy(plan.entry_ranks());
        o.entry_row = copy(plan.entry_rows());
    });
    EXPECT_EQ(testing::failures(errors), "");
    return outputs;
}

// The expert whose rows group g of rank d holds per the contract (layout.hpp), from the reference's group_of.
int reference_group_expert(const testing::ReferencePlan& ref, int d, int g) {
    for (int e = 0; e < ref.E; ++e)
        if (ref.group_of[size_t(d) * ref.E + e] == g) return e;
    return -1;
}

void check_mode(const Shape& sh, const Mode& m, const std::vector<RankInput>& in, const std::vector<RankOutput>& out,
                const std::vector<RankOutput>& training) {
    const int R = sh.R, E = R * sh.epn, K = sh.K, H = sh.H, epn = sh.epn;
    std::vector<int32_t> tpe(size_t(R) * E, 0);
    std::vector<std::vector<int32_t>> topk(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
        for (int32_t e : in[size_t(r)].topk_idx) ++tpe[size_t(r) * E + e];
        topk[size_t(r)] = in[size_t(r)].topk_idx;
    }
    const std::vector<int32_t>& alloc = out[0].alloc;
    const int B = m.num_slots < 0 ? epn : m.num_slots;
    if (m.planner == PlannerKind::kStatic) {
        ASSERT_EQ(alloc, static_alloc_of(R, E, B, tpe, m.placement));
    } else if (m.planner == PlannerKind::kOwner) {
        for (int d = 0; d < R; ++d) {
            for (int e = 0; e < E; ++e) {
                int32_t t = 0;
                for (int s = 0; s < R; ++s) t += tpe[size_t(s) * E + e];
                ASSERT_EQ(alloc[size_t(d) * E + e], e / epn == d ? t : 0) << "owner alloc[" << d << "][" << e << "]";
            }
        }
    } else if (m.planner == PlannerKind::kBalanced) {
        ASSERT_EQ(alloc, training[0].alloc) << "the allocation does not depend on B";
    } else {
        ASSERT_EQ(testing::alloc_violation(R, E, true, int64_t(sh.S) * K, tpe, alloc), "");
    }
    const bool placed = m.planner == PlannerKind::kStatic;
    const testing::ReferencePlan ref = testing::reference_plan(R, E, sh.align, alloc, topk, m.num_slots, m.view_stride,
                                                               placed ? &m.placement : nullptr);
    for (int r = 0; r < R; ++r) {
        ASSERT_EQ(out[size_t(r)].num_groups, ref.num_groups);
        ASSERT_EQ(out[size_t(r)].alloc, alloc) << "rank " << r;
        ASSERT_EQ(out[size_t(r)].slot_expert, ref.slot_expert) << "rank " << r;
        ASSERT_EQ(out[size_t(r)].cu_seqlens, ref.cu_seqlens) << "rank " << r;
        ASSERT_EQ(out[size_t(r)].entry_rank, ref.entry_rank[size_t(r)]) << "rank " << r;
        ASSERT_EQ(out[size_t(r)].entry_row, ref.entry_row[size_t(r)]) << "rank " << r;
    }
    // Every entry's row is in the group of its expert, holds its token's x and its weight; every other row of a group
    // is zero padding (weight 0); rows past the last group end are not touched.
    std::vector<std::vector<int>> writes(size_t(R), std::vector<int>(size_t(out[0].num_recv_rows), 0));
    for (int s = 0; s < R; ++s) {
        for (int t = 0; t < in[size_t(s)].num_tokens; ++t) {
            for (int k = 0; k < K; ++k) {
                const int i = t * K + k, e = topk[size_t(s)][size_t(i)];
                const int d = ref.entry_rank[size_t(s)][size_t(i)], row = ref.entry_row[size_t(s)][size_t(i)];
                const int32_t* cu = ref.cu_seqlens.data() + size_t(d) * ref.num_groups;
                int g = 0;
                while (cu[g] <= row) ++g;
                ASSERT_EQ(reference_group_expert(ref, d, g), e) << "source " << s << " entry " << i << " rank " << d;
                ++writes[size_t(d)][size_t(row)];
                const RankOutput& o = out[size_t(d)];
                ASSERT_EQ(0, std::memcmp(o.recv_x.data() + int64_t(row) * H, in[size_t(s)].x.data() + int64_t(t) * H,
                                         size_t(H) * 2))
                    << "recv_x rank " << d << " row " << row;
                ASSERT_EQ(bits_of(o.recv_w[size_t(row)]), bits_of(in[size_t(s)].weights[size_t(i)]));
            }
        }
    }
    for (int d = 0; d < R; ++d) {
        const int end = ref.cu_seqlens[size_t(d) * ref.num_groups + ref.num_groups - 1];
        for (int r = 0; r < out[0].num_recv_rows; ++r) {
            const RankOutput& o = out[size_t(d)];
            if (writes[size_t(d)][size_t(r)] == 1) continue;
            ASSERT_EQ(writes[size_t(d)][size_t(r)], 0) << "rank " << d << " row " << r << " written twice";
            const uint16_t want_x = r < end ? 0 : kCanaryX;
            for (int h = 0; h < H; ++h) ASSERT_EQ(o.recv_x[size_t(r) * H + h], want_x) << "rank " << d << " row " << r;
            ASSERT_EQ(bits_of(o.recv_w[size_t(r)]), bits_of(r < end ? 0.0f : -1.0f)) << "rank " << d << " row " << r;
        }
    }
    // Dedup: one partial per (source, token, destination), written once (each chain visited once).
    int64_t pairs = 0, written = 0, fanned = 0;
    for (int s = 0; s < R; ++s) {
        written += out[size_t(s)].stats.partials_written;
        fanned += out[size_t(s)].stats.rows_fanned_out;
        for (int t = 0; t < in[size_t(s)].num_tokens; ++t) {
            std::vector<char> seen(size_t(R), 0);
            for (int k = 0; k < K; ++k) {
                const int d = ref.entry_rank[size_t(s)][size_t(t * K + k)];
                pairs += !seen[size_t(d)];
                seen[size_t(d)] = 1;
            }
        }
    }
    ASSERT_EQ(written, pairs);
    int64_t entries = 0;
    for (int s = 0; s < R; ++s) entries += int64_t(in[size_t(s)].num_tokens) * K;
    ASSERT_EQ(fanned, entries) << "dispatch visits every real row once";
    // Combine: exactly sum_k w_k * x_t, the same bits as training mode.
    for (int s = 0; s < R; ++s) {
        const RankInput& ri = in[size_t(s)];
        for (int t = 0; t < ri.num_tokens; ++t) {
            for (int h = 0; h < H; ++h) {
                float want = 0.0f;
                for (int k = 0; k < K; ++k)
                    want += ri.weights[size_t(t * K + k)] * bf16_to_float(ri.x[size_t(t) * H + h]);
                ASSERT_EQ(out[size_t(s)].out[size_t(t) * H + h], float_to_bf16(want))
                    << "rank " << s << " token " << t << " elem " << h;
            }
        }
        ASSERT_EQ(out[size_t(s)].out, training[size_t(s)].out) << "rank " << s;
    }
}

std::string describe(const Shape& sh) {
    std::ostringstream os;
    os << "R=" << sh.R << " epn=" << sh.epn << " S=" << sh.S << " K=" << sh.K << " H=" << sh.H << " align=" << sh.align
       << " sigma=" << sh.sigma << " seed=" << sh.seed << " partial=" << sh.partial;
    return os.str();
}

// Ranks of a serving mode's plan that host more replicas than the mode's B slots.
int ranks_over_slots(const Shape& sh, const Mode& m, const std::vector<int32_t>& alloc) {
    const int E = sh.R * sh.epn;
    int over = 0;
    for (int d = 0; d < sh.R && m.num_slots >= 0; ++d) {
        int replicas = 0;
        for (int e = 0; e < E; ++e) replicas += e / sh.epn != d && alloc[size_t(d) * E + e] > 0;
        over += replicas > m.num_slots;
    }
    return over;
}

void run_shape(const Shape& sh, int& over_slots) {
    SCOPED_TRACE("repro: build/tests/flatep_host_tests --gtest_filter='ServingDataPlane.*'  case " + describe(sh));
    const std::vector<RankInput> in = make_inputs(sh);
    const std::vector<Mode> modes = modes_of(sh);
    const std::vector<RankOutput> training = run_mode(sh, modes[0], in);
    if (::testing::Test::HasFailure()) return;
    for (const Mode& m : modes) {
        SCOPED_TRACE("mode " + m.name);
        const std::vector<RankOutput> out = m.name == "training" ? training : run_mode(sh, m, in);
        if (::testing::Test::HasFailure()) return;
        check_mode(sh, m, in, out, training);
        if (m.planner != PlannerKind::kOwner && m.planner != PlannerKind::kStatic)
            over_slots += ranks_over_slots(sh, m, out[0].alloc);
        if (::testing::Test::HasFatalFailure()) return;
    }
}

// Skewed routing, so that destinations host more replicas than B; ragged ranks (some pass 0 tokens).
TEST(ServingDataPlane, SameOutputsAsTrainingAndRowsInTheirExpertsGroups) {
    const Shape shapes[] = {
        {4, 4, 12, 2, 8, 1, 2.5, 1, false}, {4, 4, 12, 3, 16, 4, 1.5, 2, true}, {2, 3, 9, 2, 8, 8, 3.0, 3, false},
        {3, 5, 7, 4, 8, 2, 2.0, 4, true},   {8, 2, 6, 2, 8, 1, 2.5, 5, false},  {1, 4, 5, 2, 8, 4, 1.0, 6, false},
        {4, 6, 16, 4, 8, 1, 3.0, 7, true},
    };
    int over_slots = 0;
    for (const Shape& sh : shapes) {
        run_shape(sh, over_slots);
        if (HasFatalFailure()) return;
    }
    EXPECT_GE(over_slots, 10);  // destinations with more replicas than B: their rows read weights in place
}

}  // namespace
}  // namespace flatep
