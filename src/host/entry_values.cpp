#include "ops/entry_values_args.hpp"

#include "common/check.hpp"
#include "host/group_rows.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

void run(const EntryValuesArgs& a) {
    const Layout& l = a.layout;
    const PlanView& p = a.plan;
    const int num_tokens = plan_num_tokens(p);
    const SymmetricLayout sym = make_symmetric_layout(l);

    // Entry barrier: sources of the previous op may still read this rank's recv_w region.
    sync::host::barrier(a.sync, sync::kOpEntryValues);
    auto* own = region_at<float>(a.peers[a.rank], sym.recv_w_offset);
    for (int g = 0; g < l.num_groups(); ++g) {
        const GroupRows group = group_rows(l, p, a.rank, g);
        for (int32_t r = group.start; r < group.real_end; ++r) own[r] = a.row_values[r];
    }
    sync::host::barrier(a.sync, sync::kOpEntryValues);

    const int64_t num_entries = int64_t(num_tokens) * l.topk;
    for (int64_t i = 0; i < num_entries; ++i) {
        const int d = p.entry_rank[i];
        a.out[i] = d < 0 ? 0.0f : region_at<const float>(a.peers[d], sym.recv_w_offset)[p.entry_row[i]];
    }
}

}  // namespace flatep::host
