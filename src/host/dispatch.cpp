#include "host/dispatch.hpp"

#include <cstring>

#include "common/check.hpp"
#include "host/group_rows.hpp"
#include "transport/barrier_host.hpp"

namespace flatep::host {

void dispatch(const DispatchArgs& a, OpStats* stats) {
    const Layout& l = a.layout;
    const int K = l.topk, H = l.hidden;
    const PlanView& p = a.plan;
    const int num_tokens = p.header[kHeaderNumTokens];
    FLATEP_CHECK(num_tokens == 0 || a.x != nullptr, "dispatch: x is null");
    FLATEP_CHECK(a.recv_x != nullptr, "dispatch: recv_x is null");
    const SymmetricLayout sym = make_symmetric_layout(l);
    const size_t row_bytes = size_t(l.row_bytes());

    // The entry barrier keeps us from overwriting rows a destination may still be reading in its previous op.
    barrier(a.sync, kOpDispatch);

    // Source side: one row per (token, destination) at the chain head, one weight per entry.
    for (int t = 0; t < num_tokens; ++t) {
        const int32_t* ranks = p.entry_rank + int64_t(t) * K;
        const int32_t* rows = p.entry_row + int64_t(t) * K;
        for (int k = 0; k < K; ++k) {
            const int d = ranks[k];
            if (d < 0) continue;
            auto* peer_w = reinterpret_cast<float*>(a.peers[d] + sym.recv_w_offset);
            peer_w[rows[k]] = a.topk_weights != nullptr ? a.topk_weights[int64_t(t) * K + k] : 1.0f;
            bool seen = false;
            for (int k0 = 0; k0 < k && !seen; ++k0) seen = ranks[k0] == d;
            if (seen) continue;  // the row already crossed to d at the head of this chain
            uint8_t* peer_x = a.peers[d] + sym.recv_x_offset + int64_t(rows[k]) * row_bytes;
            std::memcpy(peer_x, a.x + int64_t(t) * H, row_bytes);
            if (stats != nullptr) {
                ++stats->rows_pushed;
                if (d != a.rank) ++stats->rows_pushed_remote;
            }
        }
    }
    barrier(a.sync, kOpDispatch);

    // Destination side: fan out from the chain heads, carry weights, zero padding.
    const auto* sym_x = reinterpret_cast<const uint16_t*>(a.peers[a.rank] + sym.recv_x_offset);
    const auto* sym_w = reinterpret_cast<const float*>(a.peers[a.rank] + sym.recv_w_offset);
    for (int g = 0; g < l.num_groups(); ++g) {
        const GroupRows group = group_rows(l, p, a.rank, g);
        for (int32_t r = group.start; r < group.real_end; ++r) {
            const uint16_t* src = sym_x + int64_t(p.row_head[r]) * H;
            uint16_t* dst = a.recv_x + int64_t(r) * H;
            if (dst != src) {
                std::memcpy(dst, src, row_bytes);
                if (stats != nullptr) ++stats->rows_fanned_out;
            }
            if (a.recv_w != nullptr) a.recv_w[r] = sym_w[r];
        }
        for (int32_t r = group.real_end; r < group.padded_end; ++r) {
            std::memset(a.recv_x + int64_t(r) * H, 0, row_bytes);
            if (a.recv_w != nullptr) a.recv_w[r] = 0.0f;
        }
    }
}

}  // namespace flatep::host
