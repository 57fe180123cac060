// Host and device, plain C++ (no device code, so a test without a GPU includes it): the plan kernels' arithmetic
// that sizes their workspace and splits their work (kernels/plan/plan.cu applies it; tests/unit/kernels holds it to
// its contract in the CPU build): routing segments, the workspace's arrays, which calls count in one block, and the
// warps' shares of a segment.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "layout/layout.hpp"

namespace flatep::kernels {

inline constexpr int kSegmentEntries = 2048;  // entries (whole tokens) per routing segment, at most
inline constexpr int kFusedEntries = 8192;    // a call of at most this many entries counts in one block (counts_kernel)

// Tokens of one routing segment: as many whole tokens as kSegmentEntries holds (at least one).
FLATEP_HD int segment_tokens(const Layout& l) { return l.topk >= kSegmentEntries ? 1 : kSegmentEntries / l.topk; }
// Segments of the layout's S tokens: every token t < S of any call is in segment t / segment_tokens < this.
FLATEP_HD int num_segments(const Layout& l) { return ceil_div(l.num_tokens, segment_tokens(l)); }

// Whether a call of num_tokens tokens counts its histogram and gathers the counts in one block (counts_kernel).
FLATEP_HD bool fused_counts(const Layout& l, int num_tokens) { return int64_t(num_tokens) * l.topk <= kFusedEntries; }

// The workspace (int32 words, every array 64-word aligned): this rank's histogram [E], every segment's [E] counts,
// and the first bad expert id (one 8-byte word).
struct PlanWorkspaceSizes {
    int64_t tpe_local, seg_counts, first_bad, total;
};

inline PlanWorkspaceSizes plan_workspace_sizes(const Layout& l) {
    Carver c{64};
    PlanWorkspaceSizes s{};
    s.tpe_local = c.take(l.num_experts);
    s.seg_counts = c.take(int64_t(num_segments(l)) * l.num_experts);
    s.first_bad = c.take(2);
    s.total = c.at;
    return s;
}

// Entries of routing segment b handled by warp w of num_warps: [begin, end) in flat (t*K+k) order. The segment's
// entries are split evenly over the warps (a short last segment, e.g. a decode-sized call's only one, keeps every
// warp busy).
struct WarpRange {
    int64_t begin, end;
};
FLATEP_HD WarpRange warp_range(const Layout& l, int seg_tokens, int num_tokens, int b, int w, int num_warps) {
    const int64_t t0 = int64_t(b) * seg_tokens;
    const int64_t t1 = min_of<int64_t>(t0 + seg_tokens, num_tokens);
    const int64_t e0 = t0 * l.topk, e1 = t1 > t0 ? t1 * l.topk : e0;
    const int64_t per_warp = ceil_div<int64_t>(e1 - e0, num_warps);
    const int64_t begin = min_of<int64_t>(e0 + w * per_warp, e1);
    return WarpRange{begin, min_of<int64_t>(begin + per_warp, e1)};
}

}  // namespace flatep::kernels
