#include "ops/dispatch_fp8_args.hpp"

#include <cstring>

#include "common/check.hpp"
#include "common/fp8.hpp"
#include "host/dispatch.hpp"
#include "host/op_stats.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

void run(const DispatchFp8Args& a, OpStats* stats) {
    const PlanView& p = a.plan;
    const int num_tokens = plan_num_tokens(p);
    const Layout& l = a.layout;
    const int H = l.hidden;
    const SymmetricLayout sym = make_symmetric_layout(l);
    const int num_blocks = fp8_num_blocks(l);
    const int64_t scales_offset = fp8_recv_scales_offset(l, sym);
    const size_t scale_bytes = size_t(num_blocks) * sizeof(float);

    // Destinations are done reading their previous contents (plan_ordered: this step's plan op met every rank after).
    if (!a.plan_ordered) sync::host::barrier(a.sync, sync::kOpDispatchFp8);

    // Source side: one row per (token, destination) at the chain head, one weight per entry. bf16 rows are quantised
    // once, into the first destination's row, and copied from there to the others.
    int quantised_token = -1;
    const uint8_t* row_x = nullptr;
    const float* row_scales = nullptr;
    push_token_rows(l, p, num_tokens, a.topk_weights, a.peers, sym.recv_w_offset, [&](int t, int d, int32_t row) {
        uint8_t* dst_x = a.peers[d] + fp8_recv_x_offset(sym) + int64_t(row) * H;
        auto* dst_scales = region_at<float>(a.peers[d], scales_offset) + int64_t(row) * num_blocks;
        if (a.x_fp8 != nullptr) {
            row_x = a.x_fp8 + int64_t(t) * H;
            row_scales = a.x_scales + int64_t(t) * num_blocks;
        } else if (quantised_token != t) {
            fp8::quantize_row(a.x_bf16 + int64_t(t) * H, num_blocks, a.scale_mode, dst_x, dst_scales);
            quantised_token = t;
            row_x = dst_x;
            row_scales = dst_scales;
        }
        if (row_x != dst_x) {
            std::memcpy(dst_x, row_x, size_t(H));
            std::memcpy(dst_scales, row_scales, scale_bytes);
        }
        if (stats != nullptr) {
            ++stats->rows_pushed;
            if (d != a.rank) ++stats->rows_pushed_remote;
        }
    });
    // Every source's rows, scales and weights have landed.
    sync::host::barrier(a.sync, a.plan_ordered ? sync::kOpDispatchFp8Ordered : sync::kOpDispatchFp8);

    // Destination side: fan out from the chain heads, carry weights, zero padding.
    const uint8_t* sym_x = a.peers[a.rank] + fp8_recv_x_offset(sym);
    const auto* sym_scales = region_at<const float>(a.peers[a.rank], scales_offset);
    const auto* sym_w = region_at<const float>(a.peers[a.rank], sym.recv_w_offset);
    for_each_recv_row(
        l, p, a.rank,
        [&](int32_t r, int32_t head) {
            uint8_t* dst_x = a.recv_x + int64_t(r) * H;
            float* dst_scales = a.recv_scales + int64_t(r) * num_blocks;
            if (dst_x != sym_x + int64_t(head) * H) {
                std::memcpy(dst_x, sym_x + int64_t(head) * H, size_t(H));
                if (stats != nullptr) ++stats->rows_fanned_out;
            }
            if (dst_scales != sym_scales + int64_t(head) * num_blocks) {
                std::memcpy(dst_scales, sym_scales + int64_t(head) * num_blocks, scale_bytes);
            }
            if (a.recv_w != nullptr) a.recv_w[r] = sym_w[r];
        },
        [&](int32_t r) {
            std::memset(a.recv_x + int64_t(r) * H, 0, size_t(H));
            std::memset(a.recv_scales + int64_t(r) * num_blocks, 0, scale_bytes);
            if (a.recv_w != nullptr) a.recv_w[r] = 0.0f;
        });
}

}  // namespace flatep::host
