#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/owned_slots.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/prefetch/chunks.hpp"
#include "layout/layout.hpp"
#include "ops/prefetch_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
// 16-byte loads in flight per thread (118 registers: one block an SM). On 8 virtual ranks at K3 the op took 56.5 us
// with 16 against 59.9-60.4 us with 8 (H200, same run).
constexpr int kUnroll = 16;
constexpr int kMaxListed = 2048;  // replica slots of this rank's experts a block lists in shared memory

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

// What one op copies, as the kernels see it: per projection p, the words of one expert (n16[p]), this rank's side
// (push: its own experts; pull: its slot pool) and every rank's other side (push: the slot pools; pull: the owners'
// experts), and how the push cuts an expert's words of all projections into chunks (kernels/prefetch/chunks.hpp).
struct CopyPlan {
    int num_projections;
    PrefetchChunks chunks;
    int64_t n16[kMaxPrefetchProjections];
    uint8_t* mine[kMaxPrefetchProjections];
    PerRank<uint8_t> peers[kMaxPrefetchProjections];
};

// The chunk `chunk` of `expert` (of an expert's first_chunk[P]) from src_expert to dst_expert, by the block; the
// projection's pointers are picked by the caller's functions of p.
template <class Src, class Dst>
FLATEP_DEVICE void copy_chunk(const CopyPlan& c, int chunk, Src src_of, Dst dst_of, int tid) {
    int p = 0;
    while (p + 1 < c.num_projections && chunk >= c.chunks.first_chunk[p + 1]) ++p;
    const int64_t begin = int64_t(chunk - c.chunks.first_chunk[p]) * c.chunks.chunk16;
    copy_range(reinterpret_cast<const uint4*>(src_of(p)), reinterpret_cast<uint4*>(dst_of(p)), begin,
               min_of(begin + c.chunks.chunk16, c.n16[p]), tid);
}

// The rank's replicas (the slots holding one of its experts, listed once per block in ascending (rank, slot) order),
// each cut into the chunks of every projection: the work items replica * chunks + chunk, dealt to the blocks
// round-robin. The launch makes chunk16 an expert's share (all projections) of one block, so that every block copies
// about the same number of words whatever the number of replicas: with fixed chunks, one replica's 112 chunks of
// 64 KiB (K3) left half the grid idle for the last round.
__global__ void __launch_bounds__(kThreads, 1)
    prefetch_push_kernel(int rank, int num_ranks, int epn, const int32_t* slot_expert, CopyPlan c) {
    __shared__ OwnedSlots<kThreads, kMaxListed> owned;
    const int tid = threadIdx.x;
    const int num_slots = num_ranks * epn;
    const int count = list_owned_slots(owned, rank, num_slots, epn, slot_expert, tid);
    // More replicas of this rank's experts than the list holds: the items walk the whole table instead.
    const bool all_listed = count <= kMaxListed;
    const int num_replicas = all_listed ? count : num_slots;
    const int chunks = c.chunks.first_chunk[c.num_projections];
    for (int64_t item = blockIdx.x; item < int64_t(num_replicas) * chunks; item += gridDim.x) {
        const int i = all_listed ? owned.listed[item / chunks] : int(item / chunks);
        const int expert = slot_expert[i];
        if (!all_listed && (expert < 0 || home_rank(expert, epn) != rank)) continue;
        const int64_t local = local_expert(expert, epn), slot = i % epn;
        copy_chunk(
            c, int(item % chunks), [&](int p) { return c.mine[p] + local * c.n16[p] * 16; },
            [&](int p) { return c.peers[p].ptr[i / epn] + slot * c.n16[p] * 16; }, tid);
    }
}

// Serving's pull: the words of this rank's filled slots (listed once per block, ascending j), all projections of a
// slot one after the other, as one stream cut evenly over the grid in whole 512-byte lines: each block copies one
// contiguous range, whatever the number of filled slots and projections. Before, the items slot * chunks + chunk
// were dealt round-robin: every block walked all B slots of the table (at B = epn = 112, 112 reads of the table a
// block, most of them empty slots), and an FP8 slot's scales took a block of their own. Reads the owners' memory,
// writes only this rank's slot pools. More slots than the list holds are taken kMaxListed at a time.
__global__ void __launch_bounds__(kThreads, 1)
    prefetch_pull_kernel(int rank, int epn, int num_slots, const int32_t* slot_expert, CopyPlan c) {
    __shared__ OwnedSlots<kThreads, kMaxListed> filled;
    const int tid = threadIdx.x;
    const int32_t* mine = slot_expert + int64_t(rank) * epn;
    int64_t slot16 = 0;  // words of one slot, all projections
    for (int p = 0; p < c.num_projections; ++p) slot16 += c.n16[p];
    for (int first = 0; first < num_slots; first += kMaxListed) {
        const int window = min_of(kMaxListed, num_slots - first);
        const int count = list_slots(
            filled, window, [&](int i) { return mine[first + i] >= 0; }, tid);
        const int64_t words = int64_t(count) * slot16;
        const WordRange share = pull_block_words(words, blockIdx.x, gridDim.x);
        int64_t at = share.begin;
        const int64_t end = share.end;
        while (at < end) {
            const int k = int(at / slot16);
            int64_t w = at - int64_t(k) * slot16;  // word of the slot's stream: projection p's words follow p - 1's
            int p = 0;
            while (w >= c.n16[p]) w -= c.n16[p++];
            const int64_t n = min_of<int64_t>(c.n16[p] - w, end - at);
            const int j = first + filled.listed[k];
            const int expert = mine[j];
            const uint8_t* src = c.peers[p].ptr[home_rank(expert, epn)] + local_expert(expert, epn) * c.n16[p] * 16;
            uint8_t* dst = c.mine[p] + int64_t(j) * c.n16[p] * 16;
            copy_range(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), w, w + n, tid);
            at += n;
        }
    }
}

// The copy plan of a grid of `blocks`: every projection's pointers and, for the push, the chunks of prefetch_chunks
// (kernels/prefetch/chunks.hpp; the pull cuts its slots' words over the grid itself and leaves them empty).
CopyPlan copy_plan(const PrefetchArgs& a, int blocks) {
    CopyPlan c{};
    c.num_projections = a.num_projections;
    for (int p = 0; p < a.num_projections; ++p) c.n16[p] = a.projections[p].expert_bytes / 16;
    if (!a.pull) c.chunks = prefetch_chunks(c.n16, a.num_projections, blocks);
    for (int p = 0; p < a.num_projections; ++p) {
        const PrefetchProjection& pr = a.projections[p];
        if (a.pull) {
            c.mine[p] = pr.slot_pools[a.rank];
            for (int r = 0; r < a.num_ranks; ++r) c.peers[p].ptr[r] = const_cast<uint8_t*>(pr.owners[r]);
        } else {
            c.mine[p] = const_cast<uint8_t*>(pr.weights);
            c.peers[p] = per_rank("prefetch", pr.slot_pools, a.num_ranks);
        }
    }
    return c;
}

// Blocks for `copies` experts' words of every projection: as many as the budget allows.
int copy_blocks(const PrefetchArgs& a, int copies, int num_sms) {
    int64_t total16 = 0;
    for (int p = 0; p < a.num_projections; ++p) total16 += a.projections[p].expert_bytes / 16;
    return grid_blocks(num_sms, ceil_div<int64_t>(total16, kThreads * kUnroll) * copies, 1);
}

void launch_pull(const PrefetchArgs& a, cudaStream_t stream, int num_sms) {
    // The owners' weights are final (plan_ordered: the plan op's barriers met every rank after its writes).
    if (!a.plan_ordered) launch_barrier(a.sync, sync::kOpPrefetch, stream);
    if (a.num_slots == 0) return;
    const int blocks = copy_blocks(a, a.num_slots, num_sms);
    prefetch_pull_kernel<<<blocks, kThreads, 0, stream>>>(a.rank, a.experts_per_rank, a.num_slots, a.slot_expert,
                                                          copy_plan(a, blocks));
    FLATEP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch(const PrefetchArgs& a, cudaStream_t stream, int num_sms) {
    if (a.pull) return launch_pull(a, stream, num_sms);
    launch_barrier(a.sync, sync::kOpPrefetch, stream);
    // Work items: replicas * chunks, unknown here (the plan is on the device): as many blocks as the budget allows
    // for R copies of an expert.
    const int blocks = copy_blocks(a, a.num_ranks, num_sms);
    prefetch_push_kernel<<<blocks, kThreads, 0, stream>>>(a.rank, a.num_ranks, a.experts_per_rank, a.slot_expert,
                                                          copy_plan(a, blocks));
    FLATEP_CUDA_CHECK_LAUNCH();
    launch_barrier(a.sync, sync::kOpPrefetch, stream);
}

FLATEP_PRELOAD_KERNELS(prefetch_push_kernel, prefetch_pull_kernel);

}  // namespace flatep::kernels
