// The plan kernels' sizes and splits (kernels/plan/plan_sizes.hpp, the host arithmetic of plan.cu), in the CPU build:
// the routing kernel's shared arrays hold a segment's entries, the workspace has a counts row for every segment any
// call (s <= S) reaches, its arrays are aligned, disjoint and inside its total, and the warps' ranges of a segment
// cover its entries once, in order.
// Run: build/tests/flatep_kernels_tests --gtest_filter='PlanSizes.*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>

#include "kernels/plan/plan_sizes.hpp"
#include "layout/layout.hpp"

namespace flatep::kernels {
namespace {

Layout layout_of(int S, int K, int E) {
    Layout l{};
    l.num_tokens = S;
    l.topk = K;
    l.num_experts = E;
    return l;
}

TEST(PlanSizes, SegmentsCoverEveryCallAndFitTheRoutingArrays) {
    std::mt19937_64 rng(62);
    for (int trial = 0; trial < 20000; ++trial) {
        const int S = 1 + int(rng() % (trial % 4 == 0 ? 64 : 300000));
        const int K = 1 + int(rng() % kMaxTopk);
        const int E = K + int(rng() % 1024);
        const Layout l = layout_of(S, K, E);
        const int seg = segment_tokens(l), nseg = num_segments(l);
        ASSERT_GE(seg, 1);
        ASSERT_LE(int64_t(seg) * K, kSegmentEntries) << "a segment's entries overflow route_kernel's arrays, K=" << K;
        ASSERT_GE(int64_t(nseg) * seg, S) << "S=" << S << " K=" << K << ": tokens past the last segment";
        ASSERT_LT(int64_t(nseg - 1) * seg, S) << "S=" << S << " K=" << K << ": an empty segment";
        const int s = 1 + int(rng() % S);  // a call's tokens: its segments are rows of the workspace
        ASSERT_LE((s + seg - 1) / seg, nseg);
        ASSERT_EQ(fused_counts(l, s), int64_t(s) * K <= kFusedEntries);

        const PlanWorkspaceSizes w = plan_workspace_sizes(l);
        for (int64_t at : {w.tpe_local, w.seg_counts, w.first_bad}) ASSERT_EQ(at % 64, 0);
        ASSERT_EQ(w.tpe_local, 0);
        ASSERT_LE(w.tpe_local + E, w.seg_counts);
        ASSERT_LE(w.seg_counts + int64_t(nseg) * E, w.first_bad) << "the segments' counts overlap first_bad";
        ASSERT_LE(w.first_bad + 2, w.total) << "first_bad (8 bytes) past the workspace";
    }
}

TEST(PlanSizes, WarpRangesCoverASegmentOnceInOrder) {
    std::mt19937_64 rng(6203);
    for (int trial = 0; trial < 3000; ++trial) {
        const int S = 1 + int(rng() % 5000);
        const int K = 1 + int(rng() % kMaxTopk);
        const Layout l = layout_of(S, K, 64);
        const int seg = segment_tokens(l);
        const int s = 1 + int(rng() % S);
        const int warps = 1 + int(rng() % 16);
        for (int b = 0; b * int64_t(seg) < s; ++b) {
            const int64_t t1 = std::min<int64_t>(int64_t(b + 1) * seg, s);
            int64_t at = int64_t(b) * seg * K;
            for (int w = 0; w < warps; ++w) {
                const WarpRange r = warp_range(l, seg, s, b, w, warps);
                ASSERT_EQ(r.begin, at) << "S=" << S << " K=" << K << " s=" << s << " segment " << b << " warp " << w;
                ASSERT_GE(r.end, r.begin);
                ASSERT_LE(r.end - r.begin, (t1 * K - int64_t(b) * seg * K + warps - 1) / warps);
                at = r.end;
            }
            ASSERT_EQ(at, t1 * K) << "S=" << S << " K=" << K << " s=" << s << " segment " << b;
        }
    }
}

}  // namespace
}  // namespace flatep::kernels
