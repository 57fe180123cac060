// The plan kernels' splits (kernels/plan/plan_sizes.hpp) at their edges: a segment holds at least one whole token
// even when one token has more entries than a segment (topk >= kSegmentEntries: only a direct caller's Layout, the
// Config caps K at 32), and a segment past a short call's last token gives every warp an empty range at the
// segment's start (the kernel launches a grid for S tokens; a call may pass fewer).
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/plan/plan_sizes.hpp"
#include "layout/layout.hpp"

namespace flatep::kernels {
namespace {

Layout with_topk(int K) {
    Layout l{};
    l.num_tokens = 4096;
    l.topk = K;
    l.num_experts = 64;
    return l;
}

TEST(PlanSizesEdges, ATokenWiderThanASegmentIsASegmentOfItsOwn) {
    EXPECT_EQ(segment_tokens(with_topk(32)), kSegmentEntries / 32);
    EXPECT_EQ(segment_tokens(with_topk(kSegmentEntries - 1)), 1);
    EXPECT_EQ(segment_tokens(with_topk(kSegmentEntries)), 1);
    EXPECT_EQ(segment_tokens(with_topk(3 * kSegmentEntries)), 1);
    EXPECT_EQ(num_segments(with_topk(kSegmentEntries)), 4096);
}

TEST(PlanSizesEdges, ASegmentPastTheCallsTokensGivesEveryWarpAnEmptyRange) {
    const Layout l = with_topk(4);
    const int seg = segment_tokens(l);  // 512 tokens
    for (int w = 0; w < 4; ++w) {
        const WarpRange r = warp_range(l, seg, 10, 1, w, 4);  // segment 1 starts at token 512 > 10
        EXPECT_EQ(r.begin, int64_t(seg) * 4) << "warp " << w;
        EXPECT_EQ(r.end, int64_t(seg) * 4) << "warp " << w;
    }
    const WarpRange first = warp_range(l, seg, 10, 0, 3, 4);  // segment 0: 40 entries, 10 a warp
    EXPECT_EQ(first.begin, 30);
    EXPECT_EQ(first.end, 40);
}

}  // namespace
}  // namespace flatep::kernels
