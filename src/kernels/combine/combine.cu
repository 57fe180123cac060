#include "common/bf16.hpp"
#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/groups.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "ops/combine_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // 16-byte words per lane per step

FLATEP_DEVICE void unpack_add(float (&acc)[8], const uint4& v) {
    float x[8];
    unpack_bf16x8(x, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] + x[e];
}

FLATEP_DEVICE void unpack_fma(float (&acc)[8], float weight, const uint4& v) {
    float x[8];
    unpack_bf16x8(x, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = fmaf(weight, x[e], acc[e]);
}

// One word of one row into its sums: acc += weight * v (kWeighted, one fma per element), else acc += v.
template <bool kWeighted>
FLATEP_DEVICE void add_word(float (&acc)[8], float weight, const uint4& v) {
    if constexpr (kWeighted) {
        unpack_fma(acc, weight, v);
    } else {
        unpack_add(acc, v);
    }
}

FLATEP_DEVICE void zero_sums(float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[u][c] = 0.0f;
}

// How many warps share each head of the partial sum (each takes every slices-th step of the head's row): when the call
// has fewer than kPartialShare rows per warp (a decode-sized call), enough that each group of warps sums about
// kPartialShare rows, so the few heads a warp draws do not leave the busiest warp with several whole rows while others
// idle; 1 for a full call.
// rows_estimate: the call's entries on this rank (s*K).
constexpr int64_t kPartialShare = 16;
FLATEP_DEVICE int partial_slices(int64_t rows_estimate, int64_t num_warps, int64_t num_steps) {
    const int64_t per_warp = rows_estimate / (num_warps > 0 ? num_warps : 1);
    const int64_t want = per_warp >= kPartialShare ? 1 : (per_warp > 0 ? kPartialShare / per_warp : kPartialShare);
    return int(want < num_steps ? want : num_steps);
}

// Destination side: each chain head among this rank's real rows (row_head[h] == h; padding rows hold -1) is summed by
// one group of `slices` warps, warp j of the group taking steps j, j + slices, ... The groups' rows are those at
// positions v = group, group + num_groups, ... of the spread_row order; lane j reads the head, the next row and the
// weight of position base + j*num_groups's row, so finding the heads costs one read per 32 rows, and a chain of one
// row (most of them) needs no further read. Longer chains (one row per entry of the token on this rank, at most
// K <= 32) are walked once into the lanes (lane m: member m and its weight), and each step then loads two members'
// words at a time; the sums still add the members in chain order, so the result is the same.
template <bool kWeighted>
__global__ void __launch_bounds__(kThreads)
    combine_partial_kernel(Layout l, int rank, PlanView p, const uint16_t* y, const float* weights, uint16_t* partial) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    const int64_t n16 = l.row_bytes() / 16;
    constexpr int64_t kStep = 32 * kUnroll;
    const int want = partial_slices(int64_t(plan_num_tokens(p)) * l.topk, num_warps, ceil_div(n16, kStep));
    const int slices = want < num_warps ? want : int(num_warps);
    const int64_t num_groups = num_warps / slices, group = warp / slices, slice = warp % slices;
    if (group >= num_groups) return;  // the grid's last warps, when slices does not divide it (whole warps leave)
    const int32_t end = rows_end(l, p, rank);
    const uint4* rows = reinterpret_cast<const uint4*>(y);
    for (int64_t base = group; base < end; base += 32 * num_groups) {
        const int64_t v = base + int64_t(lane) * num_groups;
        const int64_t mine = v < end ? spread_row(v, end) : -1;
        const bool is_head = mine >= 0 && p.row_head[mine] == mine;
        const int32_t mine_next = is_head ? p.row_next[mine] : -1;
        const float mine_weight = kWeighted && is_head ? weights[mine] : 1.0f;
        for (unsigned heads = __ballot_sync(kFull, is_head); heads != 0; heads &= heads - 1) {
            const int j = __ffs(heads) - 1;
            const int64_t h = __shfl_sync(kFull, mine, j);
            const int32_t next = __shfl_sync(kFull, mine_next, j);
            const float head_weight = __shfl_sync(kFull, mine_weight, j);
            int32_t member = lane == 0 ? int32_t(h) : -1;
            float weight = lane == 0 ? head_weight : 1.0f;
            int len = 1;
            for (int32_t r = next; r >= 0 && len < 32; r = p.row_next[r], ++len)
                if (lane == len) member = r;
            if (kWeighted && lane >= 1 && lane < len) weight = weights[member];
            uint4* out = reinterpret_cast<uint4*>(partial) + h * n16;
            for (int64_t i0 = slice * kStep; i0 < n16; i0 += slices * kStep) {
                float acc[kUnroll][8];
                zero_sums(acc);
                int m = 0;
                for (; m + 1 < len; m += 2) {
                    const int64_t ra = __shfl_sync(kFull, member, m), rb = __shfl_sync(kFull, member, m + 1);
                    const float wa = __shfl_sync(kFull, weight, m), wb = __shfl_sync(kFull, weight, m + 1);
                    uint4 va[kUnroll], vb[kUnroll];
                    warp_load_step(va, rows + ra * n16, i0, n16, lane);
                    warp_load_step(vb, rows + rb * n16, i0, n16, lane);
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {  // per element: member m, then m + 1 (chain order)
                        add_word<kWeighted>(acc[u], wa, va[u]);
                        add_word<kWeighted>(acc[u], wb, vb[u]);
                    }
                }
                if (m < len) {
                    const int64_t ra = __shfl_sync(kFull, member, m);
                    const float wa = __shfl_sync(kFull, weight, m);
                    uint4 va[kUnroll];
                    warp_load_step(va, rows + ra * n16, i0, n16, lane);
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) add_word<kWeighted>(acc[u], wa, va[u]);
                }
                warp_store_bf16x8_step(out, acc, i0, n16, lane);
            }
        }
    }
}

// Source side: warp per token (row_slices warps per token when the call has fewer tokens than the grid has warps);
// one pull per destination rank holding entries of the token, ascending rank.
__global__ void __launch_bounds__(kThreads)
    combine_pull_kernel(Layout l, PlanView p, SymmetricLayout sym, PeerPointers peers, uint16_t* out_x) {
    __shared__ const uint4* srcs_s[kWarps][kMaxTopk];
    const int lane = threadIdx.x % 32, warp_in_block = threadIdx.x / 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    const int K = l.topk;
    const int num_tokens = plan_num_tokens(p);
    const int64_t n16 = l.row_bytes() / 16;
    const uint4** srcs = srcs_s[warp_in_block];
    constexpr int64_t kStep = 32 * kUnroll;
    const int num_slices = row_slices(num_tokens, num_warps, ceil_div(n16, kStep));
    for (int64_t item = warp; item < int64_t(num_tokens) * num_slices; item += num_warps) {
        const int64_t t = item / num_slices;
        const int64_t first_step = (item % num_slices) * kStep;
        int d = -1, row = -1;
        if (lane < K) {
            d = p.entry_rank[t * K + lane];
            row = p.entry_row[t * K + lane];
        }
        const unsigned same = __match_any_sync(kFull, (lane < K && d >= 0) ? d : -1 - lane);
        const bool head = lane < K && d >= 0 && __ffs(same) - 1 == lane;
        const unsigned heads = __ballot_sync(kFull, head);
        // Rank of this head among the heads in ascending destination rank.
        int order = 0;
        for (unsigned rest = heads; rest != 0; rest &= rest - 1) {
            const int k = __ffs(rest) - 1;
            const int dk = __shfl_sync(kFull, d, k);
            if (head && (dk < d)) ++order;
        }
        if (head) {
            srcs[order] = region_at<const uint4>(peers.ptr[d], sym.partial_offset) + int64_t(row) * n16;
        }
        __syncwarp();
        const int num_src = __popc(heads);
        uint4* dst = reinterpret_cast<uint4*>(out_x) + t * n16;
        for (int64_t i0 = first_step; i0 < n16; i0 += num_slices * kStep) {
            float acc[kUnroll][8];
            zero_sums(acc);
            for (int s = 0; s < num_src; ++s) {
                uint4 v[kUnroll];
                warp_load_step(v, srcs[s], i0, n16, lane);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) unpack_add(acc[u], v[u]);
            }
            warp_store_bf16x8_step(dst, acc, i0, n16, lane);
        }
        __syncwarp();
    }
}

}  // namespace

void launch(const CombineArgs& a, cudaStream_t stream, int num_sms) {
    const Layout& l = a.layout;
    const SymmetricLayout sym = make_symmetric_layout(l);
    const PeerPointers peers = per_rank("combine", a.peers, l.num_ranks);
    auto* partial = region_at<uint16_t>(a.peers[a.rank], sym.partial_offset);
    // Sources are done pulling the previous partials (plan_ordered: this step's plan and dispatch met every rank
    // after).
    if (!a.plan_ordered) launch_barrier(a.sync, sync::kOpCombine, stream);
    const int part_blocks = grid_blocks(num_sms, ceil_div(l.num_recv_rows, kWarps), 4);
    if (a.weights != nullptr) {
        combine_partial_kernel<true><<<part_blocks, kThreads, 0, stream>>>(l, a.rank, a.plan, a.y, a.weights, partial);
    } else {
        combine_partial_kernel<false><<<part_blocks, kThreads, 0, stream>>>(l, a.rank, a.plan, a.y, nullptr, partial);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
    launch_barrier(a.sync, a.plan_ordered ? sync::kOpCombineOrdered : sync::kOpCombine, stream);  // every partial
    const int pull_blocks = token_blocks(num_sms, l.num_tokens, kWarps);
    combine_pull_kernel<<<pull_blocks, kThreads, 0, stream>>>(l, a.plan, sym, peers, a.out);
    FLATEP_CUDA_CHECK_LAUNCH();
}

FLATEP_PRELOAD_KERNELS(combine_partial_kernel<true>, combine_partial_kernel<false>, combine_pull_kernel);

}  // namespace flatep::kernels
