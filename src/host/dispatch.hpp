// The source and destination sides the CPU twins of dispatch and dispatch_fp8 share (design §3, §5; the twins are
// declared next to their Args: ops/dispatch_args.hpp, ops/dispatch_fp8_args.hpp).
#pragma once

#include <cstdint>

#include "host/group_rows.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace flatep::host {

// The source side both dispatches share: for every token t < num_tokens and entry k with a destination d, the
// entry's weight (1 when topk_weights is null) into d's recv_w (at recv_w_offset of its symmetric base) at the
// entry's row, and push(t, d, row) once per (token, destination), for the chain head (the first k with d).
template <typename Push>
void push_token_rows(const Layout& l, const PlanView& p, int num_tokens, const float* topk_weights,
                     uint8_t* const* peers, int64_t recv_w_offset, Push&& push) {
    const int K = l.topk;
    for (int t = 0; t < num_tokens; ++t) {
        const int32_t* ranks = p.entry_rank + int64_t(t) * K;
        const int32_t* rows = p.entry_row + int64_t(t) * K;
        for (int k = 0; k < K; ++k) {
            const int d = ranks[k];
            if (d < 0) continue;
            region_at<float>(peers[d], recv_w_offset)[rows[k]] =
                topk_weights != nullptr ? topk_weights[int64_t(t) * K + k] : 1.0f;
            bool seen = false;
            for (int k0 = 0; k0 < k && !seen; ++k0) seen = ranks[k0] == d;
            if (!seen) push(t, d, rows[k]);  // else the row already crossed to d at the head of this chain
        }
    }
}

// The destination side both dispatches share: real(r, head) for every real row r of `rank` (head: its chain head),
// padding(r) for every padding row; rows past the last group end are not visited.
template <typename Real, typename Padding>
void for_each_recv_row(const Layout& l, const PlanView& p, int rank, Real&& real, Padding&& padding) {
    for (int g = 0; g < l.num_groups(); ++g) {
        const GroupRows group = group_rows(l, p, rank, g);
        for (int32_t r = group.start; r < group.real_end; ++r) real(r, p.row_head[r]);
        for (int32_t r = group.real_end; r < group.padded_end; ++r) padding(r);
    }
}

}  // namespace flatep::host
