#include "ops/dispatch_args.hpp"

#include <cstring>

#include "common/check.hpp"
#include "host/dispatch.hpp"
#include "host/op_stats.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

void run(const DispatchArgs& a, OpStats* stats) {
    const Layout& l = a.layout;
    const int H = l.hidden;
    const PlanView& p = a.plan;
    const int num_tokens = plan_num_tokens(p);
    const SymmetricLayout sym = make_symmetric_layout(l);
    const size_t row_bytes = size_t(l.row_bytes());

    // The entry barrier keeps us from overwriting rows a destination may still be reading in its previous op
    // (plan_ordered: this step's plan op met every rank after those reads).
    if (!a.plan_ordered) sync::host::barrier(a.sync, sync::kOpDispatch);

    // Source side: one row per (token, destination) at the chain head, one weight per entry.
    push_token_rows(l, p, num_tokens, a.topk_weights, a.peers, sym.recv_w_offset, [&](int t, int d, int32_t row) {
        std::memcpy(a.peers[d] + sym.recv_x_offset + int64_t(row) * row_bytes, a.x + int64_t(t) * H, row_bytes);
        if (stats != nullptr) {
            ++stats->rows_pushed;
            if (d != a.rank) ++stats->rows_pushed_remote;
        }
    });
    sync::host::barrier(a.sync, a.plan_ordered ? sync::kOpDispatchOrdered : sync::kOpDispatch);

    // Destination side: fan out from the chain heads, carry weights, zero padding.
    const auto* sym_x = region_at<const uint16_t>(a.peers[a.rank], sym.recv_x_offset);
    const auto* sym_w = region_at<const float>(a.peers[a.rank], sym.recv_w_offset);
    for_each_recv_row(
        l, p, a.rank,
        [&](int32_t r, int32_t head) {
            const uint16_t* src = sym_x + int64_t(head) * H;
            uint16_t* dst = a.recv_x + int64_t(r) * H;
            if (dst != src) {
                std::memcpy(dst, src, row_bytes);
                if (stats != nullptr) ++stats->rows_fanned_out;
            }
            if (a.recv_w != nullptr) a.recv_w[r] = sym_w[r];
        },
        [&](int32_t r) {
            std::memset(a.recv_x + int64_t(r) * H, 0, row_bytes);
            if (a.recv_w != nullptr) a.recv_w[r] = 0.0f;
        });
}

}  // namespace flatep::host
