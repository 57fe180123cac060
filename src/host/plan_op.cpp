#include "host/plan_op.hpp"

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/check.hpp"
#include "host/group_rows.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

namespace {
int64_t read_expert(const void* topk_idx, int index_bytes, int64_t flat) {
    return index_bytes == 8 ? static_cast<const int64_t*>(topk_idx)[flat] : static_cast<const int32_t*>(topk_idx)[flat];
}

int32_t clamp_to_int32(int64_t value) {
    return int32_t(value < INT32_MIN ? INT32_MIN : (value > INT32_MAX ? INT32_MAX : value));
}
}  // namespace

void plan_counts_op(const PlanArgs& a) {
    const Layout& l = a.layout;
    const int R = l.num_ranks, E = l.num_experts, K = l.topk;
    const SymmetricLayout sym = make_symmetric_layout(l);
    const PlanView& p = a.plan;

    // 1. Histogram.
    std::vector<int32_t> counts(E, 0);
    const int64_t num_entries = int64_t(a.num_tokens) * K;
    for (int64_t i = 0; i < num_entries; ++i) {
        const int64_t expert = read_expert(a.topk_idx, a.index_bytes, i);
        if (expert < 0 || expert >= E) {
            sync::host::record_status(a.sync.status, sync::kStatusBadExpert, int32_t(i), clamp_to_int32(expert), -1);
            continue;
        }
        ++counts[expert];
    }

    // 2. All-gather of the counts. The entry barrier keeps us from overwriting tpe_all / staging rows that a peer
    // may still be reading in its previous plan op.
    sync::host::barrier(a.sync, sync::kOpPlan);
    for (int d = 0; d < R; ++d) {
        auto* row = region_at<int32_t>(a.peers[d], sym.tpe_all_offset) + int64_t(a.rank) * E;
        std::memcpy(row, counts.data(), sizeof(int32_t) * E);
    }
    sync::host::barrier(a.sync, sync::kOpPlan);

    std::memcpy(p.tpe_all, a.peers[a.rank] + sym.tpe_all_offset, sizeof(int32_t) * int64_t(R) * E);
}

void plan_routes_op(const PlanArgs& a) {
    const Layout& l = a.layout;
    const int K = l.topk;
    const SymmetricLayout sym = make_symmetric_layout(l);
    const PlanView& p = a.plan;

    // 4. Chains: entries of token t going to d, in ascending k.
    for (int t = 0; t < a.num_tokens; ++t)
        push_token_chains(sym, a.peers, p.entry_rank + int64_t(t) * K, p.entry_row + int64_t(t) * K, K);
    sync::host::barrier(a.sync, sync::kOpPlan);

    // 5. Copy the staging of the real rows; -1 for padding and rows past the last group.
    const auto* head = region_at<const int32_t>(a.peers[a.rank], sym.row_head_offset);
    const auto* next = region_at<const int32_t>(a.peers[a.rank], sym.row_next_offset);
    for (int r = 0; r < l.num_recv_rows; ++r) {
        p.row_head[r] = -1;
        p.row_next[r] = -1;
    }
    for (int g = 0; g < l.num_groups(); ++g) {
        const GroupRows group = group_rows(l, p, a.rank, g);
        const int32_t size = group.real_end - group.start;
        if (size <= 0) continue;
        std::memcpy(p.row_head + group.start, head + group.start, sizeof(int32_t) * size);
        std::memcpy(p.row_next + group.start, next + group.start, sizeof(int32_t) * size);
    }

    // 6. Header.
    p.header[kHeaderNumTokens] = a.num_tokens;
    p.header[kHeaderPlanner] = int32_t(a.planner);
}

}  // namespace flatep::host
