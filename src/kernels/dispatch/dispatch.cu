#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/groups.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/dispatch/token_entries.cuh"
#include "ops/dispatch_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 7;  // 16-byte words in flight per lane: 7*32*16 = 3.5 KiB per warp (a 7168-wide row: 4 steps)

// Source side: warp per token (row_slices warps per token when the call has fewer tokens than the grid has warps).
// Lanes k < K hold entry k; the first lane of each destination rank (ascending k) is the chain head, whose row
// receives the token's row; every entry writes its weight (the token's first slice).
__global__ void __launch_bounds__(kThreads) dispatch_push_kernel(Layout l, const uint16_t* x, const float* topk_weights,
                                                                 PlanView p, SymmetricLayout sym, PeerPointers peers) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    const int K = l.topk;
    const int num_tokens = plan_num_tokens(p);
    const int64_t n16 = l.row_bytes() / 16;
    constexpr int64_t kStep = 32 * kUnroll;
    const int num_slices = row_slices(num_tokens, num_warps, ceil_div(n16, kStep));
    for (int64_t item = warp; item < int64_t(num_tokens) * num_slices; item += num_warps) {
        const int64_t t = item / num_slices;
        const int64_t slice = item % num_slices;
        const uint4* src = reinterpret_cast<const uint4*>(x) + t * n16;
        uint4 v[kUnroll];
        warp_load_step(v, src, slice * kStep, n16, lane);  // the first step is read along with the token's entries
        const TokenEntries entries = token_entries(p, K, t, topk_weights, peers, sym.recv_w_offset, lane, slice == 0);
        if (entries.heads == 0) continue;
        for (int64_t i0 = slice * kStep; i0 < n16; i0 += num_slices * kStep) {
            if (i0 != slice * kStep) warp_load_step(v, src, i0, n16, lane);
            for (unsigned rest = entries.heads; rest != 0; rest &= rest - 1) {
                int dk, rowk;
                head_target(entries, __ffs(rest) - 1, &dk, &rowk);
                warp_store_step(region_at<uint4>(peers.ptr[dk], sym.recv_x_offset) + int64_t(rowk) * n16, v, i0, n16,
                                lane);
            }
        }
    }
}

// Destination side: warp per row of this rank (real: row_head[r] >= 0; padding: -1, below the last group's end), the
// rows at positions v = warp, warp + num_warps, ... of the spread_row order. Lane j reads the head, weight and mark of
// position base + j*num_warps's row and writes its recv_w and mark, so a row that needs no copy or zeroing costs a
// lane's reads, not a warp's walk. marks: the region's row marks (1: the region's row may be nonzero); a padding row
// of the region (recv_x == sym_x) marked 0 is zero already and is not written again, which makes a decode-sized
// call's cost follow its real rows, not the padding of every group. !marks_valid: nothing is trusted, every padding
// row of recv_x is zeroed, and every mark is set (the region's padding rows that a separate recv_x leaves untouched,
// and the rows past the last group end, to 1).
__global__ void __launch_bounds__(kThreads)
    dispatch_fanout_kernel(Layout l, int rank, PlanView p, const uint16_t* sym_x, const float* sym_w, uint16_t* recv_x,
                           float* recv_w, uint8_t* marks, bool marks_valid) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    const int64_t n16 = l.row_bytes() / 16;
    const int32_t end = rows_end(l, p, rank);
    const bool in_region = recv_x == sym_x;
    for (int64_t base = warp; base < end; base += 32 * num_warps) {
        const int64_t v = base + int64_t(lane) * num_warps;
        const int64_t r = v < end ? spread_row(v, end) : end;
        bool busy = false;  // this lane's row needs the warp: a copy or a zeroing
        int32_t head = -1;
        if (r < end) {
            head = p.row_head[r];
            if (head >= 0) {
                busy = !in_region || head != r;
                if (recv_w != nullptr) recv_w[r] = sym_w[r];
                marks[r] = 1;  // the region's row holds a pushed row (or, copied out, may)
            } else {
                busy = !in_region || !marks_valid || marks[r] != 0;
                if (recv_w != nullptr) recv_w[r] = 0.0f;
                // The region's row: zero now when it is recv_x; else untouched, so unknown when nothing was trusted.
                if (in_region || !marks_valid) marks[r] = in_region ? 0 : 1;
            }
        }
        for (unsigned rest = __ballot_sync(kFull, busy); rest != 0; rest &= rest - 1) {
            const int j = __ffs(rest) - 1;
            const int64_t row = __shfl_sync(kFull, r, j);
            const int32_t head_j = __shfl_sync(kFull, head, j);
            uint4* dst = reinterpret_cast<uint4*>(recv_x) + row * n16;
            if (head_j >= 0) {
                warp_copy_v4<kUnroll>(dst, reinterpret_cast<const uint4*>(sym_x) + int64_t(head_j) * n16, n16, lane);
            } else {
                warp_zero_v4(dst, n16, lane);
            }
        }
    }
    if (!marks_valid) {
        for (int64_t r = end + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < l.num_recv_rows;
             r += int64_t(gridDim.x) * blockDim.x)
            marks[r] = 1;
    }
}

}  // namespace

void launch(const DispatchArgs& a, cudaStream_t stream, int num_sms) {
    const Layout& l = a.layout;
    const SymmetricLayout sym = make_symmetric_layout(l);
    const PeerPointers peers = per_rank("dispatch", a.peers, l.num_ranks);
    // Destinations are done with the previous contents (plan_ordered: this step's plan op met every rank after).
    if (!a.plan_ordered) launch_barrier(a.sync, sync::kOpDispatch, stream);
    const int push_blocks = token_blocks(num_sms, l.num_tokens, kWarps);
    dispatch_push_kernel<<<push_blocks, kThreads, 0, stream>>>(l, a.x, a.topk_weights, a.plan, sym, peers);
    FLATEP_CUDA_CHECK_LAUNCH();
    // Every source's rows and weights have landed.
    launch_barrier(a.sync, a.plan_ordered ? sync::kOpDispatchOrdered : sync::kOpDispatch, stream);
    const int fan_blocks = grid_blocks(num_sms, ceil_div(l.num_recv_rows, kWarps), 4);
    dispatch_fanout_kernel<<<fan_blocks, kThreads, 0, stream>>>(
        l, a.rank, a.plan, region_at<const uint16_t>(a.peers[a.rank], sym.recv_x_offset),
        region_at<const float>(a.peers[a.rank], sym.recv_w_offset), a.recv_x, a.recv_w,
        region_at<uint8_t>(a.peers[a.rank], sym.recv_marks_offset), a.marks_valid);
    FLATEP_CUDA_CHECK_LAUNCH();
}

FLATEP_PRELOAD_KERNELS(dispatch_push_kernel, dispatch_fanout_kernel);

}  // namespace flatep::kernels
