#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/grad_reduce/grad_reduce.cuh"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 2;
constexpr int64_t kChunk4 = int64_t(kThreads) * kUnroll;  // float4 words per block step

struct ReducePools {
    float* ptr[kMaxRanks];
};

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
    const int64_t n4 = n / 4;
    const int64_t num_chunks = ceil_div<int64_t>(n4, kChunk4);
    for (int g = 0; g < epn; ++g) {
        const int expert = rank * epn + g;
        __syncthreads();
        if (threadIdx.x == 0) {
            int count = 0;
            for (int i = 0; i < num_ranks * epn; ++i) {
                if (slot_expert[i] != expert) continue;
                if (count < kMaxRanks * 8) srcs[count] = pools.ptr[i / epn] + int64_t(i % epn) * n;
                ++count;
            }
            num_src_s = count;
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
    FLATEP_CHECK(a.num_ranks >= 1 && a.num_ranks <= kMaxRanks, "reduce_grad: num_ranks out of range: ", a.num_ranks);
    FLATEP_CHECK(a.expert_elems % 4 == 0, "reduce_grad: expert_elems must be a multiple of 4, got ", a.expert_elems);
    ReducePools pools{};
    for (int r = 0; r < a.num_ranks; ++r) pools.ptr[r] = a.reduce_pools[r];
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

void preload_grad_reduce_kernels() {
    cudaFuncAttributes attr{};
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, grad_reduce_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, zero_slots_kernel));
}

}  // namespace flatep::kernels
