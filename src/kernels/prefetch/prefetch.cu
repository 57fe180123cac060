#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/owned_slots.cuh"
#include "kernels/common/vector.cuh"
#include "layout/layout.hpp"
#include "ops/prefetch_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
// 16-byte loads in flight per thread (118 registers: one block an SM). On 8 virtual ranks at K3 the op took 56.5 us
// with 16 against 59.9-60.4 us with 8 (H200, same run).
constexpr int kUnroll = 16;
constexpr int kMaxListed = 2048;  // replica slots of this rank's experts a block lists in shared memory

using SlotPools = PerRank<uint8_t>;  // every rank's slot pool

// Words [begin, end) of one expert's weights from src to dst, by the block: kUnroll 16-byte loads in flight per
// thread, then their stores.
FLATEP_DEVICE void copy_range(const uint4* src, uint4* dst, int64_t begin, int64_t end, int tid) {
    for (int64_t base = begin + tid; base < end; base += int64_t(kThreads) * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t w = base + int64_t(u) * kThreads;
            if (w < end) v[u] = ld_v4(src + w);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t w = base + int64_t(u) * kThreads;
            if (w < end) st_v4(dst + w, v[u]);
        }
    }
}

// The rank's replicas (the slots holding one of its experts, listed once per block in ascending (rank, slot) order),
// each cut into chunks of chunk16 words: the work items replica * num_chunks + chunk, dealt to the blocks
// round-robin. The launch makes chunk16 an expert's share of one block (num_chunks = the grid), so that every block
// copies the same number of words whatever the number of replicas: with fixed chunks, one replica's 112 chunks of
// 64 KiB (K3) left half the grid idle for the last round.
__global__ void __launch_bounds__(kThreads, 1)
    prefetch_push_kernel(int rank, int num_ranks, int epn, int64_t expert_bytes, int64_t chunk16,
                         const int32_t* slot_expert, const uint8_t* weights, SlotPools pools) {
    __shared__ OwnedSlots<kThreads, kMaxListed> owned;
    const int tid = threadIdx.x;
    const int num_slots = num_ranks * epn;
    const int count = list_owned_slots(owned, rank, num_slots, epn, slot_expert, tid);
    // More replicas of this rank's experts than the list holds: the items walk the whole table instead.
    const bool all_listed = count <= kMaxListed;
    const int num_replicas = all_listed ? count : num_slots;
    const int64_t n16 = expert_bytes / 16;
    const int64_t num_chunks = ceil_div(n16, chunk16);
    for (int64_t item = blockIdx.x; item < int64_t(num_replicas) * num_chunks; item += gridDim.x) {
        const int i = all_listed ? owned.listed[item / num_chunks] : int(item / num_chunks);
        const int expert = slot_expert[i];
        if (!all_listed && (expert < 0 || home_rank(expert, epn) != rank)) continue;
        const uint8_t* src = weights + int64_t(local_expert(expert, epn)) * expert_bytes;
        uint8_t* dst = pools.ptr[i / epn] + int64_t(i % epn) * expert_bytes;
        const int64_t begin = (item % num_chunks) * chunk16;
        copy_range(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), begin,
                   min_of(begin + chunk16, n16), tid);
    }
}

// Serving's pull: this rank's B slots, each cut into chunks of chunk16 words, the items slot * num_chunks + chunk dealt
// to the blocks round-robin; a slot without an expert this step is skipped. Reads the owners' memory, writes only this
// rank's slot pool.
__global__ void __launch_bounds__(kThreads, 1)
    prefetch_pull_kernel(int rank, int epn, int num_slots, int64_t expert_bytes, int64_t chunk16,
                         const int32_t* slot_expert, PerRank<const uint8_t> owners, uint8_t* slots) {
    const int tid = threadIdx.x;
    const int64_t n16 = expert_bytes / 16;
    const int64_t num_chunks = ceil_div(n16, chunk16);
    for (int64_t item = blockIdx.x; item < int64_t(num_slots) * num_chunks; item += gridDim.x) {
        const int j = int(item / num_chunks);
        const int expert = slot_expert[rank * epn + j];
        if (expert < 0) continue;
        const uint8_t* src = owners.ptr[home_rank(expert, epn)] + int64_t(local_expert(expert, epn)) * expert_bytes;
        uint8_t* dst = slots + int64_t(j) * expert_bytes;
        const int64_t begin = (item % num_chunks) * chunk16;
        copy_range(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), begin,
                   min_of(begin + chunk16, n16), tid);
    }
}

// An expert's share of one block of a grid of `blocks`, in whole 512-byte lines (32 words): every block copies the
// same number of words whatever the number of experts.
int64_t chunk_words(int64_t n16, int blocks) {
    return max_of<int64_t>(32, round_up<int64_t>(ceil_div<int64_t>(n16, blocks), 32));
}

void launch_pull(const PrefetchArgs& a, cudaStream_t stream, int num_sms) {
    launch_barrier(a.sync, sync::kOpPrefetch, stream);  // the owners' weights are final
    if (a.num_slots == 0) return;
    const int64_t n16 = a.expert_bytes / 16;
    const int blocks = grid_blocks(num_sms, ceil_div<int64_t>(n16, kThreads * kUnroll) * a.num_slots, 1);
    prefetch_pull_kernel<<<blocks, kThreads, 0, stream>>>(
        a.rank, a.experts_per_rank, a.num_slots, a.expert_bytes, chunk_words(n16, blocks), a.slot_expert,
        per_rank("prefetch", a.owners, a.num_ranks), a.slot_pools[a.rank]);
    FLATEP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch(const PrefetchArgs& a, cudaStream_t stream, int num_sms) {
    if (a.pull) return launch_pull(a, stream, num_sms);
    const SlotPools pools = per_rank("prefetch", a.slot_pools, a.num_ranks);
    launch_barrier(a.sync, sync::kOpPrefetch, stream);
    // Work items: replicas * chunks, unknown here (the plan is on the device): as many blocks as the budget allows,
    // and an expert's share of one block as the chunk, in whole 512-byte lines (32 words).
    const int64_t n16 = a.expert_bytes / 16;
    const int blocks = grid_blocks(num_sms, ceil_div<int64_t>(n16, kThreads * kUnroll) * a.num_ranks, 1);
    prefetch_push_kernel<<<blocks, kThreads, 0, stream>>>(a.rank, a.num_ranks, a.experts_per_rank, a.expert_bytes,
                                                          chunk_words(n16, blocks), a.slot_expert, a.weights, pools);
    FLATEP_CUDA_CHECK_LAUNCH();
    launch_barrier(a.sync, sync::kOpPrefetch, stream);
}

FLATEP_PRELOAD_KERNELS(prefetch_push_kernel, prefetch_pull_kernel);

}  // namespace flatep::kernels
