// CUDA plan op. See plan.cuh for the pipeline; the parallel planner below reproduces planner_core.hpp's
// plan_alloc / derive_plan step by step (same selections, same tie rules), with the O(R*E) loops spread over a block
// and every candidate of the balanced planner run by its own warp. Integer arithmetic only, so the plan is bitwise
// the host planner's.
#include <atomic>

#include "common/check.hpp"
#include "kernels/common/barrier.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/plan/plan.cuh"
#include "planner/planner_core.hpp"

namespace flatep::kernels {

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kRouteThreads = 256;  // 8 warps per routing block
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kSegmentEntries = 2048;  // entries (whole tokens) per routing segment, at most
constexpr int kPlannerThreads = 1024;
constexpr size_t kMaxPlannerSmem = 200 * 1024;

std::atomic<int> g_engine{int(PlannerEngine::kParallel)};

// ------------------------------------------------------------------------------------------------------------
// Workspace (int32 words, every array 64-word aligned).
struct PlanWorkspace {
    int32_t* tpe_local;             // [E] this rank's histogram
    int32_t* seg_counts;            // [num_segments][E] histogram of every routing segment
    unsigned long long* first_bad;  // (flat index << 32 | uint32 value) of the first bad expert id; ~0 if none
    int32_t* serial_ws;             // planner_core workspace (serial engine)
    planner_core::PlanQuality* cand_quality;  // [max_candidates] quality of every balanced-planner candidate
    int32_t* cand_meta;                       // [kMetaWords] the greedy's quality and the number of candidates
};

// cand_meta words.
enum CandidateMeta : int { kMetaMakespan = 0, kMetaReplicas, kMetaMovedLo, kMetaMovedHi, kMetaCount, kMetaWords = 8 };

// Upper bound of the greedy's makespan: a rank hosts at most epn replicas and the E experts have at most E copies.
int max_candidates(const Layout& l) { return planner_core::num_candidates(l.num_experts); }

int segment_tokens(const Layout& l) { return l.topk >= kSegmentEntries ? 1 : kSegmentEntries / l.topk; }
int num_segments(const Layout& l) { return ceil_div(l.num_tokens, segment_tokens(l)); }

struct WorkspaceSizes {
    int64_t tpe_local, seg_counts, first_bad, serial_ws, cand_quality, cand_meta, total;
};

WorkspaceSizes workspace_sizes(const Layout& l) {
    WorkspaceSizes s{};
    int64_t at = 0;
    auto take = [&at](int64_t words) {
        const int64_t start = at;
        at += (words + 63) / 64 * 64;
        return start;
    };
    s.tpe_local = take(l.num_experts);
    s.seg_counts = take(int64_t(num_segments(l)) * l.num_experts);
    s.first_bad = take(2);
    s.serial_ws = take(int64_t(l.num_ranks) * l.num_experts + planner_core::planner_workspace_words(l));
    s.cand_quality = take(int64_t(max_candidates(l)) * int64_t(sizeof(planner_core::PlanQuality) / 4));
    s.cand_meta = take(kMetaWords);
    s.total = at;
    return s;
}

PlanWorkspace make_plan_workspace(const Layout& l, void* base) {
    const WorkspaceSizes s = workspace_sizes(l);
    int32_t* w = static_cast<int32_t*>(base);
    PlanWorkspace p{};
    p.tpe_local = w + s.tpe_local;
    p.seg_counts = w + s.seg_counts;
    p.first_bad = reinterpret_cast<unsigned long long*>(w + s.first_bad);
    p.serial_ws = w + s.serial_ws;
    p.cand_quality = reinterpret_cast<planner_core::PlanQuality*>(w + s.cand_quality);
    p.cand_meta = w + s.cand_meta;
    return p;
}

FLATEP_DEVICE int64_t read_expert(const void* topk_idx, int index_bytes, int64_t flat) {
    return index_bytes == 8 ? static_cast<const int64_t*>(topk_idx)[flat] : static_cast<const int32_t*>(topk_idx)[flat];
}

FLATEP_DEVICE int32_t clamp_to_int32(int64_t v) {
    return int32_t(v < INT32_MIN ? INT32_MIN : (v > INT32_MAX ? INT32_MAX : v));
}

// Entries of routing segment b handled by warp w: [begin, end) in flat (t*K+k) order.
struct WarpRange {
    int64_t begin, end;
};
FLATEP_DEVICE WarpRange warp_range(const Layout& l, int seg_tokens, int num_tokens, int b, int w) {
    const int64_t t0 = int64_t(b) * seg_tokens;
    const int64_t t1 = min_of<int64_t>(t0 + seg_tokens, num_tokens);
    const int64_t e0 = t0 * l.topk, e1 = t1 > t0 ? t1 * l.topk : e0;
    const int64_t per_warp = ceil_div<int64_t>(int64_t(seg_tokens) * l.topk, kRouteWarps);
    const int64_t begin = min_of<int64_t>(e0 + w * per_warp, e1);
    return WarpRange{begin, min_of<int64_t>(begin + per_warp, e1)};
}

// ------------------------------------------------------------------------------------------------------------
// 1. Histogram: per-segment counts (for the deterministic per-expert index of routing) and the rank's total.
__global__ void histogram_kernel(Layout l, const void* topk_idx, int index_bytes, int num_tokens, int seg_tokens,
                                 PlanWorkspace ws) {
    extern __shared__ int32_t hist[];  // [E]
    const int E = l.num_experts;
    const int nseg = ceil_div(l.num_tokens, seg_tokens);
    for (int b = blockIdx.x; b < nseg; b += gridDim.x) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
        __syncthreads();
        const int64_t t0 = int64_t(b) * seg_tokens;
        const int64_t t1 = min_of<int64_t>(t0 + seg_tokens, num_tokens);
        for (int64_t i = t0 * l.topk + threadIdx.x; i < t1 * l.topk; i += blockDim.x) {
            const int64_t id = read_expert(topk_idx, index_bytes, i);
            if (id >= 0 && id < E) {
                atomicAdd(&hist[id], 1);
            } else {
                atomicMin(ws.first_bad, (static_cast<unsigned long long>(i) << 32) | uint32_t(clamp_to_int32(id)));
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            const int32_t c = hist[e];
            ws.seg_counts[int64_t(b) * E + e] = c;
            if (c != 0) atomicAdd(&ws.tpe_local[e], c);  // integer sum: the same in any order
        }
        __syncthreads();
    }
}

// 2. All-gather of the counts: row `rank` of every peer's tpe_all region, barrier, copy into the plan.
__global__ void allgather_kernel(Layout l, int rank, SymmetricLayout sym, PeerPointers peers, PlanView p,
                                 const int32_t* tpe_local, SyncArgs sync, int num_tokens, PlannerKind kind) {
    const int R = l.num_ranks, E = l.num_experts;
    if (threadIdx.x == 0) {
        p.header[kHeaderNumTokens] = num_tokens;
        p.header[kHeaderPlanner] = int32_t(kind);
    }
    for (int64_t i = threadIdx.x; i < int64_t(R) * E; i += blockDim.x) {
        const int d = int(i / E), e = int(i % E);
        reinterpret_cast<int32_t*>(peers.ptr[d] + sym.tpe_all_offset)[int64_t(rank) * E + e] = tpe_local[e];
    }
    block_barrier(sync, kOpPlan, threadIdx.x);
    const int32_t* all = reinterpret_cast<const int32_t*>(peers.ptr[rank] + sym.tpe_all_offset);
    for (int64_t i = threadIdx.x; i < int64_t(R) * E; i += blockDim.x) p.tpe_all[i] = all[i];
}

// ------------------------------------------------------------------------------------------------------------
// 3. The planner.

// Keys for warp arg-max with ties to the lower index: larger value first, then lower index. 0 = no candidate.
FLATEP_DEVICE uint64_t arg_key(uint32_t value, int index) {
    return (uint64_t(value) << 32) | uint32_t(0xffffffffu - uint32_t(index));
}
FLATEP_DEVICE int key_index(uint64_t key) { return int(0xffffffffu - uint32_t(key)); }
FLATEP_DEVICE uint32_t key_value(uint64_t key) { return uint32_t(key >> 32); }

FLATEP_DEVICE uint64_t warp_max_u64(uint64_t v) {
    for (int o = 16; o > 0; o >>= 1) {
        const uint64_t u = __shfl_xor_sync(kFull, v, o);
        v = u > v ? u : v;
    }
    return v;
}

// Shared state of the planner block.
struct PlannerShared {
    int32_t load[kMaxRanks];        // greedy: current load
    int32_t group_load[kMaxRanks];  // G_r
    int32_t target[kMaxRanks];
    int32_t room[kMaxRanks];  // unused by the parallel engine (planner_core::Workspace completeness)
    int32_t excess[kMaxRanks];
    int32_t num_in[kMaxRanks];
    int32_t num_out[kMaxRanks];
    int32_t loads_after[kMaxRanks];
    int32_t loads_before[kMaxRanks];
    unsigned long long n;
    unsigned long long kept;
    unsigned long long on_source;
    int32_t greedy_makespan, greedy_replicas;
    int64_t greedy_moved;
    int32_t winner;  // warp holding the chosen candidate, -1 = keep the greedy
    int32_t stop;
};

// derive_plan, spread over the block.
FLATEP_DEVICE void derive_plan_block(const Layout& l, const PlanView& p, PlannerShared& sh, int tid, int nthreads) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    const int lane = tid % 32, warp = tid / 32, num_warps = nthreads / 32;
    if (tid < kMaxRanks) {
        sh.loads_after[tid] = sh.loads_before[tid] = sh.num_in[tid] = sh.num_out[tid] = 0;
    }
    if (tid == 0) sh.on_source = sh.kept = 0;
    __syncthreads();
    for (int e = tid; e < E; e += nthreads) {
        int32_t spill = 0, take = 0, total = 0, kept = 0;
        const int h = e / epn;
        for (int d = 0; d < R; ++d) {
            const int32_t t = p.tpe_all[d * E + e], a = p.alloc[d * E + e];
            const int32_t k = t < a ? t : a;
            p.keep[d * E + e] = k;
            p.spill_start[d * E + e] = spill;
            p.take_start[d * E + e] = take;
            spill += t - k;
            take += a - k;
            total += t;
            kept += k;
            if (a != 0) atomicAdd(&sh.loads_after[d], a);
            if (a > 0 && h != d) {
                atomicAdd(&sh.num_in[d], 1);
                atomicAdd(&sh.num_out[h], 1);
            }
        }
        if (total != 0) atomicAdd(&sh.loads_before[h], total);
        atomicAdd(&sh.on_source, (unsigned long long)kept);
        atomicAdd(&sh.kept, (unsigned long long)total);  // kept doubles as entries_total here
    }
    for (int64_t i = tid; i < int64_t(R) * E; i += nthreads) p.group_row[i] = -1;
    // Slots: replica experts of rank d in ascending id, then -1.
    for (int d = warp; d < R; d += num_warps) {
        int count = 0;
        for (int base = 0; base < E; base += 32) {
            const int e = base + lane;
            const bool pred = e < E && p.alloc[d * E + e] > 0 && e / epn != d;
            const unsigned b = __ballot_sync(kFull, pred);
            const int pos = count + __popc(b & ((1u << lane) - 1u));
            if (pred && pos < epn) p.slot_expert[d * epn + pos] = e;
            count += __popc(b);
        }
        for (int j = count + lane; j < epn; j += 32) p.slot_expert[d * epn + j] = -1;
    }
    __syncthreads();
    for (int d = tid; d < R; d += nthreads) {
        int32_t row = 0;
        for (int g = 0; g < 2 * epn; ++g) {
            const int e = g < epn ? d * epn + g : p.slot_expert[d * epn + (g - epn)];
            if (e >= 0) {
                p.group_row[d * E + e] = row;
                row += round_up(p.alloc[d * E + e], l.align);
            }
            p.cu_seqlens[d * 2 * epn + g] = row;
        }
    }
    if (tid == 0) {
        PlanStats& st = *p.stats;
        st.entries_total = int64_t(sh.kept);
        st.entries_on_source = int64_t(sh.on_source);
        st.entries_moved = st.entries_total - st.entries_on_source;
        st.max_load_before = st.max_load_after = st.min_load_after = 0;
        st.total_replicas = st.max_replicas_in = st.max_replicas_out = 0;
        for (int r = 0; r < kMaxRanks; ++r) {
            const bool in = r < R;
            st.loads_before[r] = in ? sh.loads_before[r] : 0;
            st.loads_after[r] = in ? sh.loads_after[r] : 0;
            st.replicas_in[r] = in ? sh.num_in[r] : 0;
            st.replicas_out[r] = in ? sh.num_out[r] : 0;
        }
        for (int d = 0; d < R; ++d) {
            st.total_replicas += st.replicas_in[d];
            st.max_load_before = max_of(st.max_load_before, st.loads_before[d]);
            st.max_load_after = max_of(st.max_load_after, st.loads_after[d]);
            st.min_load_after = d == 0 ? st.loads_after[d] : min_of(st.min_load_after, st.loads_after[d]);
            st.max_replicas_in = max_of(st.max_replicas_in, st.replicas_in[d]);
            st.max_replicas_out = max_of(st.max_replicas_out, st.replicas_out[d]);
        }
        st.makespan = max_of(st.max_replicas_in, st.max_replicas_out);
    }
    __syncthreads();
}

__global__ void __launch_bounds__(kPlannerThreads)
    planner_parallel_kernel(Layout l, PlannerKind kind, PlanView p, PlanWorkspace ws, bool use_smem, bool alloc_ready) {
    __shared__ PlannerShared sh;
    extern __shared__ int32_t total[];  // [E] T_e
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    if (alloc_ready) {  // the candidate kernels below already wrote p.alloc (uniform branch: a kernel parameter)
        derive_plan_block(l, p, sh, tid, blockDim.x);
        return;
    }

    // init_home: T_e, the home allocation, group loads, N.
    if (tid < kMaxRanks) sh.load[tid] = 0;
    if (tid == 0) sh.n = 0;
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        int32_t t = 0;
        for (int s = 0; s < R; ++s) t += p.tpe_all[s * E + e];
        total[e] = t;
        const int h = e / epn;
        for (int d = 0; d < R; ++d) p.alloc[d * E + e] = d == h ? t : 0;
        if (t != 0) {
            atomicAdd(&sh.load[h], t);
            atomicAdd(&sh.n, (unsigned long long)t);
        }
    }
    __syncthreads();
    const int64_t n = int64_t(sh.n);
    if (tid < R) sh.group_load[tid] = sh.load[tid];
    if (tid == 0) {
        planner_core::Workspace w{};
        w.load = sh.load;
        w.target = sh.target;
        planner_core::fixed_targets(l, n, w);
    }
    __syncthreads();

    // One-donor greedy (planner_core::greedy_alloc), by warp 0 (the balanced planner reruns it inside plan_alloc).
    if (warp == 0 && kind == PlannerKind::kGreedy) {
        for (int fill = 0; fill < R; ++fill) {
            uint64_t kd = 0, ks = 0;
            for (int r = lane; r < R; r += 32) {
                const int32_t deficit = sh.target[r] - sh.load[r];
                if (deficit > 0) kd = max_of(kd, arg_key(uint32_t(deficit), r));
                if (deficit < 0) ks = max_of(ks, arg_key(uint32_t(-deficit), r));
            }
            kd = warp_max_u64(kd);
            ks = warp_max_u64(ks);
            if (kd == 0 || ks == 0) break;
            const int rc = key_index(kd), dn = key_index(ks);
            int32_t need = int32_t(key_value(kd));
            for (int taken = 0; need > 0 && taken < epn; ++taken) {
                uint64_t kb = 0;
                for (int e = dn * epn + lane; e < (dn + 1) * epn; e += 32) {
                    const int32_t a = p.alloc[dn * E + e];
                    if (a > 0) kb = max_of(kb, arg_key(uint32_t(a), e));
                }
                kb = warp_max_u64(kb);
                if (kb == 0) break;
                const int best = key_index(kb);
                const int32_t m = min_of(need, int32_t(key_value(kb)));
                if (lane == 0) {
                    p.alloc[dn * E + best] -= m;
                    p.alloc[rc * E + best] += m;
                    sh.load[dn] -= m;
                    sh.load[rc] += m;
                }
                __syncwarp();
                need -= m;
            }
        }
    }
    __syncthreads();

    if (kind == PlannerKind::kBalanced) {
        // The balanced planner's candidate search runs as planner_core::plan_alloc wrote it, on one thread, over
        // copies in shared memory when they fit (the block-parallel greedy above is then only a warm-up of the
        // arrays; plan_alloc redoes it serially so the result is the core's by construction).
        int32_t* tpe_s = ws.serial_ws;
        int32_t* alloc_s = p.alloc;
        int32_t* core_ws = ws.serial_ws + int64_t(R) * E;
        if (use_smem) {
            tpe_s = total;  // dynamic shared memory reused: [R*E] counts, [R*E] alloc, workspace
            alloc_s = total + R * E;
            core_ws = total + 2 * R * E;
        }
        for (int64_t i = tid; i < int64_t(R) * E; i += blockDim.x) tpe_s[i] = p.tpe_all[i];
        __syncthreads();
        if (tid == 0) planner_core::plan_alloc(l, kind, tpe_s, alloc_s, core_ws);
        __syncthreads();
        if (alloc_s != p.alloc)
            for (int64_t i = tid; i < int64_t(R) * E; i += blockDim.x) p.alloc[i] = alloc_s[i];
        __syncthreads();
    }
    derive_plan_block(l, p, sh, tid, blockDim.x);
}

// ------------------------------------------------------------------------------------------------------------
// Balanced planner, candidate-parallel: the greedy and its quality (one block), then every candidate in its own
// block over shared-memory copies of the counts and its own workspace, then select_candidate's rule and a rebuild of
// the winner. planner_core's functions run as written (one thread per candidate), so the plan is the host's bitwise
// (tests/unit/planner/test_planner_candidates.cpp checks the decomposition on the host).
constexpr int kCandidateThreads = 128;

size_t candidate_smem_bytes(const Layout& l) {
    return (size_t(l.num_ranks) * l.num_experts + size_t(planner_core::planner_workspace_words(l))) * sizeof(int32_t);
}

// Shared memory: the counts [R*E], then planner_core's workspace (its cand array holds the candidate).
FLATEP_DEVICE planner_core::Workspace load_counts(const Layout& l, const PlanView& p, int32_t* smem, int tid,
                                                  int nthreads) {
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    for (int64_t i = tid; i < re; i += nthreads) smem[i] = p.tpe_all[i];
    return planner_core::make_workspace(l, smem + re);
}

__global__ void __launch_bounds__(kCandidateThreads) greedy_quality_kernel(Layout l, PlanView p, PlanWorkspace ws) {
    extern __shared__ int32_t smem[];
    const planner_core::Workspace w = load_counts(l, p, smem, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        planner_core::greedy_alloc(l, smem, w.cand, w);
        const planner_core::PlanQuality q = planner_core::evaluate_alloc(l, smem, w.cand, w.num_in, w.num_out);
        ws.cand_meta[kMetaMakespan] = q.makespan;
        ws.cand_meta[kMetaReplicas] = q.total_replicas;
        ws.cand_meta[kMetaMovedLo] = int32_t(uint32_t(uint64_t(q.entries_moved)));
        ws.cand_meta[kMetaMovedHi] = int32_t(uint32_t(uint64_t(q.entries_moved) >> 32));
        ws.cand_meta[kMetaCount] =
            min_of(planner_core::num_candidates(q.makespan), planner_core::num_candidates(l.num_experts));
    }
    __syncthreads();
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    for (int64_t i = threadIdx.x; i < re; i += blockDim.x) p.alloc[i] = w.cand[i];
}

__global__ void __launch_bounds__(kCandidateThreads) candidate_kernel(Layout l, PlanView p, PlanWorkspace ws) {
    extern __shared__ int32_t smem[];
    const int index = blockIdx.x;
    if (index >= ws.cand_meta[kMetaCount]) return;  // uniform per block
    const planner_core::Workspace w = load_counts(l, p, smem, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        ws.cand_quality[index] = planner_core::build_candidate(l, smem, w.cand, w, index)
                                     ? planner_core::evaluate_alloc(l, smem, w.cand, w.num_in, w.num_out)
                                     : planner_core::PlanQuality{planner_core::kNoCandidate, 0, 0};
    }
}

__global__ void __launch_bounds__(kCandidateThreads) select_candidate_kernel(Layout l, PlanView p, PlanWorkspace ws) {
    extern __shared__ int32_t smem[];
    __shared__ int kept;
    if (threadIdx.x == 0) {
        planner_core::PlanQuality greedy{};
        greedy.makespan = ws.cand_meta[kMetaMakespan];
        greedy.total_replicas = ws.cand_meta[kMetaReplicas];
        greedy.entries_moved = int64_t(uint64_t(uint32_t(ws.cand_meta[kMetaMovedLo])) |
                                       (uint64_t(uint32_t(ws.cand_meta[kMetaMovedHi])) << 32));
        kept = planner_core::select_candidate(greedy, ws.cand_quality, ws.cand_meta[kMetaCount]);
    }
    __syncthreads();
    if (kept < 0) return;  // the greedy allocation is already in p.alloc
    const planner_core::Workspace w = load_counts(l, p, smem, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) planner_core::build_candidate(l, smem, w.cand, w, kept);
    __syncthreads();
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    for (int64_t i = threadIdx.x; i < re; i += blockDim.x) p.alloc[i] = w.cand[i];
}

__global__ void planner_serial_kernel(Layout l, PlannerKind kind, PlanView p, int32_t* ws) {
    planner_core::plan_alloc(l, kind, p.tpe_all, p.alloc, ws);
    planner_core::derive_plan(l, p);
}

// ------------------------------------------------------------------------------------------------------------
// 4. Routing: destination (rank, row) of every entry; the per-expert index j of an entry is its position among the
// entries of the same expert in (token, k) order: segment base (sum of earlier segments' counts) + earlier warps of
// the segment + earlier lanes (match_any) + earlier steps of the warp. Then the chain push per token.
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(Layout l, int rank, const void* topk_idx, int index_bytes, int num_tokens, int seg_tokens,
                 SymmetricLayout sym, PeerPointers peers, PlanView p, PlanWorkspace ws) {
    extern __shared__ int32_t warp_hist[];  // [kRouteWarps][E]
    __shared__ int32_t seg_rank[kSegmentEntries];
    __shared__ int32_t seg_row[kSegmentEntries];
    const int E = l.num_experts, K = l.topk;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int nseg = ceil_div(l.num_tokens, seg_tokens);
    const int last_seg = ceil_div(num_tokens, seg_tokens);
    for (int b = blockIdx.x; b < nseg && b < last_seg; b += gridDim.x) {
        const WarpRange range = warp_range(l, seg_tokens, num_tokens, b, warp);
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
        for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
            const int32_t* ranks = seg_rank + (t - t0) * K;
            const int32_t* rows = seg_row + (t - t0) * K;
            for (int k = 0; k < K; ++k) {
                const int d = ranks[k];
                if (d < 0) continue;
                bool seen = false;
                for (int k0 = 0; k0 < k && !seen; ++k0) seen = ranks[k0] == d;
                if (seen) continue;
                int32_t* head = reinterpret_cast<int32_t*>(peers.ptr[d] + sym.row_head_offset);
                int32_t* next = reinterpret_cast<int32_t*>(peers.ptr[d] + sym.row_next_offset);
                int32_t row = rows[k];
                for (int k1 = k + 1; k1 <= K; ++k1) {
                    if (k1 < K && ranks[k1] != d) continue;
                    head[row] = rows[k];
                    next[row] = k1 < K ? rows[k1] : -1;
                    if (k1 < K) row = rows[k1];
                }
            }
        }
        __syncthreads();
    }
}

// 5. Unpack: the staging of the real rows of every group into the plan; -1 elsewhere. And the status word of the
// first bad expert id.
__global__ void unpack_kernel(Layout l, int rank, SymmetricLayout sym, PeerPointers peers, PlanView p, PlanWorkspace ws,
                              int32_t* status) {
    const int E = l.num_experts, epn = l.experts_per_rank, G = l.num_groups();
    const int32_t* cu = p.cu_seqlens + int64_t(rank) * G;
    const int32_t* head = reinterpret_cast<const int32_t*>(peers.ptr[rank] + sym.row_head_offset);
    const int32_t* next = reinterpret_cast<const int32_t*>(peers.ptr[rank] + sym.row_next_offset);
    for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < l.num_recv_rows;
         r += int64_t(gridDim.x) * blockDim.x) {
        int32_t h = -1, nx = -1;
        // First group whose inclusive end is above r.
        int lo = 0, hi = G;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (cu[mid] > r) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        if (lo < G) {
            const int g = lo;
            const int32_t start = g == 0 ? 0 : cu[g - 1];
            const int expert = g < epn ? rank * epn + g : p.slot_expert[rank * epn + (g - epn)];
            const int32_t size = expert < 0 ? 0 : p.alloc[int64_t(rank) * E + expert];
            if (r - start < size) {
                h = head[r];
                nx = next[r];
            }
        }
        p.row_head[r] = h;
        p.row_next[r] = nx;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && status != nullptr) {
        const unsigned long long bad = *ws.first_bad;
        if (bad != ~0ull) record_status(status, kStatusBadExpert, int32_t(bad >> 32), int32_t(uint32_t(bad)), -1);
    }
}

void launch_planner_impl(const Layout& l, PlannerKind kind, const PlanView& p, const PlanWorkspace& ws,
                         PlannerEngine engine, cudaStream_t stream) {
    if (engine == PlannerEngine::kSerial) {
        planner_serial_kernel<<<1, 1, 0, stream>>>(l, kind, p, ws.serial_ws);
    } else {
        const size_t cand_smem = candidate_smem_bytes(l);
        const bool candidates = kind == PlannerKind::kBalanced && cand_smem <= kMaxPlannerSmem;
        if (candidates) {
            for (const void* f :
                 {reinterpret_cast<const void*>(greedy_quality_kernel), reinterpret_cast<const void*>(candidate_kernel),
                  reinterpret_cast<const void*>(select_candidate_kernel)}) {
                if (cand_smem > 48 * 1024) {
                    FLATEP_CUDA_CHECK(
                        cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(cand_smem)));
                }
            }
            greedy_quality_kernel<<<1, kCandidateThreads, cand_smem, stream>>>(l, p, ws);
            FLATEP_CUDA_CHECK_LAUNCH();
            candidate_kernel<<<max_candidates(l), kCandidateThreads, cand_smem, stream>>>(l, p, ws);
            FLATEP_CUDA_CHECK_LAUNCH();
            select_candidate_kernel<<<1, kCandidateThreads, cand_smem, stream>>>(l, p, ws);
            FLATEP_CUDA_CHECK_LAUNCH();
            planner_parallel_kernel<<<1, kPlannerThreads, size_t(l.num_experts) * sizeof(int32_t), stream>>>(
                l, kind, p, ws, false, true);
            FLATEP_CUDA_CHECK_LAUNCH();
            return;
        }
        const size_t core_smem =
            (2 * size_t(l.num_ranks) * l.num_experts + size_t(planner_core::planner_workspace_words(l))) *
            sizeof(int32_t);
        const bool use_smem = kind == PlannerKind::kBalanced && core_smem <= kMaxPlannerSmem;
        const size_t smem = max_of(size_t(l.num_experts) * sizeof(int32_t), use_smem ? core_smem : size_t(0));
        if (smem > 48 * 1024) {
            FLATEP_CUDA_CHECK(
                cudaFuncSetAttribute(planner_parallel_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        }
        planner_parallel_kernel<<<1, kPlannerThreads, smem, stream>>>(l, kind, p, ws, use_smem, false);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t plan_workspace_bytes(const Layout& l) { return size_t(workspace_sizes(l).total) * sizeof(int32_t); }

void set_planner_engine(PlannerEngine engine) { g_engine.store(int(engine)); }

void launch_planner(const Layout& l, PlannerKind kind, const PlanView& plan, void* workspace, PlannerEngine engine,
                    cudaStream_t stream) {
    FLATEP_CHECK(workspace != nullptr, "launch_planner: workspace is null");
    FLATEP_CHECK(l.num_ranks <= kMaxRanks, "launch_planner: num_ranks ", l.num_ranks, " above ", kMaxRanks);
    launch_planner_impl(l, kind, plan, make_plan_workspace(l, workspace), engine, stream);
}

void launch(const PlanArgs& a, cudaStream_t stream) {
    const Layout& l = a.layout;
    FLATEP_CHECK(a.num_tokens >= 0 && a.num_tokens <= l.num_tokens, "plan: num_tokens must be in [0, S=", l.num_tokens,
                 "], got ", a.num_tokens);
    FLATEP_CHECK(a.index_bytes == 4 || a.index_bytes == 8, "plan: index_bytes must be 4 or 8, got ", a.index_bytes);
    FLATEP_CHECK(a.num_tokens == 0 || a.topk_idx != nullptr, "plan: topk_idx is null");
    FLATEP_CHECK(a.planner == PlannerKind::kGreedy || a.planner == PlannerKind::kBalanced,
                 "plan: planner kind must be greedy (0) or balanced (1), got ", int(a.planner));
    FLATEP_CHECK(a.rank >= 0 && a.rank < l.num_ranks, "plan: rank must be in [0, ", l.num_ranks, "), got ", a.rank);
    const size_t ws_bytes = plan_workspace_bytes(l);
    void* ws_base = a.workspace != nullptr ? a.workspace : scratch_buffer(1000 + a.rank, ws_bytes, stream);
    const PlanWorkspace ws = make_plan_workspace(l, ws_base);
    const SymmetricLayout sym = make_symmetric_layout(l);
    PeerPointers peers{};
    for (int r = 0; r < l.num_ranks; ++r) peers.ptr[r] = a.peers[r];
    const int seg_tokens = segment_tokens(l);
    const int nseg = num_segments(l);
    const int E = l.num_experts;

    FLATEP_CUDA_CHECK(cudaMemsetAsync(ws.tpe_local, 0, sizeof(int32_t) * E, stream));
    FLATEP_CUDA_CHECK(cudaMemsetAsync(ws.first_bad, 0xff, sizeof(unsigned long long), stream));
    const int hist_blocks = grid_blocks(a.sync, nseg, 4);
    histogram_kernel<<<hist_blocks, 256, sizeof(int32_t) * E, stream>>>(l, a.topk_idx, a.index_bytes, a.num_tokens,
                                                                        seg_tokens, ws);
    FLATEP_CUDA_CHECK_LAUNCH();
    allgather_kernel<<<1, 512, 0, stream>>>(l, a.rank, sym, peers, a.plan, ws.tpe_local, a.sync, a.num_tokens,
                                            a.planner);
    FLATEP_CUDA_CHECK_LAUNCH();
    launch_planner_impl(l, a.planner, a.plan, ws, PlannerEngine(g_engine.load()), stream);
    if (a.num_tokens > 0) {
        const size_t smem = sizeof(int32_t) * size_t(kRouteWarps) * E;
        if (smem > 48 * 1024) {
            FLATEP_CUDA_CHECK(
                cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        }
        const int route_blocks = grid_blocks(a.sync, ceil_div(a.num_tokens, seg_tokens), 2);
        route_kernel<<<route_blocks, kRouteThreads, smem, stream>>>(l, a.rank, a.topk_idx, a.index_bytes, a.num_tokens,
                                                                    seg_tokens, sym, peers, a.plan, ws);
        FLATEP_CUDA_CHECK_LAUNCH();
    }
    launch_barrier(a.sync, kOpPlan, stream);
    const int unpack_blocks = grid_blocks(a.sync, ceil_div(l.num_recv_rows, 256), 8);
    unpack_kernel<<<unpack_blocks, 256, 0, stream>>>(l, a.rank, sym, peers, a.plan, ws, a.sync.status);
    FLATEP_CUDA_CHECK_LAUNCH();
}

void preload_plan_kernels() {
    cudaFuncAttributes attr{};
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, histogram_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, allgather_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, planner_parallel_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, planner_serial_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, greedy_quality_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, candidate_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, select_candidate_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, route_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, unpack_kernel));
}

}  // namespace flatep::kernels
