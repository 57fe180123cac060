#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/prefetch/prefetch.cuh"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;
constexpr int64_t kChunk16 = int64_t(kThreads) * kUnroll;  // 16-byte words per block step (32 KiB)

struct SlotPools {
    uint8_t* ptr[kMaxRanks];
};

// Every block takes its share of every (rank, slot) this rank owns: chunks of 32 KiB, grid-strided.
__global__ void __launch_bounds__(kThreads)
    prefetch_push_kernel(int rank, int num_ranks, int epn, int64_t expert_bytes, const int32_t* slot_expert,
                         const uint8_t* weights, SlotPools pools) {
    const int64_t n16 = expert_bytes / 16;
    const int64_t num_chunks = ceil_div(n16, kChunk16);
    for (int i = 0; i < num_ranks * epn; ++i) {
        const int expert = slot_expert[i];
        if (expert < 0 || expert / epn != rank) continue;
        const int d = i / epn, j = i % epn;
        const uint4* src = reinterpret_cast<const uint4*>(weights + int64_t(expert % epn) * expert_bytes);
        uint4* dst = reinterpret_cast<uint4*>(pools.ptr[d] + int64_t(j) * expert_bytes);
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
            for (int64_t b = n16 * 16 + threadIdx.x; b < expert_bytes; b += blockDim.x) {
                pools.ptr[d][int64_t(j) * expert_bytes + b] = weights[int64_t(expert % epn) * expert_bytes + b];
            }
        }
    }
}

}  // namespace

void launch(const PrefetchArgs& a, cudaStream_t stream) {
    FLATEP_CHECK(a.weights != nullptr, "prefetch: weights is null");
    FLATEP_CHECK(a.expert_bytes >= 0, "prefetch: expert_bytes must be >= 0, got ", a.expert_bytes);
    FLATEP_CHECK(a.num_ranks >= 1 && a.num_ranks <= kMaxRanks, "prefetch: num_ranks out of range: ", a.num_ranks);
    SlotPools pools{};
    for (int r = 0; r < a.num_ranks; ++r) {
        pools.ptr[r] = a.slot_pools[r];
        FLATEP_CHECK(reinterpret_cast<uintptr_t>(a.slot_pools[r]) % 16 == 0, "prefetch: slot pool of rank ", r,
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

void preload_prefetch_kernels() {
    cudaFuncAttributes attr{};
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, prefetch_push_kernel));
}

}  // namespace flatep::kernels
