#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/prefetch/prefetch.cuh"
#include "layout/layout.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;
constexpr int64_t kChunk16 = int64_t(kThreads) * kUnroll;  // 16-byte words per block step (32 KiB)

using SlotPools = PerRank<uint8_t>;  // every rank's slot pool

// One expert's weights (expert_bytes) from src to dst: this block's share of the chunks of 32 KiB, grid-strided.
FLATEP_DEVICE void push_expert(const uint8_t* src_bytes, uint8_t* dst_bytes, int64_t expert_bytes) {
    const int64_t n16 = expert_bytes / 16;
    const int64_t num_chunks = ceil_div(n16, kChunk16);
    const uint4* src = reinterpret_cast<const uint4*>(src_bytes);
    uint4* dst = reinterpret_cast<uint4*>(dst_bytes);
    for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
        const int64_t base = c * kChunk16 + threadIdx.x;
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t w = base + int64_t(u) * kThreads;
            if (w < n16) v[u] = ld_v4(src + w);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t w = base + int64_t(u) * kThreads;
            if (w < n16) st_v4(dst + w, v[u]);
        }
    }
    // Tail bytes (expert_bytes not a multiple of 16).
    if (blockIdx.x == 0) {
        for (int64_t b = n16 * 16 + threadIdx.x; b < expert_bytes; b += blockDim.x) dst_bytes[b] = src_bytes[b];
    }
}

// Every block takes its share of every (rank, slot) this rank owns, in ascending (rank, slot) order.
__global__ void __launch_bounds__(kThreads)
    prefetch_push_kernel(int rank, int num_ranks, int epn, int64_t expert_bytes, const int32_t* slot_expert,
                         const uint8_t* weights, SlotPools pools) {
    for (int d = 0; d < num_ranks; ++d) {
        for (int j = 0; j < epn; ++j) {
            const int expert = slot_expert[d * epn + j];
            if (expert < 0 || home_rank(expert, epn) != rank) continue;
            push_expert(weights + int64_t(local_expert(expert, epn)) * expert_bytes,
                        pools.ptr[d] + int64_t(j) * expert_bytes, expert_bytes);
        }
    }
}

}  // namespace

void launch(const PrefetchArgs& a, cudaStream_t stream) {
    FLATEP_CHECK(a.weights != nullptr, "prefetch: weights is null");
    FLATEP_CHECK(a.expert_bytes >= 0, "prefetch: expert_bytes must be >= 0, got ", a.expert_bytes);
    const SlotPools pools = per_rank("prefetch", a.slot_pools, a.num_ranks);
    for (int r = 0; r < a.num_ranks; ++r) {
        FLATEP_CHECK(reinterpret_cast<uintptr_t>(pools.ptr[r]) % 16 == 0, "prefetch: slot pool of rank ", r,
                     " must be 16-byte aligned");
    }
    FLATEP_CHECK(reinterpret_cast<uintptr_t>(a.weights) % 16 == 0 && a.expert_bytes % 16 == 0,
                 "prefetch: weights must be 16-byte aligned and expert_bytes a multiple of 16, got ", a.expert_bytes);
    launch_barrier(a.sync, kOpPrefetch, stream);
    const int blocks = grid_blocks(a.sync, ceil_div<int64_t>(a.expert_bytes / 16, kChunk16) * 4, 2);
    prefetch_push_kernel<<<blocks, kThreads, 0, stream>>>(a.rank, a.num_ranks, a.experts_per_rank, a.expert_bytes,
                                                          a.slot_expert, a.weights, pools);
    FLATEP_CUDA_CHECK_LAUNCH();
    launch_barrier(a.sync, kOpPrefetch, stream);
}

void preload_prefetch_kernels() { preload_kernels(prefetch_push_kernel); }

}  // namespace flatep::kernels
