#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/owned_slots.cuh"
#include "kernels/common/vector.cuh"
#include "layout/layout.hpp"
#include "ops/grad_reduce_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
// float4 words per thread of a work item (95 registers: one block an SM). On 8 virtual ranks at K3 (H200) the op
// took 183.7 us with 8 against 192.6-195.9 us with 4 in one run, and 191.4 us with 4 against 240.4 us for the
// word-by-word walk in another.
constexpr int kUnroll = 8;
constexpr int64_t kChunk4 = int64_t(kThreads) * kUnroll;  // float4 words of a work item (64 KiB)
constexpr int kMaxListed = 2048;  // replica slots of this rank's experts a block lists in shared memory

using ReducePools = PerRank<float>;  // every rank's fp32 reduce pool

FLATEP_DEVICE void add4(float4& a, const float4& b) {
    a.x = a.x + b.x;
    a.y = a.y + b.y;
    a.z = a.z + b.z;
    a.w = a.w + b.w;
}

// Shared memory of grad_reduce_kernel: this rank's replica slots, listed once, then grouped by expert.
struct ReduceShared {
    OwnedSlots<kThreads, kMaxListed> owned;  // the slots; then the start of every group in by_expert
    int32_t expert_of[kMaxListed];           // local expert of each listed slot; then of every group
    int32_t by_expert[kMaxListed];           // the listed slots grouped by expert (ascending), each group ascending
    int32_t expert_at[kMaxListed];           // local expert of by_expert[p]
    int num_groups;
};

// One work item: chunk c (kChunk4 float4 words) of a local expert's gradient (n floats) plus its sources' chunks,
// added in the order given, then the sources' chunks zeroed (they are consumed). Each thread keeps its kUnroll words of
// the gradient in registers and loads every source's kUnroll words at once before adding them (kUnroll + kUnroll loads
// in flight, where a word-by-word walk had two): the stores come last, the zeros after the sums, so no load waits
// behind a store, least of all one to its own word. (Zeros stored right after each source's loads, before its adds,
// made the op twice as slow; the holders zeroing their slots in a pass after a barrier took 185 us where this takes
// 171 us at K3 on 8 virtual ranks, H200.)
FLATEP_DEVICE void reduce_chunk(float* grad, const ReducePools& pools, const int32_t* sources, int num_sources, int epn,
                                int64_t n, int64_t c, int tid) {
    const int64_t n4 = n / 4;
    const int64_t w0 = c * kChunk4 + tid;
    float4* const g = reinterpret_cast<float4*>(grad);
    float4 acc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t w = w0 + int64_t(u) * kThreads;
        if (w < n4) acc[u] = g[w];
    }
    auto source = [&](int k) {
        const int i = sources[k];
        return reinterpret_cast<float4*>(pools.ptr[i / epn] + int64_t(i % epn) * n);
    };
    for (int k = 0; k < num_sources; ++k) {
        const float4* const src = source(k);
        float4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t w = w0 + int64_t(u) * kThreads;
            if (w < n4) v[u] = src[w];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) add4(acc[u], v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t w = w0 + int64_t(u) * kThreads;
        if (w < n4) g[w] = acc[u];
    }
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < num_sources; ++k) {
        float4* const src = source(k);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t w = w0 + int64_t(u) * kThreads;
            if (w < n4) src[w] = zero;
        }
    }
}

// Groups the listed slots by local expert: by_expert holds them in ascending (expert, rank, slot) order (each slot's
// position counted against every other one: a stable sort by expert), the groups' starts go to owned.listed and their
// experts to expert_of. Returns the number of groups (every thread). Begins and ends with a block barrier.
FLATEP_DEVICE int group_by_expert(ReduceShared& sh, int count, int epn, const int32_t* slot_expert, int tid) {
    for (int k = tid; k < count; k += kThreads) sh.expert_of[k] = local_expert(slot_expert[sh.owned.listed[k]], epn);
    __syncthreads();
    for (int k = tid; k < count; k += kThreads) {
        const int g = sh.expert_of[k];
        int pos = 0;
        for (int k2 = 0; k2 < count; ++k2) {
            const int g2 = sh.expert_of[k2];
            pos += g2 < g || (g2 == g && k2 < k);
        }
        sh.by_expert[pos] = sh.owned.listed[k];
        sh.expert_at[pos] = g;
    }
    __syncthreads();
    if (tid == 0) {
        int groups = 0;
        for (int p = 0; p < count; ++p) {
            if (p > 0 && sh.expert_at[p] == sh.expert_at[p - 1]) continue;
            sh.owned.listed[groups] = p;
            sh.expert_of[groups] = sh.expert_at[p];
            ++groups;
        }
        sh.num_groups = groups;
    }
    __syncthreads();
    return sh.num_groups;
}

// The owner's pass: every local expert with replicas gets its gradient plus the replicas' gradients, added in
// ascending (rank, slot) order (design §6), and the replicas' slots are zeroed (each chunk after its sum). The block
// lists the replica slots once and groups them by expert; the work items (an expert with replicas, a chunk of 64 KiB)
// are dealt to the blocks round-robin, so the grid shares the replicated experts whatever their number. With more
// replica slots than the list holds, the experts are walked one by one over the table (the same order).
__global__ void __launch_bounds__(kThreads, 1)
    grad_reduce_kernel(int rank, int num_ranks, int epn, int64_t n, const int32_t* slot_expert, float* grads,
                       ReducePools pools) {
    __shared__ ReduceShared sh;
    const int tid = threadIdx.x;
    const int num_slots = num_ranks * epn;
    const int count = list_owned_slots(sh.owned, rank, num_slots, epn, slot_expert, tid);
    const int64_t num_chunks = ceil_div<int64_t>(n / 4, kChunk4);
    if (count <= kMaxListed) {
        const int groups = group_by_expert(sh, count, epn, slot_expert, tid);
        for (int64_t item = blockIdx.x; item < int64_t(groups) * num_chunks; item += gridDim.x) {
            const int q = int(item / num_chunks);
            const int begin = sh.owned.listed[q], end = q + 1 < groups ? sh.owned.listed[q + 1] : count;
            reduce_chunk(grads + int64_t(sh.expert_of[q]) * n, pools, sh.by_expert + begin, end - begin, epn, n,
                         item % num_chunks, tid);
        }
        return;
    }
    for (int g = 0; g < epn; ++g) {
        const int expert = rank * epn + g;
        __syncthreads();
        if (tid == 0) {
            int k = 0;
            for (int i = 0; i < num_slots && k < kMaxListed; ++i)
                if (slot_expert[i] == expert) sh.by_expert[k++] = i;
            sh.num_groups = k;
        }
        __syncthreads();
        const int num_sources = sh.num_groups;
        for (int64_t c = blockIdx.x; c < num_chunks && num_sources > 0; c += gridDim.x)
            reduce_chunk(grads + int64_t(g) * n, pools, sh.by_expert, num_sources, epn, n, c, tid);
    }
}

}  // namespace

void launch(const GradReduceArgs& a, cudaStream_t stream, int num_sms) {
    const ReducePools pools = per_rank("reduce_grad", a.reduce_pools, a.num_ranks);
    launch_barrier(a.sync, sync::kOpGradReduce, stream);
    const int blocks = grid_blocks(num_sms, ceil_div<int64_t>(a.expert_elems / 4, kChunk4) * 4, 2);
    grad_reduce_kernel<<<blocks, kThreads, 0, stream>>>(a.rank, a.num_ranks, a.experts_per_rank, a.expert_elems,
                                                        a.slot_expert, a.grads, pools);
    FLATEP_CUDA_CHECK_LAUNCH();
    // Every owner has read and zeroed the slots it consumes before any holder goes on (and writes them again).
    launch_barrier(a.sync, sync::kOpGradReduce, stream);
}

FLATEP_PRELOAD_KERNELS(grad_reduce_kernel);

}  // namespace flatep::kernels
