// CUDA plan op, the kernels' part (see plan.cuh): histogram, all-gather of the counts, routing with the chain push,
// and unpack. The planner runs between the two halves (planner/gpu_planner.cuh; the runtime wires the launches).
// A decode-sized call takes fewer launches: counts_kernel does the histogram and the all-gather in one block, and a
// routing of one block runs the barrier after it itself (the same values, fewer nodes on a step's critical path).
#include "common/check.hpp"
#include "common/cuda.hpp"
#include "kernels/common/groups.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/plan/plan.cuh"
#include "kernels/plan/plan_sizes.hpp"

namespace flatep::kernels {

namespace {

constexpr int kRouteThreads = 256;  // 8 warps per routing block
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kCountsThreads = 512;

// Workspace (int32 words, every array 64-word aligned).
struct PlanWorkspace {
    int32_t* tpe_local;             // [E] this rank's histogram
    int32_t* seg_counts;            // [num_segments][E] histogram of every routing segment
    unsigned long long* first_bad;  // (flat index << 32 | uint32 value) of the first bad expert id; ~0 if none
};

PlanWorkspace make_plan_workspace(const Layout& l, void* base) {
    const PlanWorkspaceSizes s = plan_workspace_sizes(l);
    int32_t* w = static_cast<int32_t*>(base);
    PlanWorkspace p{};
    p.tpe_local = w + s.tpe_local;
    p.seg_counts = w + s.seg_counts;
    p.first_bad = reinterpret_cast<unsigned long long*>(w + s.first_bad);
    return p;
}

// What both halves of the op take from the Args: the workspace's arrays, the symmetric layout, the peers.
struct PlanLaunch {
    PlanWorkspace ws;
    SymmetricLayout sym;
    PeerPointers peers;
    int seg_tokens;
};
PlanLaunch plan_launch(const PlanArgs& a, void* workspace) {
    return PlanLaunch{make_plan_workspace(a.layout, workspace), make_symmetric_layout(a.layout),
                      per_rank("plan", a.peers, a.layout.num_ranks), segment_tokens(a.layout)};
}

FLATEP_DEVICE int64_t read_expert(const void* topk_idx, int index_bytes, int64_t flat) {
    return index_bytes == 8 ? static_cast<const int64_t*>(topk_idx)[flat] : static_cast<const int32_t*>(topk_idx)[flat];
}

FLATEP_DEVICE int32_t clamp_to_int32(int64_t v) {
    return int32_t(v < INT32_MIN ? INT32_MIN : (v > INT32_MAX ? INT32_MAX : v));
}

// Segment b's histogram into `hist` [E] (shared memory), by the block: zeroed, then counted; an entry whose expert id
// is out of range lowers *first_bad to its (flat index << 32 | value) instead. Ends with a block barrier: hist is
// complete when it returns.
FLATEP_DEVICE void count_segment(const Layout& l, const void* topk_idx, int index_bytes, int num_tokens, int seg_tokens,
                                 int b, int32_t* hist, unsigned long long* first_bad) {
    const int E = l.num_experts;
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    const int64_t t0 = int64_t(b) * seg_tokens;
    const int64_t t1 = min_of<int64_t>(t0 + seg_tokens, num_tokens);
    for (int64_t i = t0 * l.topk + threadIdx.x; i < t1 * l.topk; i += blockDim.x) {
        const int64_t id = read_expert(topk_idx, index_bytes, i);
        if (id >= 0 && id < E) {
            atomicAdd(&hist[id], 1);
        } else {
            atomicMin(first_bad, (static_cast<unsigned long long>(i) << 32) | uint32_t(clamp_to_int32(id)));
        }
    }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------------------------
// 1. Histogram: per-segment counts (for the deterministic per-expert index of routing) and the rank's total.
__global__ void histogram_kernel(Layout l, const void* topk_idx, int index_bytes, int num_tokens, int seg_tokens,
                                 PlanWorkspace ws) {
    extern __shared__ int32_t hist[];  // [E]
    const int E = l.num_experts;
    const int nseg = ceil_div(l.num_tokens, seg_tokens);
    for (int b = blockIdx.x; b < nseg; b += gridDim.x) {
        count_segment(l, topk_idx, index_bytes, num_tokens, seg_tokens, b, hist, ws.first_bad);
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            const int32_t c = hist[e];
            ws.seg_counts[int64_t(b) * E + e] = c;
            if (c != 0) atomicAdd(&ws.tpe_local[e], c);  // integer sum: the same in any order
        }
        __syncthreads();
    }
}

// 2. All-gather of the counts: row `rank` of every peer's tpe_all region, barrier, copy into the plan. Run by every
// thread of one block; `counts` [E] is this rank's histogram.
FLATEP_DEVICE void publish_counts(const Layout& l, int rank, const SymmetricLayout& sym, const PeerPointers& peers,
                                  const PlanView& p, const int32_t* counts, const sync::SyncArgs& sync, int num_tokens,
                                  PlannerKind kind) {
    const int R = l.num_ranks, E = l.num_experts;
    if (threadIdx.x == 0) {
        p.header[kHeaderNumTokens] = num_tokens;
        p.header[kHeaderPlanner] = int32_t(kind);
    }
    for (int64_t i = threadIdx.x; i < int64_t(R) * E; i += blockDim.x) {
        const int d = int(i / E), e = int(i % E);
        region_at<int32_t>(peers.ptr[d], sym.tpe_all_offset)[int64_t(rank) * E + e] = counts[e];
    }
    sync::device::block_barrier(sync, sync::kOpPlan, threadIdx.x);
    const int32_t* all = region_at<const int32_t>(peers.ptr[rank], sym.tpe_all_offset);
    for (int64_t i = threadIdx.x; i < int64_t(R) * E; i += blockDim.x) p.tpe_all[i] = all[i];
}

__global__ void allgather_kernel(Layout l, int rank, SymmetricLayout sym, PeerPointers peers, PlanView p,
                                 const int32_t* tpe_local, sync::SyncArgs sync, int num_tokens, PlannerKind kind) {
    publish_counts(l, rank, sym, peers, p, tpe_local, sync, num_tokens, kind);
}

// 1 and 2 in one block, for a call of at most kFusedEntries entries (decode): the segments' histograms one after the
// other in shared memory, the rank's total beside them, the first bad expert id kept in shared memory, then the
// all-gather. One kernel where the general path runs two memsets, the histogram and the all-gather: at s = 128 on
// 8 virtual ranks each node is a launch on the op's critical path.
__global__ void counts_kernel(Layout l, int rank, const void* topk_idx, int index_bytes, int num_tokens, int seg_tokens,
                              SymmetricLayout sym, PeerPointers peers, PlanView p, PlanWorkspace ws,
                              sync::SyncArgs sync, PlannerKind kind) {
    extern __shared__ int32_t counts_smem[];  // [E] the segment's histogram, [E] the rank's total
    __shared__ unsigned long long bad_s;
    const int E = l.num_experts;
    int32_t* hist = counts_smem;
    int32_t* total = counts_smem + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) total[e] = 0;
    if (threadIdx.x == 0) bad_s = ~0ull;
    const int last_seg = ceil_div(num_tokens, seg_tokens);
    for (int b = 0; b < last_seg; ++b) {
        count_segment(l, topk_idx, index_bytes, num_tokens, seg_tokens, b, hist, &bad_s);
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            ws.seg_counts[int64_t(b) * E + e] = hist[e];
            total[e] += hist[e];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *ws.first_bad = bad_s;  // read by unpack_kernel, after the routing's barrier
    publish_counts(l, rank, sym, peers, p, total, sync, num_tokens, kind);
}

// ------------------------------------------------------------------------------------------------------------
// 4. Routing: destination (rank, row) of every entry; the per-expert index j of an entry is its position among the
// entries of the same expert in (token, k) order: segment base (sum of earlier segments' counts) + earlier warps of
// the segment + earlier lanes (match_any) + earlier steps of the warp. Then the chain push per token.
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(Layout l, int rank, const void* topk_idx, int index_bytes, int num_tokens, int seg_tokens,
                 SymmetricLayout sym, PeerPointers peers, PlanView p, PlanWorkspace ws, sync::SyncArgs sync,
                 bool barrier_after) {
    extern __shared__ int32_t warp_hist[];  // [kRouteWarps][E]
    __shared__ int32_t seg_rank[kSegmentEntries];
    __shared__ int32_t seg_row[kSegmentEntries];
    const int E = l.num_experts, K = l.topk;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int nseg = ceil_div(l.num_tokens, seg_tokens);
    const int last_seg = ceil_div(num_tokens, seg_tokens);
    for (int b = blockIdx.x; b < nseg && b < last_seg; b += gridDim.x) {
        const WarpRange range = warp_range(l, seg_tokens, num_tokens, b, warp, kRouteWarps);
        int32_t* hist = warp_hist + warp * E;
        for (int e = lane; e < E; e += 32) hist[e] = 0;
        __syncwarp();
        for (int64_t i = range.begin + lane; i < range.end; i += 32) {
            const int64_t id = read_expert(topk_idx, index_bytes, i);
            if (id >= 0 && id < E) atomicAdd(&hist[id], 1);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            int32_t run = 0;
            for (int b2 = 0; b2 < b; ++b2) run += ws.seg_counts[int64_t(b2) * E + e];
            for (int w = 0; w < kRouteWarps; ++w) {
                const int32_t c = warp_hist[w * E + e];
                warp_hist[w * E + e] = run;
                run += c;
            }
        }
        __syncthreads();
        const int64_t seg_base = int64_t(b) * seg_tokens * K;
        for (int64_t base = range.begin; base < range.end; base += 32) {
            const int64_t i = base + lane;
            int id = -1;
            if (i < range.end) {
                const int64_t raw = read_expert(topk_idx, index_bytes, i);
                id = (raw >= 0 && raw < E) ? int(raw) : -2;
            }
            const unsigned mask = __match_any_sync(kFull, id);
            if (id >= 0) {
                const int j = hist[id] + __popc(mask & ((1u << lane) - 1u));
                const EntryPlace place = place_entry(l, p, rank, id, j);
                p.entry_rank[i] = place.rank;
                p.entry_row[i] = place.row;
                seg_rank[i - seg_base] = place.rank;
                seg_row[i - seg_base] = place.row;
            } else if (id == -2) {
                p.entry_rank[i] = -1;
                p.entry_row[i] = -1;
                seg_rank[i - seg_base] = -1;
                seg_row[i - seg_base] = -1;
            }
            __syncwarp();
            if (id >= 0 && lane == 31 - __clz(mask)) hist[id] += __popc(mask);
            __syncwarp();
        }
        __syncthreads();
        // Chain push: for token t and destination d, the entries of t on d in ascending k.
        const int64_t t0 = int64_t(b) * seg_tokens;
        const int64_t t1 = min_of<int64_t>(t0 + seg_tokens, num_tokens);
        for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x)
            push_token_chains(sym, peers.ptr, seg_rank + (t - t0) * K, seg_row + (t - t0) * K, K);
        __syncthreads();
    }
    // A grid of one block (a call of one segment) meets the peers itself: the barrier node the launch would add
    // after it is one more launch on a decode step's critical path.
    if (barrier_after) sync::device::block_barrier(sync, sync::kOpPlan, threadIdx.x);
}

// 5. Unpack: the staging of the real rows of every group into the plan (classify_row); -1 elsewhere. And the status
// word of the first bad expert id.
__global__ void unpack_kernel(Layout l, int rank, SymmetricLayout sym, PeerPointers peers, PlanView p, PlanWorkspace ws,
                              int32_t* status, int32_t* host_status) {
    const int32_t* head = region_at<const int32_t>(peers.ptr[rank], sym.row_head_offset);
    const int32_t* next = region_at<const int32_t>(peers.ptr[rank], sym.row_next_offset);
    for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < l.num_recv_rows;
         r += int64_t(gridDim.x) * blockDim.x) {
        const bool real = classify_row(l, p, rank, r) == kRowReal;
        const int32_t h = real ? head[r] : -1, nx = real ? next[r] : -1;
        p.row_head[r] = h;
        p.row_next[r] = nx;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const unsigned long long bad = *ws.first_bad;
        if (bad != ~0ull) {
            sync::device::record_status(status, sync::kStatusBadExpert, int32_t(bad >> 32), int32_t(uint32_t(bad)), -1);
            sync::device::record_status(host_status, sync::kStatusBadExpert, int32_t(bad >> 32), int32_t(uint32_t(bad)),
                                        -1);
        }
    }
}

}  // namespace

size_t plan_kernels_workspace_bytes(const Layout& l) { return size_t(plan_workspace_sizes(l).total) * sizeof(int32_t); }

void* prepare_plan(const PlanArgs& a, size_t workspace_bytes, cudaStream_t stream) {
    return a.workspace != nullptr ? a.workspace : scratch_buffer(1000 + a.rank, workspace_bytes, stream);
}

void launch_plan_counts(const PlanArgs& a, void* workspace, cudaStream_t stream, int num_sms) {
    const Layout& l = a.layout;
    const auto [ws, sym, peers, seg_tokens] = plan_launch(a, workspace);
    const int E = l.num_experts;
    if (fused_counts(l, a.num_tokens)) {
        const size_t smem = 2 * sizeof(int32_t) * size_t(E);
        allow_smem(reinterpret_cast<const void*>(counts_kernel), smem);
        counts_kernel<<<1, kCountsThreads, smem, stream>>>(l, a.rank, a.topk_idx, a.index_bytes, a.num_tokens,
                                                           seg_tokens, sym, peers, a.plan, ws, a.sync, a.planner);
        FLATEP_CUDA_CHECK_LAUNCH();
        return;
    }
    FLATEP_CUDA_CHECK(cudaMemsetAsync(ws.tpe_local, 0, sizeof(int32_t) * E, stream));
    FLATEP_CUDA_CHECK(cudaMemsetAsync(ws.first_bad, 0xff, sizeof(unsigned long long), stream));
    const int hist_blocks = grid_blocks(num_sms, num_segments(l), 4);
    histogram_kernel<<<hist_blocks, 256, sizeof(int32_t) * E, stream>>>(l, a.topk_idx, a.index_bytes, a.num_tokens,
                                                                        seg_tokens, ws);
    FLATEP_CUDA_CHECK_LAUNCH();
    allgather_kernel<<<1, 512, 0, stream>>>(l, a.rank, sym, peers, a.plan, ws.tpe_local, a.sync, a.num_tokens,
                                            a.planner);
    FLATEP_CUDA_CHECK_LAUNCH();
}

void launch_plan_routes(const PlanArgs& a, void* workspace, cudaStream_t stream, int num_sms) {
    const Layout& l = a.layout;
    const auto [ws, sym, peers, seg_tokens] = plan_launch(a, workspace);
    const int E = l.num_experts;
    bool met = false;  // the barrier ran in the routing's only block
    if (a.num_tokens > 0) {
        const size_t smem = sizeof(int32_t) * size_t(kRouteWarps) * E;
        allow_smem(reinterpret_cast<const void*>(route_kernel), smem);
        const int route_blocks = grid_blocks(num_sms, ceil_div(a.num_tokens, seg_tokens), 2);
        met = route_blocks == 1 && a.sync.num_ranks > 1;
        route_kernel<<<route_blocks, kRouteThreads, smem, stream>>>(l, a.rank, a.topk_idx, a.index_bytes, a.num_tokens,
                                                                    seg_tokens, sym, peers, a.plan, ws, a.sync, met);
        FLATEP_CUDA_CHECK_LAUNCH();
    }
    if (!met) launch_barrier(a.sync, sync::kOpPlan, stream);
    const int unpack_blocks = grid_blocks(num_sms, ceil_div(l.num_recv_rows, 256), 8);
    unpack_kernel<<<unpack_blocks, 256, 0, stream>>>(l, a.rank, sym, peers, a.plan, ws, a.sync.status,
                                                     a.sync.host_status);
    FLATEP_CUDA_CHECK_LAUNCH();
}

FLATEP_PRELOAD_KERNELS(histogram_kernel, allgather_kernel, counts_kernel, route_kernel, unpack_kernel);

}  // namespace flatep::kernels
