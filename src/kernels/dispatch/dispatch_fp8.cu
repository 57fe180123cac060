#include "common/check.hpp"
#include "common/fp8.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/groups.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/dispatch/token_entries.cuh"
#include "ops/dispatch_fp8_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// A lane's unit of work: 16 channels (32 bytes of bf16 in, one 16-byte word of e4m3 out), so the 8 lanes of an
// aligned lane octet hold one 128-channel block and reduce its amax with three shuffles.
constexpr int kChunkChannels = 16;
constexpr int kLanesPerBlock = kFp8BlockSize / kChunkChannels;
constexpr int kUnroll = 7;  // the fan-out's 16-byte words in flight per lane (a 7168-byte e4m3 row: 2 steps)
// The push's chunks in flight per lane: 4*32 chunks = 2048 channels per warp step (7168: 4 steps). Measured on the
// H200 (fp8_bench, graph replay, 8 virtual ranks) against 7 (the bf16 push's): quantising 0.584 / 0.588 of bf16 against
// 0.603 / 0.608 (MoonEP / DeepEP); 2, 3, 5 and 6 were slower, and so were both at 64 registers (two blocks an SM). The
// kernels are declared for one block an SM (72 and 84 registers, as measured): without it ptxas fits the pre-quantised
// one into 64 registers with spills.
constexpr int kPushUnroll = 4;

static_assert(kLanesPerBlock == 8 && 32 % kLanesPerBlock == 0, "a block must be one aligned lane octet");

FLATEP_DEVICE uint32_t chunk_amax(const uint4& a, const uint4& b) {
    const uint32_t m0 = max(fp8::word_amax_bits(a.x), fp8::word_amax_bits(a.y));
    const uint32_t m1 = max(fp8::word_amax_bits(a.z), fp8::word_amax_bits(a.w));
    const uint32_t m2 = max(fp8::word_amax_bits(b.x), fp8::word_amax_bits(b.y));
    const uint32_t m3 = max(fp8::word_amax_bits(b.z), fp8::word_amax_bits(b.w));
    return max(max(m0, m1), max(m2, m3));
}

// One step of a warp's walk along a bf16 row of num_chunks 16-channel chunks: lane `lane` loads chunk i0 + 32*u + lane
// (two 16-byte words) into raw[u]; a chunk at or past num_chunks reads as zeros (its octet's amax then ignores it).
FLATEP_DEVICE void load_bf16_step(uint4 (&raw)[kPushUnroll][2], const uint4* src, int64_t i0, int64_t num_chunks,
                                  int lane) {
#pragma unroll
    for (int u = 0; u < kPushUnroll; ++u) {
        const int64_t i = i0 + 32 * u + lane;
        raw[u][0] = raw[u][1] = make_uint4(0, 0, 0, 0);
        if (i < num_chunks) {
            raw[u][0] = ld_v4(src + 2 * i);
            raw[u][1] = ld_v4(src + 2 * i + 1);
        }
    }
}

// One lane's 16 channels (a, b: 32 bytes of bf16) -> 16 e4m3 bytes, and the scale of the block the lane's octet holds
// (every lane of the octet returns it). Every lane of the warp must call it (shuffles over the whole warp).
FLATEP_DEVICE uint4 quantise_chunk(const uint4& a, const uint4& b, Fp8Scale mode, float* scale_out) {
    uint32_t amax = chunk_amax(a, b);
#pragma unroll
    for (int offset = kLanesPerBlock / 2; offset > 0; offset /= 2)
        amax = max(amax, __shfl_xor_sync(kFull, amax, offset));
    const float scale = fp8::block_scale(amax, mode), inverse = fp8::block_inverse(amax, scale, mode);
    *scale_out = scale;
    return make_uint4(fp8::quantize_words(a.x, a.y, scale, inverse), fp8::quantize_words(a.z, a.w, scale, inverse),
                      fp8::quantize_words(b.x, b.y, scale, inverse), fp8::quantize_words(b.z, b.w, scale, inverse));
}

// Source side: warp per token (row_slices warps per token when the call has fewer tokens than the grid has warps), as
// the bf16 dispatch. Lanes k < K hold entry k; the first lane of each destination rank (ascending k) is the chain head,
// whose row receives the token's e4m3 row and scales; every entry writes its weight. kQuantise: the row is read as bf16
// and quantised here, once for all its destinations; else e4m3 bytes and scales are read as given.
template <bool kQuantise>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_fp8_push_kernel(Layout l, const uint16_t* x_bf16, const uint8_t* x_fp8, const float* x_scales,
                             const float* topk_weights, Fp8Scale mode, PlanView p, SymmetricLayout sym,
                             int64_t scales_offset, PeerPointers peers) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    const int K = l.topk, H = l.hidden, num_blocks = l.hidden / kFp8BlockSize;
    const int num_tokens = plan_num_tokens(p);
    const int64_t num_chunks = H / kChunkChannels;  // also the 16-byte words of an e4m3 row
    constexpr int64_t kStep = 32 * kPushUnroll;
    const int num_slices = row_slices(num_tokens, num_warps, ceil_div(num_chunks, kStep));
    for (int64_t item = warp; item < int64_t(num_tokens) * num_slices; item += num_warps) {
        const int64_t t = item / num_slices;
        const int64_t slice = item % num_slices;
        const int64_t first = slice * kStep;
        // Pre-quantised: the first step's e4m3 words are read along with the token's entries, and so are its first 64
        // scales (lanes j and j + 32), which the first slice copies. The quantising kernel reads each bf16 step in the
        // loop (reading the first one ahead spilled its registers).
        uint4 raw[kPushUnroll][2];
        uint4 q[kPushUnroll];
        const float* src_scales = kQuantise ? nullptr : x_scales + t * num_blocks;
        float s0 = 0.0f, s1 = 0.0f;
        if constexpr (!kQuantise) {
            warp_load_step(q, reinterpret_cast<const uint4*>(x_fp8 + t * H), first, num_chunks, lane);
            if (slice == 0 && lane < num_blocks) s0 = src_scales[lane];
            if (slice == 0 && lane + 32 < num_blocks) s1 = src_scales[lane + 32];
        }
        const TokenEntries entries = token_entries(p, K, t, topk_weights, peers, sym.recv_w_offset, lane, slice == 0);
        if (entries.heads == 0) continue;
        for (int64_t i0 = first; i0 < num_chunks; i0 += num_slices * kStep) {
            float scale[kPushUnroll];
            if constexpr (kQuantise) {
                load_bf16_step(raw, reinterpret_cast<const uint4*>(x_bf16 + t * H), i0, num_chunks, lane);
#pragma unroll
                for (int u = 0; u < kPushUnroll; ++u) q[u] = quantise_chunk(raw[u][0], raw[u][1], mode, &scale[u]);
            } else {
                if (i0 != first) warp_load_step(q, reinterpret_cast<const uint4*>(x_fp8 + t * H), i0, num_chunks, lane);
            }
            for (unsigned rest = entries.heads; rest != 0; rest &= rest - 1) {
                int dk, rowk;
                head_target(entries, __ffs(rest) - 1, &dk, &rowk);
                uint4* dst = region_at<uint4>(peers.ptr[dk], fp8_recv_x_offset(sym)) + int64_t(rowk) * num_chunks;
                float* dst_scales = region_at<float>(peers.ptr[dk], scales_offset) + int64_t(rowk) * num_blocks;
#pragma unroll
                for (int u = 0; u < kPushUnroll; ++u) {
                    const int64_t i = i0 + 32 * u + lane;
                    if (i < num_chunks) {
                        st_v4(dst + i, q[u]);
                        if constexpr (kQuantise) {
                            if (lane % kLanesPerBlock == 0) dst_scales[i / kLanesPerBlock] = scale[u];
                        }
                    }
                }
            }
        }
        if constexpr (!kQuantise) {
            if (slice != 0) continue;
            for (unsigned rest = entries.heads; rest != 0; rest &= rest - 1) {
                int dk, rowk;
                head_target(entries, __ffs(rest) - 1, &dk, &rowk);
                float* dst_scales = region_at<float>(peers.ptr[dk], scales_offset) + int64_t(rowk) * num_blocks;
                if (lane < num_blocks) dst_scales[lane] = s0;
                if (lane + 32 < num_blocks) dst_scales[lane + 32] = s1;
                for (int j = lane + 64; j < num_blocks; j += 32) dst_scales[j] = src_scales[j];
            }
        }
    }
}

// Destination side: warp per row of this rank, in the spread_row order, 32 at a time as in the bf16 fan-out: lane j
// reads the head and weight of position base + j*num_warps's row and writes its recv_w. A real row that is its own head
// in the region needs nothing more; the others are copied (row and scales read together) or zeroed by the warp.
__global__ void __launch_bounds__(kThreads)
    dispatch_fp8_fanout_kernel(Layout l, int rank, PlanView p, const uint8_t* sym_x, const float* sym_scales,
                               const float* sym_w, uint8_t* recv_x, float* recv_scales, float* recv_w,
                               uint8_t* bf16_marks) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    const int64_t n16 = l.hidden / 16;
    const int num_blocks = l.hidden / kFp8BlockSize;
    const int32_t end = rows_end(l, p, rank);
    const bool in_region = recv_x == sym_x, scales_in_region = recv_scales == sym_scales;
    // The e4m3 rows and scales share the bf16 rows' region: every bf16 row may now be nonzero (dispatch's marks).
    for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < l.num_recv_rows;
         r += int64_t(gridDim.x) * blockDim.x)
        bf16_marks[r] = 1;
    for (int64_t base = warp; base < end; base += 32 * num_warps) {
        const int64_t v = base + int64_t(lane) * num_warps;
        const int64_t r = v < end ? spread_row(v, end) : end;
        bool busy = false;
        int32_t head = -1;
        if (r < end) {
            head = p.row_head[r];
            busy = head < 0 || !in_region || !scales_in_region || head != r;
            if (recv_w != nullptr) recv_w[r] = head >= 0 ? sym_w[r] : 0.0f;
        }
        for (unsigned rest = __ballot_sync(kFull, busy); rest != 0; rest &= rest - 1) {
            const int j = __ffs(rest) - 1;
            const int64_t row = __shfl_sync(kFull, r, j);
            const int32_t head_j = __shfl_sync(kFull, head, j);
            uint4* dst = reinterpret_cast<uint4*>(recv_x) + row * n16;
            float* dst_scales = recv_scales + row * num_blocks;
            if (head_j >= 0) {
                const uint4* src = reinterpret_cast<const uint4*>(sym_x) + int64_t(head_j) * n16;
                const float* src_scales = sym_scales + int64_t(head_j) * num_blocks;
                // A lane's scales (j = lane, lane + 32) are read before the row's words, so they arrive with them.
                const bool copy_scales = dst_scales != src_scales;
                float s0 = 0.0f, s1 = 0.0f;
                if (copy_scales && lane < num_blocks) s0 = src_scales[lane];
                if (copy_scales && lane + 32 < num_blocks) s1 = src_scales[lane + 32];
                if (dst != src) warp_copy_v4<kUnroll>(dst, src, n16, lane);
                if (copy_scales && lane < num_blocks) dst_scales[lane] = s0;
                if (copy_scales && lane + 32 < num_blocks) dst_scales[lane + 32] = s1;
                for (int b = lane + 64; copy_scales && b < num_blocks; b += 32) dst_scales[b] = src_scales[b];
            } else {
                warp_zero_v4(dst, n16, lane);
                for (int b = lane; b < num_blocks; b += 32) dst_scales[b] = 0.0f;
            }
        }
    }
}

}  // namespace

void launch(const DispatchFp8Args& a, cudaStream_t stream, int num_sms) {
    const Layout& l = a.layout;
    const SymmetricLayout sym = make_symmetric_layout(l);
    const int64_t scales_offset = fp8_recv_scales_offset(l, sym);
    const PeerPointers peers = per_rank("dispatch_fp8", a.peers, l.num_ranks);
    // Destinations are done with the previous contents (plan_ordered: this step's plan op met every rank after).
    if (!a.plan_ordered) launch_barrier(a.sync, sync::kOpDispatchFp8, stream);
    const int push_blocks = token_blocks(num_sms, l.num_tokens, kWarps);
    // An empty call (s = 0, no rows given) pushes nothing; the pre-quantised kernel then reads no row.
    auto push = a.x_bf16 != nullptr ? dispatch_fp8_push_kernel<true> : dispatch_fp8_push_kernel<false>;
    push<<<push_blocks, kThreads, 0, stream>>>(l, a.x_bf16, a.x_fp8, a.x_scales, a.topk_weights, a.scale_mode, a.plan,
                                               sym, scales_offset, peers);
    FLATEP_CUDA_CHECK_LAUNCH();
    // Every source's rows, scales and weights have landed.
    launch_barrier(a.sync, a.plan_ordered ? sync::kOpDispatchFp8Ordered : sync::kOpDispatchFp8, stream);
    const uint8_t* base = a.peers[a.rank];
    const int fan_blocks = grid_blocks(num_sms, ceil_div(l.num_recv_rows, kWarps), 4);
    dispatch_fp8_fanout_kernel<<<fan_blocks, kThreads, 0, stream>>>(
        l, a.rank, a.plan, base + fp8_recv_x_offset(sym), region_at<const float>(base, scales_offset),
        region_at<const float>(base, sym.recv_w_offset), a.recv_x, a.recv_scales, a.recv_w,
        region_at<uint8_t>(a.peers[a.rank], sym.recv_marks_offset));
    FLATEP_CUDA_CHECK_LAUNCH();
}

FLATEP_PRELOAD_KERNELS(dispatch_fp8_push_kernel<true>, dispatch_fp8_push_kernel<false>, dispatch_fp8_fanout_kernel);

}  // namespace flatep::kernels
