#include "ops/combine_args.hpp"

#include <cmath>
#include <vector>

#include "common/bf16.hpp"
#include "common/check.hpp"
#include "host/group_rows.hpp"
#include "host/op_stats.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

void run(const CombineArgs& a, OpStats* stats) {
    const Layout& l = a.layout;
    const int K = l.topk, H = l.hidden;
    const PlanView& p = a.plan;
    const int num_tokens = plan_num_tokens(p);
    const SymmetricLayout sym = make_symmetric_layout(l);
    std::vector<float> acc(H);

    // The entry barrier keeps us from overwriting partials a source may still be pulling in its previous combine
    // (plan_ordered: this step's plan and dispatch met every rank after that combine).
    if (!a.plan_ordered) sync::host::barrier(a.sync, sync::kOpCombine);

    // Destination side: one fp32 partial per chain, terms in ascending k, rounded to bf16.
    auto* partial = region_at<uint16_t>(a.peers[a.rank], sym.partial_offset);
    for (int g = 0; g < l.num_groups(); ++g) {
        const GroupRows group = group_rows(l, p, a.rank, g);
        for (int32_t h = group.start; h < group.real_end; ++h) {
            if (p.row_head[h] != h) continue;  // not a chain head
            for (int i = 0; i < H; ++i) acc[i] = 0.0f;
            for (int32_t r = h; r >= 0; r = p.row_next[r]) {
                const uint16_t* y_row = a.y + int64_t(r) * H;
                if (a.weights != nullptr) {
                    const float w = a.weights[r];
                    for (int i = 0; i < H; ++i) acc[i] = std::fma(w, bf16_to_float(y_row[i]), acc[i]);
                } else {
                    for (int i = 0; i < H; ++i) acc[i] = acc[i] + bf16_to_float(y_row[i]);
                }
            }
            uint16_t* out_row = partial + int64_t(h) * H;
            for (int i = 0; i < H; ++i) out_row[i] = float_to_bf16(acc[i]);
            if (stats != nullptr) ++stats->partials_written;
        }
    }
    sync::host::barrier(a.sync, a.plan_ordered ? sync::kOpCombineOrdered : sync::kOpCombine);

    // Source side: pull one partial per destination, add in ascending destination rank, round once.
    for (int t = 0; t < num_tokens; ++t) {
        const int32_t* ranks = p.entry_rank + int64_t(t) * K;
        const int32_t* rows = p.entry_row + int64_t(t) * K;
        for (int i = 0; i < H; ++i) acc[i] = 0.0f;
        for (int d = 0; d < l.num_ranks; ++d) {
            int k = 0;
            while (k < K && ranks[k] != d) ++k;
            if (k == K) continue;  // no entry of t on d
            const auto* peer_partial = region_at<const uint16_t>(a.peers[d], sym.partial_offset) + int64_t(rows[k]) * H;
            for (int i = 0; i < H; ++i) acc[i] += bf16_to_float(peer_partial[i]);
            if (stats != nullptr) {
                ++stats->partials_pulled;
                if (d != a.rank) ++stats->partials_pulled_remote;
            }
        }
        uint16_t* out_row = a.out + int64_t(t) * H;
        for (int i = 0; i < H; ++i) out_row[i] = float_to_bf16(acc[i]);
    }
}

}  // namespace flatep::host
