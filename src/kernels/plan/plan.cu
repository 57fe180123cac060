// CUDA plan op. See plan.cuh for the pipeline. The planner runs planner_core.hpp's own functions on a warp executor
// (every candidate of the balanced planner built by warp 0 of its own block, the O(R*E) loops split over lanes,
// every selection a warp reduction with the host's key and tie rule), then select_candidate and a block-parallel
// derive_plan. Integer arithmetic only, so the plan is bitwise the host planner's.
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "common/check.hpp"
#include "common/env.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/groups.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "kernels/plan/plan.cuh"
#include "planner/planner_core.hpp"

namespace flatep::kernels {

namespace {

constexpr int kRouteThreads = 256;  // 8 warps per routing block
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kSegmentEntries = 2048;  // entries (whole tokens) per routing segment, at most
constexpr int kPlannerThreads = 1024;
constexpr size_t kMaxPlannerSmem = 200 * 1024;

std::atomic<int> g_engine{int(PlannerEngine::kParallel)};
std::atomic<PlannerProfileRecord*> g_profile{nullptr};  // set_planner_profile; null = off

// ------------------------------------------------------------------------------------------------------------
// Profile stamps (see plan.cuh). Every kernel takes its record pointer as an argument (null when profiling is off),
// so a stamp costs one uniform branch on a kernel parameter when off.
struct Stamp {
    unsigned long long ns;
    long long clock;
};
FLATEP_DEVICE Stamp stamp_now() {
    Stamp t{};
#ifdef __CUDA_ARCH__
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t.ns));
    t.clock = clock64();
#endif
    return t;
}
FLATEP_DEVICE void put_stamp(PlannerProfileRecord* rec, int at, const Stamp& t) {
    if (rec == nullptr) return;
    rec->globaltimer[at] = t.ns;
    rec->clock[at] = t.clock;
}
FLATEP_DEVICE void profile_stamp(PlannerProfileRecord* rec, int at) {
    if (rec != nullptr) put_stamp(rec, at, stamp_now());
}
FLATEP_DEVICE int sm_id() {
    unsigned id = 0;
#ifdef __CUDA_ARCH__
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
#endif
    return int(id);
}

// Programmatic dependent launch (sm_90): the planner's second and third kernels are launched with programmatic
// stream serialisation (launch_programmatic), so they may start while the kernel before them still runs; each
// calls wait_prior_grids() before it touches anything that kernel writes or reads.
// Ordering contract: griddepcontrol.wait returns once every prerequisite grid has completed and its memory
// operations are visible to this grid. It returns at once in a kernel launched without the attribute.
// griddepcontrol.launch_dependents only allows the dependent grid to be scheduled early (it orders no memory).
FLATEP_DEVICE void wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
FLATEP_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ------------------------------------------------------------------------------------------------------------
// Workspace (int32 words, every array 64-word aligned).
struct PlanWorkspace {
    int32_t* tpe_local;             // [E] this rank's histogram
    int32_t* seg_counts;            // [num_segments][E] histogram of every routing segment
    unsigned long long* first_bad;  // (flat index << 32 | uint32 value) of the first bad expert id; ~0 if none
    int32_t* serial_ws;             // planner_core workspace (serial engine)
    planner_core::PlanQuality* cand_quality;  // [max_candidates] quality of every balanced-planner candidate
    int32_t* cand_meta;                       // [kMetaWords] the greedy's quality and the number of candidates
    int32_t* stored_alloc;                    // [stored_candidates][R*E] allocations of the first candidates
    int32_t* cand_scratch;  // [kCandidateBlocks][R*E] working allocation of candidate block b when it is not kept in
                            // shared memory and its candidate is not stored (CandidateMode::alloc_smem false)
};

// cand_meta words.
enum CandidateMeta : int { kMetaMakespan = 0, kMetaReplicas, kMetaMovedLo, kMetaMovedHi, kMetaCount, kMetaWords = 8 };

// Upper bound of the greedy's makespan: a rank hosts at most epn replicas and the E experts have at most E copies.
FLATEP_HD int max_candidates(const Layout& l) { return planner_core::num_candidates(l.num_experts); }
// The candidate kernel's grid: one pass covers every candidate up to a greedy P of 6 (num_candidates(6)).
constexpr int kCandidateBlocks = 4 + 18 * 6;
// Candidates whose allocation the candidate kernels keep: every candidate of a greedy P up to kStoredMakespan (the
// main launch's and the first overflow candidates), within 16 MiB. The winner is copied from there, or rebuilt
// (serially, after every candidate) when its index is beyond.
constexpr int kStoredMakespan = 10;
int stored_candidates(const Layout& l) {
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    const int want = min_of(planner_core::num_candidates(kStoredMakespan), max_candidates(l));
    return int(min_of<int64_t>(want, (int64_t(4) << 20) / re));
}

int segment_tokens(const Layout& l) { return l.topk >= kSegmentEntries ? 1 : kSegmentEntries / l.topk; }
int num_segments(const Layout& l) { return ceil_div(l.num_tokens, segment_tokens(l)); }

struct WorkspaceSizes {
    int64_t tpe_local, seg_counts, first_bad, serial_ws, cand_quality, cand_meta, stored_alloc, cand_scratch, total;
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
    s.stored_alloc = take(int64_t(stored_candidates(l)) * l.num_ranks * l.num_experts);
    s.cand_scratch = take(int64_t(kCandidateBlocks) * l.num_ranks * l.num_experts);
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
    p.stored_alloc = w + s.stored_alloc;
    p.cand_scratch = w + s.cand_scratch;
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
        region_at<int32_t>(peers.ptr[d], sym.tpe_all_offset)[int64_t(rank) * E + e] = tpe_local[e];
    }
    block_barrier(sync, kOpPlan, threadIdx.x);
    const int32_t* all = region_at<const int32_t>(peers.ptr[rank], sym.tpe_all_offset);
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
    int32_t load[kMaxRanks];  // greedy: current load
    int32_t target[kMaxRanks];
    int32_t num_in[kMaxRanks];
    int32_t num_out[kMaxRanks];
    int32_t loads_after[kMaxRanks];
    int32_t loads_before[kMaxRanks];
    unsigned long long n;
    unsigned long long kept;
    unsigned long long on_source;
    int32_t winner;  // index of the kept candidate, -1 = keep the greedy
};

// derive_plan, spread over the block: one pass of independent warp tasks, then the statistics. Task t < R is rank t
// (its group_row row, slot experts, group rows and cu_seqlens, loads after and replicas in, all within the warp);
// task R + c is the expert chunk [32c, 32c + 32) (keep / spill / take per cell, one expert per lane, and its sums).
// tpe and alloc: the counts and the allocation to derive from (p.tpe_all / p.alloc, or copies in shared memory).
// slot_s: E words of shared memory the function may overwrite (the slot experts, read back by the group scan).
// rec: profile record (null = off).
FLATEP_DEVICE void derive_plan_block(const Layout& l, const PlanView& p, PlannerShared& sh, int tid, int nthreads,
                                     const int32_t* tpe, const int32_t* alloc, int32_t* slot_s,
                                     PlannerProfileRecord* rec) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    const int lane = tid % 32, warp = tid / 32, num_warps = nthreads / 32;
    if (tid < kMaxRanks) sh.loads_before[tid] = sh.num_out[tid] = 0;
    if (tid == 0) sh.on_source = sh.kept = 0;
    __syncthreads();
    const int chunks = ceil_div(E, 32);
    for (int task = warp; task < R + chunks; task += num_warps) {
        if (task < R) {
            const int d = task;
            const int32_t* row = alloc + int64_t(d) * E;
            int32_t* group_row = p.group_row + int64_t(d) * E;
            // Slots: replica experts of rank d in ascending id, then -1; group_row -1 for every expert first.
            int count = 0;
            unsigned after = 0;
            for (int base = 0; base < E; base += 32) {
                const int e = base + lane;
                const int32_t a = e < E ? row[e] : 0;
                if (e < E) group_row[e] = -1;
                after += unsigned(a);
                const bool pred = a > 0 && (e < d * epn || e >= (d + 1) * epn);  // a replica on d
                const unsigned b = __ballot_sync(kFull, pred);
                const int pos = count + __popc(b & ((1u << lane) - 1u));
                if (pred && pos < epn) p.slot_expert[d * epn + pos] = slot_s[d * epn + pos] = e;
                count += __popc(b);
            }
            for (int j = count + lane; j < epn; j += 32) p.slot_expert[d * epn + j] = slot_s[d * epn + j] = -1;
            after = __reduce_add_sync(kFull, after);
            if (lane == 0) {
                sh.loads_after[d] = int32_t(after);
                sh.num_in[d] = count;
            }
            __syncwarp();  // slot_s and the -1 rows before the scan below
            // Group rows and cu_seqlens: a warp scan over the 2*epn groups.
            int32_t start = 0;
            for (int g0 = 0; g0 < 2 * epn; g0 += 32) {
                const int g = g0 + lane;
                int e = -1;
                if (g < 2 * epn) e = g < epn ? d * epn + g : slot_s[d * epn + (g - epn)];
                const int32_t size = e >= 0 ? round_up(row[e], l.align) : 0;
                int32_t incl = size;
                for (int o = 1; o < 32; o <<= 1) {
                    const int32_t v = __shfl_up_sync(kFull, incl, o);
                    if (lane >= o) incl += v;
                }
                if (e >= 0) group_row[e] = start + incl - size;
                if (g < 2 * epn) p.cu_seqlens[d * 2 * epn + g] = start + incl;
                start += __shfl_sync(kFull, incl, 31);
            }
            continue;
        }
        // Expert chunk: one expert per lane, the ranks in batches whose cells are loaded before any is stored.
        constexpr int kChunk = 8;
        const int e = (task - R) * 32 + lane;
        const bool valid = e < E;
        const int h = valid ? e / epn : -1;
        int32_t spill = 0, take = 0, total = 0, copies = 0;
        int64_t kept = 0;
        for (int d0 = 0; d0 < R; d0 += kChunk) {
            int32_t tc[kChunk], ac[kChunk];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                const int d = d0 + j;
                tc[j] = valid && d < R ? tpe[d * E + e] : 0;
                ac[j] = valid && d < R ? alloc[d * E + e] : 0;
            }
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                const int d = d0 + j;
                if (d >= R) break;  // uniform over the warp
                const int32_t t = tc[j], a = ac[j];
                const int32_t k = t < a ? t : a;
                if (valid) {
                    p.keep[d * E + e] = k;
                    p.spill_start[d * E + e] = spill;
                    p.take_start[d * E + e] = take;
                }
                spill += t - k;
                take += a - k;
                total += t;
                kept += k;
                copies += a > 0 && h != d;
            }
        }
        // Lanes of the same home rank: one atomic per rank and warp.
        const unsigned same = __match_any_sync(kFull, h);
        const unsigned group_total = __reduce_add_sync(same, unsigned(total));
        const unsigned group_copies = __reduce_add_sync(same, unsigned(copies));
        if (valid && lane == __ffs(same) - 1) {
            if (group_total != 0) atomicAdd(&sh.loads_before[h], int32_t(group_total));
            if (group_copies != 0) atomicAdd(&sh.num_out[h], int32_t(group_copies));
        }
        int64_t sum_kept = kept, sum_total = total;
        for (int o = 16; o > 0; o >>= 1) {
            sum_kept += __shfl_xor_sync(kFull, sum_kept, o);
            sum_total += __shfl_xor_sync(kFull, sum_total, o);
        }
        if (lane == 0) {
            atomicAdd(&sh.on_source, (unsigned long long)sum_kept);
            atomicAdd(&sh.kept, (unsigned long long)sum_total);  // kept doubles as entries_total here
        }
    }
    // Profile: every warp's end of its tasks (trace[8 + warp]).
    if (rec != nullptr && lane == 0 && 8 + warp < PlannerProfileRecord::kTrace) rec->trace[8 + warp] = clock64();
    __syncthreads();
    if (tid == 0) {
        profile_stamp(rec, kStampDeriveSums);
        profile_stamp(rec, kStampDeriveSlots);
    }
    if (rec != nullptr) {  // uniform: profiling only
        __syncthreads();
        if (tid == 0) profile_stamp(rec, kStampDeriveRows);
    }
    // Statistics: per-rank arrays by one thread each, the scalars by warp 0 (a reduction over the ranks) from shared
    // memory (no global read-modify-write chains).
    PlanStats& st = *p.stats;
    for (int r = tid; r < kMaxRanks; r += nthreads) {
        const bool in = r < R;
        st.loads_before[r] = in ? sh.loads_before[r] : 0;
        st.loads_after[r] = in ? sh.loads_after[r] : 0;
        st.replicas_in[r] = in ? sh.num_in[r] : 0;
        st.replicas_out[r] = in ? sh.num_out[r] : 0;
    }
    if (warp == 0) {
        int32_t total_replicas = 0, max_before = 0, max_after = 0, min_after = INT32_MAX, max_in = 0, max_out = 0;
        for (int d = lane; d < R; d += 32) {
            total_replicas += sh.num_in[d];
            max_before = max_of(max_before, sh.loads_before[d]);
            max_after = max_of(max_after, sh.loads_after[d]);
            min_after = min_of(min_after, sh.loads_after[d]);
            max_in = max_of(max_in, sh.num_in[d]);
            max_out = max_of(max_out, sh.num_out[d]);
        }
        total_replicas = __reduce_add_sync(kFull, total_replicas);
        max_before = __reduce_max_sync(kFull, max_before);
        max_after = __reduce_max_sync(kFull, max_after);
        min_after = __reduce_min_sync(kFull, min_after);
        max_in = __reduce_max_sync(kFull, max_in);
        max_out = __reduce_max_sync(kFull, max_out);
        if (lane == 0) {
            st.entries_total = int64_t(sh.kept);
            st.entries_on_source = int64_t(sh.on_source);
            st.entries_moved = st.entries_total - st.entries_on_source;
            st.max_load_before = max_before;
            st.max_load_after = max_after;
            st.min_load_after = min_after;
            st.total_replicas = total_replicas;
            st.max_replicas_in = max_in;
            st.max_replicas_out = max_out;
            st.makespan = max_of(max_in, max_out);
        }
    }
    __syncthreads();
    if (tid == 0) profile_stamp(rec, kStampDeriveEnd);
}

__global__ void __launch_bounds__(kPlannerThreads)
    planner_parallel_kernel(Layout l, PlannerKind kind, PlanView p, PlanWorkspace ws, bool use_smem,
                            PlannerProfileRecord* rec) {
    __shared__ PlannerShared sh;
    extern __shared__ int32_t total[];  // [E] T_e; greedy kind with use_smem: then the allocation [R*E]
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    if (rec != nullptr && tid == 0) {
        profile_stamp(rec, kStampEntry);
        rec->index = -1;
        rec->sm = sm_id();
    }
    // The greedy works on its allocation in shared memory when it fits (its steps are dependent reads and writes of
    // allocation cells: shared-memory latency instead of global), and copies it to the plan at the end.
    const bool alloc_in_smem = kind == PlannerKind::kGreedy && use_smem;
    int32_t* const alloc = alloc_in_smem ? total + E : p.alloc;

    // init_home: T_e, the home allocation, group loads, N.
    if (tid < kMaxRanks) sh.load[tid] = 0;
    if (tid == 0) sh.n = 0;
    __syncthreads();
    // One expert per thread; the sums are reduced over the warp first (one shared atomic per rank and warp: atomics
    // of a whole block on a few shared words serialise).
    for (int e0 = tid - lane; e0 < E; e0 += blockDim.x) {
        const int e = e0 + lane;
        const bool valid = e < E;
        int32_t t = 0;
        const int h = valid ? e / epn : -1;
        if (valid) {
            for (int s = 0; s < R; ++s) t += p.tpe_all[s * E + e];
            total[e] = t;
            for (int d = 0; d < R; ++d) alloc[d * E + e] = d == h ? t : 0;
        }
        const unsigned same = __match_any_sync(kFull, h);
        const unsigned group = __reduce_add_sync(same, unsigned(t));
        if (valid && lane == __ffs(same) - 1 && group != 0) atomicAdd(&sh.load[h], int32_t(group));
        const unsigned all = __reduce_add_sync(kFull, unsigned(t));
        if (lane == 0 && all != 0) atomicAdd(&sh.n, (unsigned long long)all);
    }
    __syncthreads();
    const int64_t n = int64_t(sh.n);
    if (tid == 0) {
        planner_core::Workspace w{};
        w.load = sh.load;
        w.target = sh.target;
        planner_core::fixed_targets(l, n, w);
        profile_stamp(rec, kStampSelLoaded);
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
                    const int32_t a = alloc[dn * E + e];
                    if (a > 0) kb = max_of(kb, arg_key(uint32_t(a), e));
                }
                kb = warp_max_u64(kb);
                if (kb == 0) break;
                const int best = key_index(kb);
                const int32_t m = min_of(need, int32_t(key_value(kb)));
                if (lane == 0) {
                    alloc[dn * E + best] -= m;
                    alloc[rc * E + best] += m;
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
    if (tid == 0) {
        profile_stamp(rec, kStampSelSelected);
        profile_stamp(rec, kStampSelCopied);
        profile_stamp(rec, kStampSelRebuilt);
    }
    if (alloc_in_smem) {
        for (int64_t i = tid; i < int64_t(R) * E; i += blockDim.x) p.alloc[i] = alloc[i];
    }
    // total[] (T_e, and the counts' copy of the balanced planner) is no longer read: it holds the slot experts.
    derive_plan_block(l, p, sh, tid, blockDim.x, p.tpe_all, alloc, total, rec);
}

// ------------------------------------------------------------------------------------------------------------
// Balanced planner, candidate-parallel. Kernel 1 (kCandidateThreads per block): every block loads the counts into
// shared memory; one runs the greedy and its quality (so select_candidate knows how many candidates to look at), the
// others build the candidates blockIdx.x, blockIdx.x + gridDim.x, ... with planner_core's own functions on the warp
// executor below (warp 0), writing each quality and (the first `stored` indices) each allocation. Kernel 2 (one block):
// select_candidate's rule, the winner's allocation (copied, or rebuilt when it was not stored), derive_plan.
// planner_core's code runs as written on both sides, so the plan is the host's bitwise; the host test
// tests/unit/planner/test_planner_candidates.cpp checks the decomposition.
constexpr int kSelectCached = 1024;  // qualities select_derive_kernel reads from shared memory

// Where the blocks of the candidate path keep the counts and the allocation they work on. Shared memory always holds
// planner_core's small arrays (planner_small_workspace_words) and home_ahead's table [E]; the counts [R*E] (read
// only: init_home, the locality receiver rule, the evaluation) and the candidate's allocation [R*E] (read and written
// by every step of the build) each in shared memory or in global memory. The arithmetic is the same either way, so
// is the plan. Every placement takes the candidate path except kShared where everything does not fit.
struct CandidateMode {
    bool candidates;   // the candidate path (else planner_parallel_kernel: plan_alloc on one thread)
    bool counts_smem;  // the counts in shared memory (else read from plan.tpe_all)
    bool alloc_smem;   // the allocation in shared memory (else ws.stored_alloc's slot or ws.cand_scratch's)
};

// Dynamic shared memory of a candidate block (and of select_derive_kernel) for a placement.
size_t candidate_smem_bytes(const Layout& l, bool counts_smem, bool alloc_smem) {
    const size_t re = size_t(l.num_ranks) * l.num_experts;
    return ((counts_smem ? re : 0) + (alloc_smem ? re : 0) + size_t(planner_core::planner_small_workspace_words(l)) +
            size_t(l.num_experts)) *
           sizeof(int32_t);
}

CandidateMode candidate_mode(const Layout& l, PlannerPlacement placement) {
    const bool all = candidate_smem_bytes(l, true, true) <= kMaxPlannerSmem;
    const bool alloc_only = candidate_smem_bytes(l, false, true) <= kMaxPlannerSmem;
    switch (placement) {
        case PlannerPlacement::kShared:
            return CandidateMode{all, true, true};
        case PlannerPlacement::kCountsGlobal:
            return CandidateMode{true, false, alloc_only};
        case PlannerPlacement::kGlobal:
            return CandidateMode{true, false, false};
        case PlannerPlacement::kAuto:
        default:
            return all ? CandidateMode{true, true, true} : CandidateMode{true, false, alloc_only};
    }
}
size_t candidate_smem_bytes(const Layout& l, const CandidateMode& m) {
    return candidate_smem_bytes(l, m.counts_smem, m.alloc_smem);
}

// Named barrier (not 0, which __syncthreads uses) between warp 0 and the other warps of a candidate block: the
// others sync on it once home_ahead's table is written (they have nothing else to do until the block's next
// barrier), warp 0 before its first read of the table. The two sides are different instructions, so the barrier is
// the non-.aligned barrier.sync (bar.sync is barrier.sync.aligned: every thread at the same instruction).
// (With bar.arrive on the writers' side, compute-sanitizer racecheck reported the block barrier after the build as
// a hazard.)
constexpr int kAheadBarrier = 1;
FLATEP_DEVICE void named_barrier_sync(int id, int threads) {
#ifdef __CUDA_ARCH__
    asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
#endif
}

// Item i of SerialExec::ahead_sums over v[0, n): the positive items before it (larger first, ties to the lower
// index) summed, -1 when v[i] <= 0. Every item is read in turn (broadcast reads, unrolled so that the loads overlap).
FLATEP_DEVICE int32_t ahead_of(const int32_t* v, int n, int i) {
    const int32_t vi = v[i];
    int32_t s = 0;
#pragma unroll 8
    for (int j = 0; j < n; ++j) {
        const int32_t a = v[j];
        s += a > 0 && (a > vi || (a == vi && j < i)) ? a : 0;
    }
    return vi > 0 ? s : -1;
}

// SerialExec::ahead_sums over v[0, n), n <= kSortItems, by one warp (every lane calls it): the items' keys (value,
// then the lower index first; 0 for items <= 0) sorted descending by a bitonic network in registers (item p = q*32 +
// lane in register q), then an exclusive prefix sum of the values in that order scattered back to the items. The
// same integers as the O(n^2) scan (sums of the same positive values), in O(n log^2 n / 32) steps per lane instead of
// O(n^2 / 32): at epn = 112 (E=896, R=8) one call took 5.4 us on the H200 and home_ahead_table 8.6 us.
constexpr int kSortItems = 128;
FLATEP_DEVICE void warp_ahead_sums_sorted(const int32_t* v, int n, int32_t* out, int lane) {
    constexpr int kPer = kSortItems / 32;
    uint64_t key[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
        const int p = q * 32 + lane;
        const int32_t a = p < n ? v[p] : 0;
        key[q] = a > 0 ? (uint64_t(uint32_t(a)) << 32) | uint64_t(0xffffffffu - uint32_t(p)) : 0;
        if (p < n && a <= 0) out[p] = -1;
    }
#pragma unroll
    for (int k = 2; k <= kSortItems; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            uint64_t next[kPer];
#pragma unroll
            for (int q = 0; q < kPer; ++q) {
                const int p = q * 32 + lane;
                const uint64_t other =
                    j >= 32 ? key[q ^ (j >> 5)] : (uint64_t)__shfl_xor_sync(kFull, (unsigned long long)key[q], j);
                const bool keep_max = ((p & j) == 0) == ((p & k) == 0);  // descending overall
                const uint64_t hi = key[q] > other ? key[q] : other, lo = key[q] > other ? other : key[q];
                next[q] = keep_max ? hi : lo;
            }
#pragma unroll
            for (int q = 0; q < kPer; ++q) key[q] = next[q];
        }
    }
    int32_t carry = 0;
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
        const int32_t a = int32_t(key[q] >> 32);
        int32_t incl = a;
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t t = __shfl_up_sync(kFull, incl, o);
            if (lane >= o) incl += t;
        }
        if (key[q] != 0) out[int(0xffffffffu - uint32_t(key[q]))] = carry + incl - a;
        carry += __shfl_sync(kFull, incl, 31);
    }
}

// home_ahead's table for every rank's home experts from T_e (SerialExec::ahead_sums per rank), by threads
// [0, nthreads) of the caller (the block's warps other than warp 0; whole warps). Large groups (epn > 64): one warp
// per rank, sorted (warp_ahead_sums_sorted); else one item per thread.
FLATEP_DEVICE void home_ahead_table(const Layout& l, const int32_t* total, int32_t* table, int t, int nthreads) {
    const int E = l.num_experts, epn = l.experts_per_rank, R = l.num_ranks;
    if (epn > 64 && epn <= kSortItems) {
        for (int r = t / 32; r < R; r += nthreads / 32)
            warp_ahead_sums_sorted(total + r * epn, epn, table + r * epn, t % 32);
        return;
    }
    for (int e = t; e < E; e += nthreads) {
        const int base = e / epn * epn;
        table[e] = ahead_of(total + base, epn, e - base);
    }
}

// Warp executor of planner_core (see "Executors" there): the 32 lanes run the planner's scalar code together with
// the same values; loops are split over the lanes and selections are warp reductions (redux.sync; up to 32 items, one
// per lane, and the lowest lane holding the maximum by ballot). Keys are compared as (high word, low word), then the
// lower index wins, exactly like SerialExec's strict '>' scan. (Every lane scanning the ranks itself was slower: 15.0
// vs 22.5 us per MoonEP candidate on the H200.) home_ready: the candidate blocks compute init_home's results with the
// whole block before warp 0 builds.
struct WarpExec {
    int lane;
    int64_t home_n = -1;  // >= 0: init_home's results for home_alloc are in place (home_ready)
    const int32_t* home_alloc = nullptr;
    long long* trace = nullptr;  // profile: clock64 after every single(), sum() and arg_max() (lane 0), up to kTrace
    int* trace_n = nullptr;
    FLATEP_HD void mark() const {
#ifdef __CUDA_ARCH__
        if (trace != nullptr && lane == 0 && *trace_n < PlannerProfileRecord::kTrace) trace[(*trace_n)++] = clock64();
#endif
    }
    // Path candidates: the other warps of the block compute home_ahead's table ([E], epn words per rank) while warp 0
    // starts, then sync on named barrier kAheadBarrier; so does warp 0 at its first home_ahead() (every lane).
    const int32_t* ahead_table = nullptr;
    int ahead_epn = 0;
    int ahead_threads = 0;  // threads of the named barrier (the block)
    mutable bool ahead_waited = false;
    FLATEP_DEVICE const int32_t* home_ahead(int r) const {
        if (ahead_table == nullptr) return nullptr;
        wait_ahead_table();
        return ahead_table + r * ahead_epn;
    }
    FLATEP_DEVICE void wait_ahead_table() const {
        if (ahead_table == nullptr || ahead_waited) return;
        named_barrier_sync(kAheadBarrier, ahead_threads);
        ahead_waited = true;
    }
    FLATEP_HD bool home_ready(const int32_t* alloc, int64_t* n) const {
        if (home_n < 0 || alloc != home_alloc) return false;
        *n = home_n;
        return true;
    }
    FLATEP_HD bool targets_ready() const { return home_n >= 0; }  // computed by the block with the home allocation
    FLATEP_HD void sync() const {
#ifdef __CUDA_ARCH__
        __syncwarp();
#endif
    }
    template <class F>
    FLATEP_HD void single(F&& f) const {
        sync();
        if (lane == 0) f();
        mark();
        sync();
    }
    template <class F>
    FLATEP_HD void for_each(int n, F&& f) const {
        sync();
        for (int i = lane; i < n; i += 32) f(i);
        sync();
    }
    template <class F>
    FLATEP_HD int64_t sum(int n, F&& f) const {
        sync();
        int64_t s = 0;
        for (int i = lane; i < n; i += 32) s += int64_t(f(i));
#ifdef __CUDA_ARCH__
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
#endif
        mark();
        return s;
    }
    template <class K>
    FLATEP_HD int arg_max(int n, K&& key) const {
        const int at = arg_max_of(n, key);
        mark();
        return at;
    }
    // Up to 32 items: the three reductions side by side (each as in arg_max, without its 32-bit shortcut, so that
    // no branch separates them); else three arg_max scans.
    template <class K>
    FLATEP_HD void arg_max3(int n, K&& key, int* out) const {
#ifdef __CUDA_ARCH__
        if (n <= 32) {
            const planner_core::Keys3 k = lane < n ? key(lane) : planner_core::Keys3{{0, 0, 0}};
            unsigned hi[3], lo[3];
#pragma unroll
            for (int j = 0; j < 3; ++j) hi[j] = __reduce_max_sync(kFull, unsigned(k.k[j] >> 32));
#pragma unroll
            for (int j = 0; j < 3; ++j)
                lo[j] = __reduce_max_sync(kFull, unsigned(k.k[j] >> 32) == hi[j] ? unsigned(k.k[j]) : 0u);
#pragma unroll
            for (int j = 0; j < 3; ++j) {
                const unsigned at = __ballot_sync(kFull, k.k[j] == ((uint64_t(hi[j]) << 32) | lo[j]));
                out[j] = (hi[j] | lo[j]) == 0 ? -1 : __ffs(at) - 1;
            }
            mark();
            return;
        }
        if (n <= 64) {
            // Two items per lane (R up to 64), each key evaluated once: per selection the maximum of the lane's two,
            // the warp maximum, then the lowest index holding it (first items, then second items), as arg_max_of.
            const planner_core::Keys3 k0 = key(lane);
            const planner_core::Keys3 k1 = lane + 32 < n ? key(lane + 32) : planner_core::Keys3{{0, 0, 0}};
#pragma unroll
            for (int j = 0; j < 3; ++j) {
                const uint64_t k = k1.k[j] > k0.k[j] ? k1.k[j] : k0.k[j];
                const unsigned hi = __reduce_max_sync(kFull, unsigned(k >> 32));
                const unsigned lo = __reduce_max_sync(kFull, unsigned(k >> 32) == hi ? unsigned(k) : 0u);
                const uint64_t best = (uint64_t(hi) << 32) | lo;
                const unsigned first = __ballot_sync(kFull, k0.k[j] == best);
                const unsigned second = __ballot_sync(kFull, k1.k[j] == best);
                out[j] = (hi | lo) == 0 ? -1 : first != 0 ? __ffs(first) - 1 : 32 + __ffs(second) - 1;
            }
            mark();
            return;
        }
#endif
        for (int j = 0; j < 3; ++j) out[j] = arg_max_of(n, [&](int i) { return key(i).k[j]; });
        mark();
    }
    template <class K>
    FLATEP_HD int arg_max_of(int n, K&& key) const {
#ifdef __CUDA_ARCH__
        if (n <= 32) {
            // One item per lane (ranks, mostly): the largest key, then the lowest lane holding it (= the lowest index).
            // Keys of 32 bits (most) need one reduction.
            const uint64_t k = lane < n ? key(lane) : 0;
            if (!__any_sync(kFull, (k >> 32) != 0)) {
                const unsigned lo = __reduce_max_sync(kFull, unsigned(k));
                return lo == 0 ? -1 : __ffs(__ballot_sync(kFull, unsigned(k) == lo)) - 1;
            }
            const unsigned hi = __reduce_max_sync(kFull, unsigned(k >> 32));
            const unsigned lo = __reduce_max_sync(kFull, unsigned(k >> 32) == hi ? unsigned(k) : 0u);
            if (hi == 0 && lo == 0) return -1;
            return __ffs(__ballot_sync(kFull, k == ((uint64_t(hi) << 32) | lo))) - 1;
        }
        if (n <= 64) {
            // Two items per lane (experts of a rank, mostly): the maximum as above, then the lowest index holding it:
            // the lowest lane among the first items, else among the second.
            const uint64_t k0 = key(lane);
            const uint64_t k1 = lane + 32 < n ? key(lane + 32) : 0;
            const uint64_t k = k1 > k0 ? k1 : k0;
            const bool wide = __any_sync(kFull, (k >> 32) != 0);
            const unsigned hi = wide ? __reduce_max_sync(kFull, unsigned(k >> 32)) : 0u;
            const unsigned lo = __reduce_max_sync(kFull, unsigned(k >> 32) == hi ? unsigned(k) : 0u);
            if (hi == 0 && lo == 0) return -1;
            const uint64_t best = (uint64_t(hi) << 32) | lo;
            const unsigned first = __ballot_sync(kFull, k0 == best);
            return first != 0 ? __ffs(first) - 1 : 32 + __ffs(__ballot_sync(kFull, k1 == best)) - 1;
        }
#endif
        uint64_t best = 0;
        int at = -1;
        for (int i = lane; i < n; i += 32) {
            const uint64_t k = key(i);
            if (k > best) {
                best = k;
                at = i;
            }
        }
#ifdef __CUDA_ARCH__
        const unsigned hi = __reduce_max_sync(kFull, unsigned(best >> 32));
        const unsigned lo = __reduce_max_sync(kFull, unsigned(best >> 32) == hi ? unsigned(best) : 0u);
        if (hi == 0 && lo == 0) return -1;
        const bool mine = best == ((uint64_t(hi) << 32) | lo);
        return int(__reduce_min_sync(kFull, mine ? unsigned(at) : 0xffffffffu));
#else
        return at;
#endif
    }
    // Only planner_core::evaluate_alloc adds, and the kernels evaluate with evaluate_alloc_block (the whole block):
    // kept for the executor contract, unreferenced.
#pragma nv_diag_suppress 177
    FLATEP_DEVICE void add(int32_t* p, int32_t v) const { atomicAdd(p, v); }
#pragma nv_diag_default 177
    // Up to 32 groups: one per lane (unrolled, so that the loads overlap); else one group after the other, its items
    // over the lanes and a warp reduction.
    FLATEP_DEVICE void group_sum(int groups, int size, const int32_t* v, int32_t* out) const {
        sync();
        if (groups <= 32) {
            if (lane < groups) {
                int32_t s = 0;
#pragma unroll 8
                for (int j = 0; j < size; ++j) s += v[lane * size + j];
                out[lane] = s;
            }
            sync();
            return;
        }
        for (int i = 0; i < groups; ++i) {
            int32_t s = 0;
            for (int j = lane; j < size; j += 32) s += v[i * size + j];
            s = __reduce_add_sync(kFull, s);
            if (lane == 0) out[i] = s;
        }
        sync();
    }
    FLATEP_DEVICE void group_max(int groups, int size, const int32_t* v, int32_t* out) const {
        sync();
        if (groups <= 32) {
            if (lane < groups) {
                int32_t m = 0;
#pragma unroll 8
                for (int j = 0; j < size; ++j) m = max_of(m, v[lane * size + j]);
                out[lane] = m;
            }
            sync();
            return;
        }
        for (int i = 0; i < groups; ++i) {
            int32_t m = 0;
            for (int j = lane; j < size; j += 32) m = max_of(m, v[i * size + j]);
            m = __reduce_max_sync(kFull, m);
            if (lane == 0) out[i] = m;
        }
        sync();
    }
    // Every lane its items, each against all n items (broadcast reads, unrolled so that the loads overlap). (Shuffling
    // register copies of the items instead was slower on the H200.)
    FLATEP_DEVICE void ahead_sums(int n, const int32_t* v, int32_t* out) const {
        sync();
        if (n <= 64) {  // both items of a lane in one pass
            const int i0 = lane, i1 = lane + 32;
            const int32_t v0 = i0 < n ? v[i0] : 0, v1 = i1 < n ? v[i1] : 0;
            int32_t s0 = 0, s1 = 0;
#pragma unroll 8
            for (int j = 0; j < n; ++j) {
                const int32_t a = v[j];
                s0 += a > 0 && (a > v0 || (a == v0 && j < i0)) ? a : 0;
                s1 += a > 0 && (a > v1 || (a == v1 && j < i1)) ? a : 0;
            }
            if (i0 < n) out[i0] = v0 > 0 ? s0 : -1;
            if (i1 < n) out[i1] = v1 > 0 ? s1 : -1;
            sync();
            return;
        }
        if (n <= kSortItems) {
            warp_ahead_sums_sorted(v, n, out, lane);
        } else {
            for (int i = lane; i < n; i += 32) out[i] = ahead_of(v, n, i);
        }
        sync();
    }
};

// Block executor for planner_core::init_home only (sum, sync, group_sum): the candidate blocks compute the home
// allocation with all their threads before warp 0 builds (WarpExec::home_ready then skips it). red: 32 int64 words of
// shared memory.
struct BlockExec {
    int tid, nthreads;
    long long* red;
    FLATEP_DEVICE void sync() const { __syncthreads(); }
    template <class F>
    FLATEP_DEVICE int64_t sum(int n, F&& f) const {
        __syncthreads();
        long long s = 0;
        for (int i = tid; i < n; i += nthreads) s += (long long)f(i);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
        if (tid % 32 == 0) red[tid / 32] = s;
        __syncthreads();
        long long t = 0;
        for (int w = 0; w < nthreads / 32; ++w) t += red[w];
        __syncthreads();
        return t;
    }
    // Warps take the groups in turn; items over the lanes, a warp reduction.
    FLATEP_DEVICE void group_sum(int groups, int size, const int32_t* v, int32_t* out) const {
        __syncthreads();
        for (int i = tid / 32; i < groups; i += nthreads / 32) {
            int32_t s = 0;
            for (int j = tid % 32; j < size; j += 32) s += v[i * size + j];
            s = __reduce_add_sync(kFull, s);
            if (tid % 32 == 0) out[i] = s;
        }
        __syncthreads();
    }
    FLATEP_DEVICE bool home_ready(const int32_t*, int64_t*) const { return false; }
};

// Copies n int32 words with 16-byte accesses when both ends allow it. Each thread issues all the loads of a batch of
// kBatch vectors before its stores, so a copy of up to kBatch * nthreads vectors is one memory round trip. Blocks of
// 1024 threads (64 registers a thread) take kWideBatch: enough for their copies, and no spills. dst2 (optional): a
// second destination written from the same loads.
constexpr int kCopyBatch = 8;
constexpr int kWideBatch = 2;
template <int kBatch = kCopyBatch>
FLATEP_DEVICE void copy_words(int32_t* dst, const int32_t* src, int64_t n, int tid, int nthreads,
                              int32_t* dst2 = nullptr) {
    int64_t done = 0;
    const uintptr_t ends =
        reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(dst2);
    if ((ends & 15) == 0) {
        const int4* s4 = reinterpret_cast<const int4*>(src);
        int4* d4 = reinterpret_cast<int4*>(dst);
        int4* d4b = reinterpret_cast<int4*>(dst2);
        const int64_t n4 = n / 4;
        for (int64_t i0 = tid; i0 < n4; i0 += int64_t(kBatch) * nthreads) {
            int4 v[kBatch];
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                const int64_t i = i0 + int64_t(j) * nthreads;
                if (i < n4) v[j] = s4[i];
            }
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                const int64_t i = i0 + int64_t(j) * nthreads;
                if (i < n4) d4[i] = v[j];
                if (i < n4 && d4b != nullptr) d4b[i] = v[j];
            }
        }
        done = n4 * 4;
    }
    for (int64_t i = done + tid; i < n; i += nthreads) {
        const int32_t v = src[i];
        dst[i] = v;
        if (dst2 != nullptr) dst2[i] = v;
    }
}

// Allocation in global memory (CandidateMode::alloc_smem false): candidate `index` is built in its stored slot when
// index < stored, else in ws.cand_scratch's slot of the block building it: block b of the main launch builds candidate
// b; block b of the overflow launch builds G + b, 2G + b, ... (G = main_blocks). So the allocation of an unstored
// candidate is still in its slot after the candidate kernels when no later candidate of the same slot was built
// (select_derive_kernel then copies it instead of rebuilding it): scratch_slot returns the slot, or -1 when it was
// overwritten.
FLATEP_HD int scratch_slot(int index, int main_blocks, int count) {
    const int b = index < main_blocks ? index : (index - main_blocks) % main_blocks;
    const int first_overflow = main_blocks + b;  // the slot's first overflow candidate
    const int last =
        first_overflow < count ? first_overflow + (count - 1 - first_overflow) / main_blocks * main_blocks : b;
    return last == index ? b : -1;
}

// Shared memory of a candidate block (and of select_derive_kernel), by CandidateMode. Everything in shared memory:
// the counts [R*E], then planner_core's workspace (its cand array holds the candidate), then home_ahead's table [E].
// Else: the counts [R*E] (counts_smem), the allocation [R*E] (alloc_smem), planner_core's small arrays, the table.
// `cand` is then null where the allocation lives in global memory (the caller points w.cand at it per candidate).
struct CandidateSmem {
    const int32_t* counts;  // shared memory, or plan.tpe_all
    planner_core::Workspace w;
    int32_t* table;  // [E]: home_ahead's table (candidates), the slot experts (select_derive_kernel)
};
FLATEP_DEVICE CandidateSmem carve_candidate_smem(const Layout& l, const PlanView& p, const CandidateMode& m,
                                                 int32_t* smem) {
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    CandidateSmem c{};
    if (m.counts_smem && m.alloc_smem) {
        c.counts = smem;
        c.w = planner_core::make_workspace(l, smem + re);
        c.table = smem + re + planner_core::planner_workspace_words(l);
        return c;
    }
    int32_t* at = smem;
    c.counts = p.tpe_all;
    if (m.counts_smem) {
        c.counts = at;
        at += re;
    }
    int32_t* cand = nullptr;
    if (m.alloc_smem) {
        cand = at;
        at += re;
    }
    c.w = planner_core::make_workspace_split(l, at, cand);
    c.table = at + planner_core::planner_small_workspace_words(l);
    return c;
}

// planner_core::evaluate_alloc over the whole block (every thread gets the quality). The quality is a count, a sum
// and a maximum of integers, so any split of the work gives the same value. Uses num_in / num_out [R] as
// evaluate_alloc does and `moved` (shared). Begins and ends with a block barrier.
FLATEP_DEVICE planner_core::PlanQuality evaluate_alloc_block(const Layout& l, const int32_t* tpe_all,
                                                             const int32_t* alloc, int32_t* num_in, int32_t* num_out,
                                                             unsigned long long& moved, int tid, int nthreads) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    for (int r = tid; r < R; r += nthreads) num_in[r] = num_out[r] = 0;
    if (tid == 0) moved = 0;
    __syncthreads();
    int64_t off = 0;
    for (int e = tid; e < E; e += nthreads) {
        const int h = e / epn;
        int32_t copies = 0;
        for (int d = 0; d < R; ++d) {
            const int32_t a = alloc[d * E + e];
            const int32_t t = tpe_all[d * E + e];
            off += t - (t < a ? t : a);
            if (a > 0 && d != h) {
                atomicAdd(&num_in[d], 1);
                ++copies;
            }
        }
        if (copies != 0) atomicAdd(&num_out[h], copies);
    }
    for (int o = 16; o > 0; o >>= 1) off += __shfl_xor_sync(kFull, off, o);
    if (tid % 32 == 0 && off != 0) atomicAdd(&moved, (unsigned long long)off);
    __syncthreads();
    planner_core::PlanQuality q{0, 0, int64_t(moved)};
    for (int r = 0; r < R; ++r) {
        q.total_replicas += num_in[r];
        q.makespan = max_of(q.makespan, max_of(num_in[r], num_out[r]));
    }
    __syncthreads();  // the workspace may be overwritten after this
    return q;
}

// The home allocation (init_home) and the fixed targets of the counts in shared memory, computed by the whole block
// for warp 0's candidate (x then reports them ready). Begins and ends with a block barrier.
FLATEP_DEVICE void prepare_home(WarpExec& x, const BlockExec& bx, const Layout& l, const int32_t* counts,
                                const planner_core::Workspace& w) {
    x.home_n = planner_core::init_home(bx, l, counts, w.cand, w);
    x.home_alloc = w.cand;
    if (bx.tid == 0) planner_core::fixed_targets(l, x.home_n, w);
    __syncthreads();
}

// Candidate blocks: kCandidateThreads threads. Warp 0 builds the candidate (planner_core on the warp executor: its
// sequential steps are latency-bound and gain nothing from more threads); the whole block loads the counts, computes
// the home allocation (init_home on BlockExec), stores the allocation and evaluates it (the O(R*E) passes). Setting
// kCandidateThreads to 32 gives the one-warp blocks.
constexpr int kCandidateThreads = 128;
static_assert(kCandidateThreads % 32 == 0 && kCandidateThreads <= 1024, "whole warps");

// Main launch (first == 0, gridDim.x = G + 1): block G runs the greedy (the plan when no candidate is kept, and
// its quality, which bounds how many candidates select_candidate looks at); blocks [0, G) build candidate
// blockIdx.x at once, whether or not the greedy's bound will include it, so nothing waits for the greedy.
// Overflow launch (first == G): the candidates [G, count) the greedy's bound asks for, grid-stride; its blocks
// return at once when count <= G (the usual case).
// prof: the profile records (null = off): one per candidate index, then the greedy block's.
__global__ void __launch_bounds__(kCandidateThreads)
    candidates_kernel(Layout l, PlanView p, PlanWorkspace ws, int stored, int first, CandidateMode mode,
                      PlannerProfileRecord* prof) {
    extern __shared__ int4 smem_words[];  // 16-byte aligned
    __shared__ unsigned long long moved;
    __shared__ int built;
    __shared__ long long red[32];
    __shared__ int trace_n;
    const Stamp entry = prof != nullptr ? stamp_now() : Stamp{};
    int32_t* smem = reinterpret_cast<int32_t*>(smem_words);
    const int tid = threadIdx.x, nthreads = blockDim.x, warp = tid / 32;
    WarpExec x{tid % 32};
    const BlockExec bx{tid, nthreads, red};
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    const bool greedy_block = first == 0 && blockIdx.x == gridDim.x - 1;
    allow_dependent_launch();  // the next kernel waits for this grid's completion itself (wait_prior_grids)
    int begin = 0, end = 0, step = 1;
    if (first == 0) {
        begin = blockIdx.x;
        end = min_of(begin + 1, max_candidates(l));
    } else {
        wait_prior_grids();  // the main launch's candidates, and the greedy's count
        begin = first + blockIdx.x;
        end = ws.cand_meta[kMetaCount];
        step = gridDim.x;
    }
    if (!greedy_block && begin >= end) return;  // uniform over the block
    const CandidateSmem cs = carve_candidate_smem(l, p, mode, smem);
    planner_core::Workspace w = cs.w;
    const int32_t* const counts = cs.counts;
    int32_t* const ahead_s = cs.table;  // [E] home_ahead's table
    if (mode.counts_smem) copy_words(const_cast<int32_t*>(counts), p.tpe_all, re, tid, nthreads);
    __syncthreads();
    const Stamp loaded = prof != nullptr ? stamp_now() : Stamp{};
    if (greedy_block) {
        PlannerProfileRecord* rec = prof != nullptr ? prof + max_candidates(l) : nullptr;
        if (!mode.alloc_smem) w.cand = p.alloc;  // the greedy's plan is built where the plan keeps it
        prepare_home(x, bx, l, counts, w);       // the whole block; warp 0 then skips init_home and fixed_targets
        if (warp == 0) planner_core::greedy_alloc(x, l, counts, w.cand, w);
        __syncthreads();
        if (tid == 0) profile_stamp(rec, kStampBuilt);
        if (mode.alloc_smem) copy_words(p.alloc, w.cand, re, tid, nthreads);
        if (tid == 0) profile_stamp(rec, kStampStored);
        const planner_core::PlanQuality greedy =
            evaluate_alloc_block(l, counts, w.cand, w.num_in, w.num_out, moved, tid, nthreads);
        if (tid == 0) {
            const int count = min_of(planner_core::num_candidates(greedy.makespan), max_candidates(l));
            ws.cand_meta[kMetaMakespan] = greedy.makespan;
            ws.cand_meta[kMetaReplicas] = greedy.total_replicas;
            ws.cand_meta[kMetaMovedLo] = int32_t(uint32_t(uint64_t(greedy.entries_moved)));
            ws.cand_meta[kMetaMovedHi] = int32_t(uint32_t(uint64_t(greedy.entries_moved) >> 32));
            ws.cand_meta[kMetaCount] = count;
            if (rec != nullptr) {
                put_stamp(rec, kStampEntry, entry);
                put_stamp(rec, kStampLoaded, loaded);
                profile_stamp(rec, kStampEvaluated);
                rec->index = -1;
                rec->sm = sm_id();
                rec->flags = 1;
                rec->count = count;
            }
        }
        return;
    }
    Stamp start = entry;  // profile: where the current candidate's phases begin (tid 0)
    for (int index = begin; index < end; index += step) {
        PlannerProfileRecord* rec = prof != nullptr ? prof + index : nullptr;
        // Allocation in global memory: a stored candidate is built in its stored slot (no copy afterwards), any
        // other in the block's scratch.
        if (!mode.alloc_smem)
            w.cand =
                index < stored ? ws.stored_alloc + int64_t(index) * re : ws.cand_scratch + int64_t(blockIdx.x) * re;
        prepare_home(x, bx, l, counts, w);  // the whole block; warp 0 then skips init_home and fixed_targets
        const bool path = index < planner_core::kNumPathVariants && nthreads > 32;
        if (path && warp != 0) {
            home_ahead_table(l, w.total, ahead_s, tid - 32, nthreads - 32);
            named_barrier_sync(kAheadBarrier, nthreads);
        }
        x.ahead_table = path ? ahead_s : nullptr;
        x.ahead_epn = l.experts_per_rank;
        x.ahead_threads = nthreads;
        x.ahead_waited = false;
        if (warp == 0) {
            if (rec != nullptr) {
                x.trace = rec->trace;
                x.trace_n = &trace_n;
                if (x.lane == 0) {
                    trace_n = 1;
                    rec->trace[0] = clock64();
                }
                __syncwarp();
            }
            const bool ok = planner_core::build_candidate(x, l, counts, w.cand, w, index);
            x.wait_ahead_table();  // completes the named barrier when the build never read the table
            if (x.lane == 0) {
                built = ok;
                if (rec != nullptr) {
                    if (trace_n < PlannerProfileRecord::kTrace) rec->trace[trace_n++] = clock64();
                    rec->trace_count = trace_n;
                }
            }
        }
        __syncthreads();
        const bool ok = built != 0;  // uniform over the block
        if (tid == 0) profile_stamp(rec, kStampBuilt);
        // The copy first: its stores drain while the block evaluates.
        if (ok && index < stored && mode.alloc_smem)
            copy_words(ws.stored_alloc + int64_t(index) * re, w.cand, re, tid, nthreads);
        if (tid == 0) profile_stamp(rec, kStampStored);
        const planner_core::PlanQuality q =
            ok ? evaluate_alloc_block(l, counts, w.cand, w.num_in, w.num_out, moved, tid, nthreads)
               : planner_core::PlanQuality{planner_core::kNoCandidate, 0, 0};
        if (tid == 0) {
            ws.cand_quality[index] = q;
            if (rec != nullptr) {
                // Grid-stride candidates after the first: entry = counts loaded = the end of the previous one.
                const Stamp done = stamp_now();
                put_stamp(rec, kStampEntry, start);
                put_stamp(rec, kStampLoaded, index == begin ? loaded : start);
                put_stamp(rec, kStampEvaluated, done);
                rec->index = index;
                rec->sm = sm_id();
                rec->flags = ok;
                start = done;
            }
        }
        // evaluate_alloc_block ends with a barrier; without it, one here: warp 0 overwrites `built` and the
        // workspace only after every warp has read them.
        if (!ok) __syncthreads();
    }
}

// select_candidate's rule evaluated by one warp (every lane returns the same index). select_candidate keeps, in
// index order, every acceptable candidate strictly better than the best so far; so it returns the first index of
// the best acceptable quality among the candidates it scans when that quality beats the greedy's, else -1. It scans
// the path candidates, then the candidates of the lowest budget in [1, best path (or greedy) makespan] that has an
// acceptable one (it stops after that budget). This function finds that budget with a warp minimum and the best
// candidate in it with a warp reduction under a total order (quality, then index), so the result is the same.
// Setting kWarpSelect to false restores select_candidate on one thread.
constexpr bool kWarpSelect = true;
// trace (profile, null = off): clock64 after each of its four phases (lane 0).
FLATEP_DEVICE int select_candidate_warp(const planner_core::PlanQuality& greedy,
                                        const planner_core::PlanQuality* quality, int count, int lane,
                                        long long* trace = nullptr) {
    auto mark = [&](int at) {
        if (trace != nullptr && lane == 0) trace[at] = clock64();
    };
    using planner_core::better_than;
    using planner_core::PlanQuality;
    auto acceptable = [&greedy](const PlanQuality& q) {
        return q.makespan != planner_core::kNoCandidate && q.makespan <= greedy.makespan &&
               q.total_replicas <= greedy.total_replicas;
    };
    // Path candidates: every lane scans them as select_candidate does.
    PlanQuality best = greedy;
    int kept = -1;
    for (int i = 0; i < planner_core::kNumPathVariants && i < count; ++i) {
        if (!acceptable(quality[i]) || !better_than(quality[i], best)) continue;
        best = quality[i];
        kept = i;
    }
    mark(0);
    // The lowest budget in [1, best.makespan] with an acceptable candidate.
    constexpr int kNone = 0x7fffffff;
    int budget = kNone;
    for (int i = planner_core::kNumPathVariants + lane; i < count; i += 32) {
        const int b = (i - planner_core::kNumPathVariants) / planner_core::kVariantsPerBudget + 1;
        if (b <= best.makespan && b < budget && acceptable(quality[i])) budget = b;
    }
    budget = int(__reduce_min_sync(kFull, unsigned(budget)));
    mark(1);
    if (budget == kNone) return kept;
    // Its best candidate strictly better than `best`: per lane in index order (strict improvement keeps the first),
    // then a butterfly under the total order (found first, quality, lower index).
    const int lo = planner_core::kNumPathVariants + (budget - 1) * planner_core::kVariantsPerBudget;
    const int hi = min_of(lo + planner_core::kVariantsPerBudget, count);
    PlanQuality mine = best;
    int at = -1;
    for (int i = lo + lane; i < hi; i += 32) {
        const PlanQuality q = quality[i];
        if (acceptable(q) && better_than(q, mine)) {
            mine = q;
            at = i;
        }
    }
    mark(2);
    for (int o = 16; o > 0; o >>= 1) {
        PlanQuality other;
        other.makespan = __shfl_xor_sync(kFull, mine.makespan, o);
        other.total_replicas = __shfl_xor_sync(kFull, mine.total_replicas, o);
        other.entries_moved = __shfl_xor_sync(kFull, (long long)mine.entries_moved, o);
        const int other_at = __shfl_xor_sync(kFull, at, o);
        const bool take =
            other_at >= 0 && (at < 0 || better_than(other, mine) || (!better_than(mine, other) && other_at < at));
        if (take) {
            mine = other;
            at = other_at;
        }
    }
    mark(3);
    return at >= 0 ? at : kept;
}

// select_candidate_warp with each quality as one 64-bit key, (P, total replicas, entries moved) in bits 56+, 40+ and
// 0-39, so better_than(a, b) is key(a) < key(b): valid when the greedy's P < 256 and total replicas < 2^16 (an
// acceptable candidate is at most that on both; entries moved <= N < 2^37 always). Every selection is then one warp
// minimum of (key, index): the path candidates one per lane, the lowest acceptable budget, that budget's candidates
// one per lane (kVariantsPerBudget <= 32). The same index as select_candidate_warp.
static_assert(planner_core::kVariantsPerBudget <= 32 && planner_core::kNumPathVariants <= 32, "one per lane");
FLATEP_DEVICE bool quality_keys_fit(const planner_core::PlanQuality& greedy) {
    return greedy.makespan >= 0 && greedy.makespan < 256 && greedy.total_replicas >= 0 && greedy.total_replicas < 65536;
}
FLATEP_DEVICE uint64_t quality_key(const planner_core::PlanQuality& q) {
    return (uint64_t(q.makespan) << 56) | (uint64_t(q.total_replicas) << 40) | uint64_t(q.entries_moved);
}
// The lowest lane holding the smallest key among the lanes with `has` (-1 when none); *best = that key.
FLATEP_DEVICE int warp_min_key(bool has, uint64_t key, uint64_t* best) {
    const unsigned hi = __reduce_min_sync(kFull, has ? unsigned(key >> 32) : 0xffffffffu);
    const unsigned lo = __reduce_min_sync(kFull, has && unsigned(key >> 32) == hi ? unsigned(key) : 0xffffffffu);
    const uint64_t k = (uint64_t(hi) << 32) | lo;
    const unsigned at = __ballot_sync(kFull, has && key == k);
    if (at == 0) return -1;
    *best = k;
    return __ffs(at) - 1;
}
FLATEP_DEVICE int select_candidate_keys(const planner_core::PlanQuality& greedy,
                                        const planner_core::PlanQuality* quality, int count, int lane) {
    using planner_core::PlanQuality;
    constexpr int kPath = planner_core::kNumPathVariants, kPerBudget = planner_core::kVariantsPerBudget;
    auto acceptable = [&greedy](const PlanQuality& q) {
        return q.makespan != planner_core::kNoCandidate && q.makespan <= greedy.makespan &&
               q.total_replicas <= greedy.total_replicas;
    };
    uint64_t best = quality_key(greedy);
    int best_p = greedy.makespan;
    PlanQuality q{};
    if (lane < kPath && lane < count) q = quality[lane];
    const uint64_t path_key = quality_key(q);
    const int kept = warp_min_key(lane < kPath && lane < count && acceptable(q) && path_key < best, path_key, &best);
    if (kept >= 0) best_p = int(best >> 56);
    constexpr int kNone = 0x7fffffff;
    int budget = kNone;
    for (int i = kPath + lane; i < count; i += 32) {
        const int b = (i - kPath) / kPerBudget + 1;
        if (b <= best_p && b < budget && acceptable(quality[i])) budget = b;
    }
    budget = int(__reduce_min_sync(kFull, unsigned(budget)));
    if (budget == kNone) return kept;
    const int i = kPath + (budget - 1) * kPerBudget + lane;
    const bool mine = lane < kPerBudget && i < count;
    if (mine) q = quality[i];
    const uint64_t key = quality_key(q);
    const int at = warp_min_key(mine && acceptable(q) && key < best, key, &best);
    return at >= 0 ? i - lane + at : kept;
}

// prof: the select record (null = off).
__global__ void __launch_bounds__(kPlannerThreads)
    select_derive_kernel(Layout l, PlanView p, PlanWorkspace ws, int stored, CandidateMode mode,
                         PlannerProfileRecord* rec) {
    extern __shared__ int4 smem_words[];
    int32_t* smem = reinterpret_cast<int32_t*>(smem_words);
    __shared__ PlannerShared sh;
    __shared__ planner_core::PlanQuality quality[kSelectCached];  // the qualities, loaded in parallel
    const int tid = threadIdx.x, nthreads = blockDim.x;
    if (tid == 0) profile_stamp(rec, kStampEntry);
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    // The counts go to shared memory at once (the selection does not need them, and no planner kernel writes them),
    // and the qualities of the main launch's candidates (every one written by this planner) without waiting for the
    // count; those of the overflow candidates (greedy P above 6) once the count is known.
    const CandidateSmem cs = carve_candidate_smem(l, p, mode, smem);
    if (mode.counts_smem) copy_words<kWideBatch>(const_cast<int32_t*>(cs.counts), p.tpe_all, re, tid, nthreads);
    wait_prior_grids();  // the candidate kernels: qualities, count, stored allocations, the greedy's plan.alloc
    if (tid == 0) profile_stamp(rec, kStampSelWaited);
    const int main_count = min_of(min_of(kCandidateBlocks, max_candidates(l)), kSelectCached);
    for (int i = tid; i < main_count; i += nthreads) quality[i] = ws.cand_quality[i];
    const int count = ws.cand_meta[kMetaCount];
    planner_core::PlanQuality greedy{};  // loaded with the count (one memory round trip)
    greedy.makespan = ws.cand_meta[kMetaMakespan];
    greedy.total_replicas = ws.cand_meta[kMetaReplicas];
    greedy.entries_moved = int64_t(uint64_t(uint32_t(ws.cand_meta[kMetaMovedLo])) |
                                   (uint64_t(uint32_t(ws.cand_meta[kMetaMovedHi])) << 32));
    for (int i = main_count + tid; i < min_of(count, kSelectCached); i += nthreads) quality[i] = ws.cand_quality[i];
    __syncthreads();
    if (tid == 0) profile_stamp(rec, kStampSelLoaded);
    if (tid < 32) {
        const planner_core::PlanQuality* q = count <= kSelectCached ? quality : ws.cand_quality;
        if (kWarpSelect) {
            long long* trace = rec != nullptr ? rec->trace : nullptr;
            if (trace != nullptr && tid == 0) trace[4] = clock64();
            const int winner = quality_keys_fit(greedy) ? select_candidate_keys(greedy, q, count, tid)
                                                        : select_candidate_warp(greedy, q, count, tid, trace);
            if (trace != nullptr && tid == 0) trace[0] = trace[1] = trace[2] = trace[3] = clock64();
            if (trace != nullptr && tid == 0) rec->trace_count = 5;
            if (tid == 0) sh.winner = winner;
        } else if (tid == 0) {
            sh.winner = planner_core::select_candidate(greedy, q, count);
        }
    }
    __syncthreads();
    const int kept = sh.winner;
    if (tid == 0) profile_stamp(rec, kStampSelSelected);
    if (!mode.counts_smem || !mode.alloc_smem) {
        // Counts or allocation in global memory: derive from the plan's own allocation (the greedy's is there
        // already; a stored winner is copied there, one not stored rebuilt there by warp 0 next to the counts).
        planner_core::Workspace w = cs.w;
        int32_t* const alloc_s = mode.alloc_smem ? w.cand : p.alloc;
        // Where the winner's allocation is (null: rebuild it).
        const int32_t* from = nullptr;
        if (kept >= 0 && kept < stored) {
            from = ws.stored_alloc + int64_t(kept) * re;
        } else if (kept >= 0 && !mode.alloc_smem) {
            const int slot = scratch_slot(kept, min_of(kCandidateBlocks, max_candidates(l)), count);
            if (slot >= 0) from = ws.cand_scratch + int64_t(slot) * re;
        }
        if (from != nullptr) {
            copy_words<kWideBatch>(alloc_s, from, re, tid, nthreads, alloc_s != p.alloc ? p.alloc : nullptr);
        } else if (kept < 0 && alloc_s != p.alloc) {
            copy_words<kWideBatch>(alloc_s, p.alloc, re, tid, nthreads);
        }
        __syncthreads();
        if (tid == 0) profile_stamp(rec, kStampSelCopied);
        if (kept >= 0 && from == nullptr) {
            w.cand = alloc_s;
            if (tid < 32) {
                planner_core::build_candidate(WarpExec{tid}, l, cs.counts, w.cand, w, kept);
                if (alloc_s != p.alloc) copy_words<kWideBatch>(p.alloc, w.cand, re, tid, 32);
            }
            __syncthreads();
        }
        if (rec != nullptr && tid == 0) {
            profile_stamp(rec, kStampSelRebuilt);
            rec->index = kept;
            rec->sm = sm_id();
            rec->count = count;
        }
        derive_plan_block(l, p, sh, tid, nthreads, cs.counts, alloc_s, cs.table, rec);
        return;
    }
    // Shared memory: the counts [R*E], then the allocation derived from (the winner's, or the greedy's).
    int32_t* alloc_s = smem + re;
    if (kept >= 0 && kept < stored) {
        copy_words<kWideBatch>(alloc_s, ws.stored_alloc + int64_t(kept) * re, re, tid, nthreads, p.alloc);
    } else if (kept < 0) {
        copy_words<kWideBatch>(alloc_s, p.alloc, re, tid, nthreads);  // the greedy's, written by candidates_kernel
    }
    __syncthreads();
    if (tid == 0) profile_stamp(rec, kStampSelCopied);
    if (kept >= stored) {  // not stored: warp 0 rebuilds it next to the counts
        const planner_core::Workspace w = planner_core::make_workspace(l, smem + re);
        if (tid < 32) {
            planner_core::build_candidate(WarpExec{tid}, l, smem, w.cand, w, kept);
            copy_words<kWideBatch>(p.alloc, w.cand, re, tid, 32);
        }
        alloc_s = w.cand;
        __syncthreads();
    }
    if (rec != nullptr && tid == 0) {
        profile_stamp(rec, kStampSelRebuilt);
        rec->index = kept;
        rec->sm = sm_id();
        rec->count = count;
    }
    // The slot experts go right after the allocation: inside planner_core's workspace region either way.
    derive_plan_block(l, p, sh, tid, nthreads, smem, alloc_s, alloc_s + re, rec);
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
                int32_t* head = region_at<int32_t>(peers.ptr[d], sym.row_head_offset);
                int32_t* next = region_at<int32_t>(peers.ptr[d], sym.row_next_offset);
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
                              int32_t* status, int32_t* host_status) {
    const int E = l.num_experts, G = l.num_groups();
    const int32_t* cu = p.cu_seqlens + int64_t(rank) * G;
    const int32_t* head = region_at<const int32_t>(peers.ptr[rank], sym.row_head_offset);
    const int32_t* next = region_at<const int32_t>(peers.ptr[rank], sym.row_next_offset);
    for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < l.num_recv_rows;
         r += int64_t(gridDim.x) * blockDim.x) {
        int32_t h = -1, nx = -1;
        const int lo = find_group(cu, G, r);
        if (lo < G) {
            const int g = lo;
            const int32_t start = g == 0 ? 0 : cu[g - 1];
            const int expert = group_expert(l, p, rank, g);
            const int32_t size = expert < 0 ? 0 : p.alloc[int64_t(rank) * E + expert];
            if (r - start < size) {
                h = head[r];
                nx = next[r];
            }
        }
        p.row_head[r] = h;
        p.row_next[r] = nx;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const unsigned long long bad = *ws.first_bad;
        if (bad != ~0ull) {
            record_status(status, kStatusBadExpert, int32_t(bad >> 32), int32_t(uint32_t(bad)), -1);
            record_status(host_status, kStatusBadExpert, int32_t(bad >> 32), int32_t(uint32_t(bad)), -1);
        }
    }
}

// Raises a kernel's dynamic shared memory limit to at least `bytes` on the current device when its static plus
// dynamic shared memory exceeds the default 48 KiB, once per (kernel, device, size): host calls stay off the
// per-step launch path.
void allow_smem(const void* kernel, size_t bytes) {
    static std::mutex mu;
    static std::map<std::pair<const void*, int>, size_t> raised;
    int device = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mu);
    size_t& have = raised[{kernel, device}];
    if (have >= bytes) return;
    cudaFuncAttributes attr{};
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    if (attr.sharedSizeBytes + bytes > 48 * 1024) {  // beyond the default limit: opt in
        FLATEP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    }
    have = bytes;
}

// The overflow candidates and select_derive_kernel start while the kernel before them drains (programmatic dependent
// launch, see wait_prior_grids): this hides a kernel launch latency per boundary. false: ordinary launches (the
// kernels' waits then return at once).
constexpr bool kProgrammaticLaunch = true;

template <class... Params, class... Args>
void launch_programmatic(void (*kernel)(Params...), int blocks, int threads, size_t smem, cudaStream_t stream,
                         Args&&... args) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(unsigned(blocks));
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attr[1]{};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = kProgrammaticLaunch ? 1 : 0;
    FLATEP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

void launch_planner_impl(const Layout& l, PlannerKind kind, const PlanView& p, const PlanWorkspace& ws,
                         PlannerEngine engine, cudaStream_t stream) {
    if (engine == PlannerEngine::kSerial) {
        planner_serial_kernel<<<1, 1, 0, stream>>>(l, kind, p, ws.serial_ws);
    } else {
        PlannerProfileRecord* const prof = g_profile.load();
        const PlannerProfileSlots slots = planner_profile_slots(l);
        const CandidateMode mode = candidate_mode(l, planner_placement_now());
        const size_t cand_smem = candidate_smem_bytes(l, mode);
        const bool candidates = kind == PlannerKind::kBalanced && mode.candidates;
        if (candidates) {
            allow_smem(reinterpret_cast<const void*>(candidates_kernel), cand_smem);
            allow_smem(reinterpret_cast<const void*>(select_derive_kernel), cand_smem);
            const int stored = stored_candidates(l);
            const int blocks = min_of(kCandidateBlocks, max_candidates(l));
            candidates_kernel<<<blocks + 1, kCandidateThreads, cand_smem, stream>>>(l, p, ws, stored, 0, mode, prof);
            FLATEP_CUDA_CHECK_LAUNCH();
            if (max_candidates(l) > blocks) {  // only when the greedy's P may exceed 6
                launch_programmatic(candidates_kernel, blocks, kCandidateThreads, cand_smem, stream, l, p, ws, stored,
                                    blocks, mode, prof);
            }
            PlannerProfileRecord* const select_rec = prof != nullptr ? prof + slots.select : nullptr;
            launch_programmatic(select_derive_kernel, 1, kPlannerThreads, cand_smem, stream, l, p, ws, stored, mode,
                                select_rec);
            FLATEP_CUDA_CHECK_LAUNCH();
            return;
        }
        const size_t core_smem =
            (2 * size_t(l.num_ranks) * l.num_experts + size_t(planner_core::planner_workspace_words(l))) *
            sizeof(int32_t);
        // Greedy kind: T_e [E] and the allocation [R*E] in shared memory when they fit.
        const size_t greedy_smem = (size_t(l.num_ranks) + 1) * l.num_experts * sizeof(int32_t);
        const bool use_smem =
            kind == PlannerKind::kBalanced ? core_smem <= kMaxPlannerSmem : greedy_smem <= kMaxPlannerSmem;
        const size_t smem = max_of(size_t(l.num_experts) * sizeof(int32_t),
                                   use_smem ? (kind == PlannerKind::kBalanced ? core_smem : greedy_smem) : size_t(0));
        allow_smem(reinterpret_cast<const void*>(planner_parallel_kernel), smem);
        planner_parallel_kernel<<<1, kPlannerThreads, smem, stream>>>(
            l, kind, p, ws, use_smem, prof != nullptr ? prof + slots.parallel : nullptr);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t plan_workspace_bytes(const Layout& l) { return size_t(workspace_sizes(l).total) * sizeof(int32_t); }

size_t planner_candidate_smem_bytes(const Layout& l) {
    return candidate_smem_bytes(l, candidate_mode(l, planner_placement_now()));
}

bool planner_uses_candidate_path(const Layout& l) { return candidate_mode(l, planner_placement_now()).candidates; }

const char* planner_path_name(const Layout& l) {
    const CandidateMode m = candidate_mode(l, planner_placement_now());
    if (!m.candidates) return "core";  // planner_parallel_kernel: plan_alloc on one thread
    if (m.counts_smem && m.alloc_smem) return "shared";
    if (m.alloc_smem) return "counts-global";
    if (m.counts_smem) return "alloc-global";
    return "global";
}

namespace {
// -1: not read from FLATEP_PLANNER_PLACEMENT yet.
std::atomic<int> g_placement{-1};

PlannerPlacement planner_placement_from_env() {
    const std::string v = env::get("FLATEP_PLANNER_PLACEMENT", "auto");
    if (v == "auto") return PlannerPlacement::kAuto;
    if (v == "shared") return PlannerPlacement::kShared;
    if (v == "counts-global" || v == "counts") return PlannerPlacement::kCountsGlobal;
    if (v == "global") return PlannerPlacement::kGlobal;
    FLATEP_CHECK(false, "FLATEP_PLANNER_PLACEMENT must be auto, shared, counts-global or global, got '", v, "'");
    return PlannerPlacement::kAuto;
}
}  // namespace

PlannerPlacement planner_placement_now() {
    int v = g_placement.load();
    if (v < 0) {
        int unset = -1;
        g_placement.compare_exchange_strong(unset, int(planner_placement_from_env()));
        v = g_placement.load();
    }
    return PlannerPlacement(v);
}

void set_planner_placement(PlannerPlacement placement) { g_placement.store(int(placement)); }

void set_planner_engine(PlannerEngine engine) { g_engine.store(int(engine)); }

PlannerProfileSlots planner_profile_slots(const Layout& l) {
    PlannerProfileSlots s{};
    s.candidates = max_candidates(l);
    s.greedy = s.candidates;
    s.select = s.greedy + 1;
    s.parallel = s.select + 1;
    s.total = s.parallel + 1;
    return s;
}

void set_planner_profile(PlannerProfileRecord* records) { g_profile.store(records); }

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
        allow_smem(reinterpret_cast<const void*>(route_kernel), smem);
        const int route_blocks = grid_blocks(a.sync, ceil_div(a.num_tokens, seg_tokens), 2);
        route_kernel<<<route_blocks, kRouteThreads, smem, stream>>>(l, a.rank, a.topk_idx, a.index_bytes, a.num_tokens,
                                                                    seg_tokens, sym, peers, a.plan, ws);
        FLATEP_CUDA_CHECK_LAUNCH();
    }
    launch_barrier(a.sync, kOpPlan, stream);
    const int unpack_blocks = grid_blocks(a.sync, ceil_div(l.num_recv_rows, 256), 8);
    unpack_kernel<<<unpack_blocks, 256, 0, stream>>>(l, a.rank, sym, peers, a.plan, ws, a.sync.status,
                                                     a.sync.host_status);
    FLATEP_CUDA_CHECK_LAUNCH();
}

void preload_plan_kernels() {
    cudaFuncAttributes attr{};
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, histogram_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, allgather_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, planner_parallel_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, planner_serial_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, candidates_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, select_derive_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, route_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, unpack_kernel));
}

}  // namespace flatep::kernels
