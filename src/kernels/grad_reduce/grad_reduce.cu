#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/grad_reduce/grad_reduce.cuh"
#include "layout/layout.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 2;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunk4 = int64_t(kThreads) * kUnroll;  // float4 words per block step
constexpr int kMaxListed = 2048;  // replica slots of this rank's experts a block lists in shared memory

using ReducePools = PerRank<float>;  // every rank's fp32 reduce pool

FLATEP_DEVICE void add4(float4& a, const float4& b) {
    a.x = a.x + b.x;
    a.y = a.y + b.y;
    a.z = a.z + b.z;
    a.w = a.w + b.w;
}

__global__ void __launch_bounds__(kThreads)
    grad_reduce_kernel(int rank, int num_ranks, int epn, int64_t n, const int32_t* slot_expert, float* grads,
                       ReducePools pools) {
    __shared__ const float* srcs[kMaxRanks * 8];
    __shared__ int num_src_s;
    __shared__ int32_t listed[kMaxListed];
    __shared__ int warp_count[kWarps];
    __shared__ int num_listed_s;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t n4 = n / 4;
    const int64_t num_chunks = ceil_div<int64_t>(n4, kChunk4);
    // The slots (d, j), ascending, that hold a replica of one of this rank's experts: the whole block compacts the
    // slot table once (a ballot per warp, the warps' counts in order), so that the per-expert search below reads
    // this short list instead of the whole table on one thread.
    const int num_slots = num_ranks * epn;
    if (threadIdx.x == 0) num_listed_s = 0;
    __syncthreads();
    for (int base = 0; base < num_slots; base += kThreads) {
        const int i = base + threadIdx.x;
        const int expert = i < num_slots ? slot_expert[i] : -1;
        const bool mine = expert >= 0 && home_rank(expert, epn) == rank;
        const unsigned ballot = __ballot_sync(kFull, mine);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        int at = num_listed_s + __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) at += warp_count[w];
        if (mine && at < kMaxListed) listed[at] = i;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 0; w < kWarps; ++w) num_listed_s += warp_count[w];
        }
        __syncthreads();
    }
    const bool all_listed = num_listed_s <= kMaxListed;  // else the table itself is searched (same order)
    const int num_candidates = all_listed ? num_listed_s : num_slots;
    for (int g = 0; g < epn; ++g) {
        const int expert = rank * epn + g;
        __syncthreads();
        if (threadIdx.x == 0) {
            int count = 0;
            for (int c = 0; c < num_candidates; ++c) {  // ascending (rank, slot): the order of the fp32 adds
                const int i = all_listed ? listed[c] : c;
                if (slot_expert[i] != expert) continue;
                if (count < kMaxRanks * 8) srcs[count] = pools.ptr[i / epn] + int64_t(i % epn) * n;
                ++count;
            }
            num_src_s = count < kMaxRanks * 8 ? count : kMaxRanks * 8;
        }
        __syncthreads();
        const int num_src = num_src_s;
        if (num_src == 0) continue;
        float* grad = grads + int64_t(g) * n;
        for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t w = c * kChunk4 + int64_t(u) * kThreads + threadIdx.x;
                if (w >= n4) continue;
                float4 acc = reinterpret_cast<const float4*>(grad)[w];
                for (int s = 0; s < num_src; ++s) add4(acc, reinterpret_cast<const float4*>(srcs[s])[w]);
                reinterpret_cast<float4*>(grad)[w] = acc;
            }
        }
        if (blockIdx.x == 0) {  // tail elements
            for (int64_t i = n4 * 4 + threadIdx.x; i < n; i += blockDim.x) {
                float acc = grad[i];
                for (int s = 0; s < num_src; ++s) acc = acc + srcs[s][i];
                grad[i] = acc;
            }
        }
    }
}

__global__ void __launch_bounds__(kThreads)
    zero_slots_kernel(int rank, int epn, int64_t n, const int32_t* slot_expert, float* own_pool) {
    const int64_t n4 = n / 4;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < epn; ++j) {
        if (slot_expert[rank * epn + j] < 0) continue;
        float* slot = own_pool + int64_t(j) * n;
        for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < n4; w += int64_t(gridDim.x) * blockDim.x)
            reinterpret_cast<float4*>(slot)[w] = z;
        if (blockIdx.x == 0)
            for (int64_t i = n4 * 4 + threadIdx.x; i < n; i += blockDim.x) slot[i] = 0.0f;
    }
}

}  // namespace

void launch(const GradReduceArgs& a, cudaStream_t stream) {
    FLATEP_CHECK(a.grads != nullptr, "reduce_grad: grads is null");
    const ReducePools pools = per_rank("reduce_grad", a.reduce_pools, a.num_ranks);
    FLATEP_CHECK(a.expert_elems % 4 == 0, "reduce_grad: expert_elems must be a multiple of 4, got ", a.expert_elems);
    launch_barrier(a.sync, kOpGradReduce, stream);
    const int blocks = grid_blocks(a.sync, ceil_div<int64_t>(a.expert_elems / 4, kChunk4) * 4, 2);
    grad_reduce_kernel<<<blocks, kThreads, 0, stream>>>(a.rank, a.num_ranks, a.experts_per_rank, a.expert_elems,
                                                        a.slot_expert, a.grads, pools);
    FLATEP_CUDA_CHECK_LAUNCH();
    launch_barrier(a.sync, kOpGradReduce, stream);
    zero_slots_kernel<<<blocks, kThreads, 0, stream>>>(a.rank, a.experts_per_rank, a.expert_elems, a.slot_expert,
                                                       a.reduce_pools[a.rank]);
    FLATEP_CUDA_CHECK_LAUNCH();
}

void preload_grad_reduce_kernels() { preload_kernels(grad_reduce_kernel, zero_slots_kernel); }

}  // namespace flatep::kernels
