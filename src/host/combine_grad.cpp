#include "ops/combine_grad_args.hpp"

#include <cstring>

#include "common/bf16.hpp"
#include "host/group_rows.hpp"

namespace flatep::host {

namespace {

constexpr int kLanes = 32;
constexpr int kChunkElems = 8;  // one 16-byte chunk of bf16

// The kernel's warp dot (combine_grad_args.hpp): lane c % 32 accumulates chunk c, then the xor butterfly.
float lane_order_dot(const uint16_t* a, const uint16_t* b, int64_t hidden) {
    float lane[kLanes] = {};
    const int64_t num_chunks = hidden / kChunkElems;
    for (int64_t c = 0; c < num_chunks; ++c) {
        float& acc = lane[c % kLanes];
        for (int e = 0; e < kChunkElems; ++e) {
            const int64_t h = c * kChunkElems + e;
            acc = acc + bf16_to_float(a[h]) * bf16_to_float(b[h]);  // -ffp-contract=off: multiply, then add
        }
    }
    for (int offset = kLanes / 2; offset >= 1; offset /= 2) {
        float next[kLanes];
        for (int l = 0; l < kLanes; ++l) next[l] = lane[l] + lane[l ^ offset];
        std::memcpy(lane, next, sizeof(lane));
    }
    return lane[0];
}

}  // namespace

void run(const CombineGradArgs& a) {
    const Layout& l = a.layout;
    const int64_t H = l.hidden;
    auto zero_rows = [&](int32_t begin, int32_t end) {
        if (end <= begin) return;
        if (a.grad_y != nullptr) std::memset(a.grad_y + begin * H, 0, size_t(end - begin) * size_t(H) * 2);
        if (a.grad_weights != nullptr) {
            for (int32_t r = begin; r < end; ++r) a.grad_weights[r] = 0.0f;
        }
    };
    int32_t next = 0;  // first row not yet written
    for (int g = 0; g < l.num_groups(); ++g) {
        const GroupRows group = group_rows(l, a.plan, a.rank, g);
        zero_rows(next, group.start);
        for (int32_t r = group.start; r < group.real_end; ++r) {
            const uint16_t* row = a.rows + r * H;
            if (a.grad_y != nullptr) {
                const float w = a.weights[r];
                uint16_t* out = a.grad_y + r * H;
                for (int64_t h = 0; h < H; ++h) out[h] = float_to_bf16(bf16_to_float(row[h]) * w);
            }
            if (a.grad_weights != nullptr) a.grad_weights[r] = lane_order_dot(row, a.y + r * H, H);
        }
        next = group.real_end;  // rows up to the next group's start are this group's padding
    }
    zero_rows(next, l.num_recv_rows);
}

}  // namespace flatep::host
