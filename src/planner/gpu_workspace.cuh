// The GPU planner's workspace and the shared memory of its candidate blocks: where the counts, the candidates'
// allocations and qualities live, the copies between them, and the block-wide steps every candidate block runs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "planner/candidates.hpp"
#include "planner/gpu_planner.cuh"
#include "planner/warp_exec.cuh"

namespace flatep::planner {

constexpr int kPlannerThreads = 1024;
constexpr size_t kMaxPlannerSmem = 200 * 1024;

// Workspace (int32 words, every array 64-word aligned): planner_workspace_bytes(l) bytes at a 256-byte boundary.
struct PlannerWorkspace {
    int32_t* serial_ws;         // the tpe_all copy [R*E] and planner_core's workspace (serial engine)
    PlanQuality* cand_quality;  // [max_candidates] quality of every balanced-planner candidate
    int32_t* cand_meta;         // [kMetaWords] the greedy's quality and the number of candidates
    int32_t* stored_alloc;      // [stored_candidates][R*E] allocations of the first candidates
    int32_t* cand_scratch;  // [kCandidateBlocks][R*E] working allocation of candidate block b when it is not kept in
                            // shared memory and its candidate is not stored (CandidateMode::alloc_smem false)
    int32_t* block_small;   // [kCandidateBlocks + 1][block_small_words] candidate block b's [E] arrays under
                            // CandidateMode::small_global
    DeriveMerge* derive_merge;  // select_derive_kernel's blocks' statistics sums (cleared by the greedy block)
};

// cand_meta words.
enum CandidateMeta : int { kMetaMakespan = 0, kMetaReplicas, kMetaMovedLo, kMetaMovedHi, kMetaCount, kMetaWords = 8 };

// The greedy's quality, as the greedy block wrote it to ws.cand_meta.
FLATEP_DEVICE PlanQuality greedy_quality(const PlannerWorkspace& ws) {
    PlanQuality q{};
    q.makespan = ws.cand_meta[kMetaMakespan];
    q.total_replicas = ws.cand_meta[kMetaReplicas];
    q.entries_moved = int64_t(uint64_t(uint32_t(ws.cand_meta[kMetaMovedLo])) |
                              (uint64_t(uint32_t(ws.cand_meta[kMetaMovedHi])) << 32));
    return q;
}

// Upper bound of the greedy's makespan: a rank hosts at most epn replicas and the E experts have at most E copies.
FLATEP_HD int max_candidates(const Layout& l) { return num_candidates(l.num_experts); }
// The candidate kernel's grid: one pass covers every candidate up to a greedy P of 6 (num_candidates(6)).
constexpr int kCandidateBlocks = 4 + 18 * 6;
// A candidate block's arrays in global memory under CandidateMode::small_global: planner_core's small workspace (its
// [R] arrays unused: they are in shared memory), then home_ahead's table [E]; a multiple of 64 words.
FLATEP_HD int64_t block_small_words(const Layout& l) {
    return (planner_small_workspace_words(l) + l.num_experts + 63) / 64 * 64;
}
// Candidates whose allocation the candidate kernels keep: every candidate of a greedy P up to kStoredMakespan (the
// main launch's and the first overflow candidates), within 16 MiB. The winner is copied from there, or rebuilt
// (serially, after every candidate) when its index is beyond.
constexpr int kStoredMakespan = 10;
inline int stored_candidates(const Layout& l) {
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    const int want = min_of(num_candidates(kStoredMakespan), max_candidates(l));
    return int(min_of<int64_t>(want, (int64_t(4) << 20) / re));
}

struct PlannerWorkspaceSizes {
    int64_t serial_ws, cand_quality, cand_meta, stored_alloc, cand_scratch, block_small, derive_merge, total;
};

inline PlannerWorkspaceSizes planner_workspace_sizes(const Layout& l) {
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    Carver c{64};
    PlannerWorkspaceSizes s{};
    s.serial_ws = c.take(re + planner_workspace_words(l));
    s.cand_quality = c.take(int64_t(max_candidates(l)) * int64_t(sizeof(PlanQuality) / 4));
    s.cand_meta = c.take(kMetaWords);
    s.stored_alloc = c.take(int64_t(stored_candidates(l)) * re);
    s.cand_scratch = c.take(int64_t(kCandidateBlocks) * re);
    s.block_small = c.take(int64_t(kCandidateBlocks + 1) * block_small_words(l));
    s.derive_merge = c.take(kDeriveMergeWords);
    s.total = c.at;
    return s;
}

inline PlannerWorkspace make_planner_workspace(const Layout& l, void* base) {
    const PlannerWorkspaceSizes s = planner_workspace_sizes(l);
    int32_t* w = static_cast<int32_t*>(base);
    PlannerWorkspace p{};
    p.serial_ws = w + s.serial_ws;
    p.cand_quality = reinterpret_cast<PlanQuality*>(w + s.cand_quality);
    p.cand_meta = w + s.cand_meta;
    p.stored_alloc = w + s.stored_alloc;
    p.cand_scratch = w + s.cand_scratch;
    p.block_small = w + s.block_small;
    p.derive_merge = reinterpret_cast<DeriveMerge*>(w + s.derive_merge);
    return p;
}

// ------------------------------------------------------------------------------------------------------------
// Balanced planner, candidate-parallel. Kernel 1 (kCandidateThreads per block): every block loads the counts into
// shared memory; one runs the greedy and its quality (so select_candidate knows how many candidates to look at), the
// others build the candidates blockIdx.x, blockIdx.x + gridDim.x, ... with planner_core's own functions on the warp
// executor (warp 0), writing each quality and (the first `stored` indices) each allocation. Kernel 2 (derive_grid's
// blocks): select_candidate's rule, the winner's allocation (copied, or rebuilt when it was not stored), derive_plan.
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
    // Only with alloc_smem and not counts_smem: shared memory holds the allocation and planner_core's [R] arrays, and
    // the [E] arrays are in the block's ws.block_small slot. After the build, the block copies the allocation to
    // where the global placement builds it (the stored slot, else the block's scratch slot), so select_derive_kernel
    // runs as under the global placement.
    bool small_global = false;
};

// Dynamic shared memory of a candidate block (and of select_derive_kernel) for a placement.
inline size_t candidate_smem_bytes(const Layout& l, bool counts_smem, bool alloc_smem, bool small_global = false) {
    const size_t re = size_t(l.num_ranks) * l.num_experts;
    if (small_global) return (re + 6 * size_t(l.num_ranks)) * sizeof(int32_t);
    return ((counts_smem ? re : 0) + (alloc_smem ? re : 0) + size_t(planner_small_workspace_words(l)) +
            size_t(l.num_experts)) *
           sizeof(int32_t);
}
// The allocation alone (CandidateMode::small_global) may take an SM's whole shared memory (227 KiB a block on sm_90)
// but for the candidate kernel's static arrays and a margin.
constexpr size_t kMaxAllocSmem = 226 * 1024;

inline CandidateMode candidate_mode(const Layout& l, PlannerPlacement placement) {
    const bool all = candidate_smem_bytes(l, true, true) <= kMaxPlannerSmem;
    const bool alloc_only = candidate_smem_bytes(l, false, true) <= kMaxPlannerSmem;
    const bool alloc_alone = candidate_smem_bytes(l, false, true, true) <= kMaxAllocSmem;
    const CandidateMode global{true, false, false};
    const CandidateMode alloc_shared = alloc_alone ? CandidateMode{true, false, true, true} : global;
    switch (placement) {
        case PlannerPlacement::kAllocShared:
            return alloc_shared;
        case PlannerPlacement::kShared:
            return CandidateMode{all, true, true};
        case PlannerPlacement::kCountsGlobal:
            return CandidateMode{true, false, alloc_only};
        case PlannerPlacement::kGlobal:
            return global;
        case PlannerPlacement::kAuto:
        default:
            return all ? CandidateMode{true, true, true} : alloc_only ? CandidateMode{true, false, true} : alloc_shared;
    }
}
inline size_t candidate_smem_bytes(const Layout& l, const CandidateMode& m) {
    return candidate_smem_bytes(l, m.counts_smem, m.alloc_smem, m.small_global);
}

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
// small_global: the allocation and the [R] arrays; the rest in `block_small` (block_small_words, global memory).
struct CandidateSmem {
    const int32_t* counts;  // shared memory, or plan.tpe_all
    Workspace w;
    int32_t* table;  // [E]: home_ahead's table (candidates), the slot experts (select_derive_kernel)
};
FLATEP_DEVICE CandidateSmem carve_candidate_smem(const Layout& l, const PlanView& p, const CandidateMode& m,
                                                 int32_t* smem, int32_t* block_small = nullptr) {
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    CandidateSmem c{};
    if (m.small_global) {
        // The allocation, then the [R] arrays, in shared memory; T_e and the items in block_small, then the table.
        const int E = l.num_experts, R = l.num_ranks;
        c.counts = p.tpe_all;
        c.w = make_workspace_at(l, block_small, smem, block_small + E + 6 * R);
        int32_t* const ranks = smem + re;
        c.w.target = ranks;
        c.w.load = ranks + R;
        c.w.room = ranks + 2 * R;
        c.w.excess = ranks + 3 * R;
        c.w.num_in = ranks + 4 * R;
        c.w.num_out = ranks + 5 * R;
        c.table = block_small + planner_small_workspace_words(l);
        return c;
    }
    if (m.counts_smem && m.alloc_smem) {
        c.counts = smem;
        c.w = make_workspace(l, smem + re);
        c.table = smem + re + planner_workspace_words(l);
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
    c.w = make_workspace_split(l, at, cand);
    c.table = at + planner_small_workspace_words(l);
    return c;
}

// evaluate_alloc over the whole block (every thread gets the quality). The quality is a count, a sum
// and a maximum of integers, so any split of the work gives the same value. Uses num_in / num_out [R] as
// evaluate_alloc does, and bx.red. Begins and ends with a block barrier.
FLATEP_DEVICE PlanQuality evaluate_alloc_block(const BlockExec& bx, const Layout& l, const int32_t* tpe_all,
                                               const int32_t* alloc, int32_t* num_in, int32_t* num_out) {
    const int tid = bx.tid, nthreads = bx.nthreads;
    for (int r = tid; r < l.num_ranks; r += nthreads) num_in[r] = num_out[r] = 0;
    __syncthreads();
    int64_t off = 0;
    const int R = l.num_ranks, E = l.num_experts;
    const uintptr_t ends = reinterpret_cast<uintptr_t>(tpe_all) | reinterpret_cast<uintptr_t>(alloc);
    if (E % 4 == 0 && (ends & 15) == 0) {
        // Four experts a thread, 16-byte loads of both arrays, kEvalRanks ranks' loads in flight (evaluate_expert's
        // sums, the same integers).
        constexpr int kEvalRanks = 4;
        for (int quad = tid; quad < E / 4; quad += nthreads) {
            const int e = quad * 4;
            const int h[4] = {l.home_rank(e), l.home_rank(e + 1), l.home_rank(e + 2), l.home_rank(e + 3)};
            int32_t copies[4] = {0, 0, 0, 0};
            for (int d0 = 0; d0 < R; d0 += kEvalRanks) {
                int4 a4[kEvalRanks], t4[kEvalRanks];
#pragma unroll
                for (int j = 0; j < kEvalRanks; ++j) {
                    if (d0 + j >= R) break;
                    a4[j] = reinterpret_cast<const int4*>(alloc + int64_t(d0 + j) * E)[quad];
                    t4[j] = reinterpret_cast<const int4*>(tpe_all + int64_t(d0 + j) * E)[quad];
                }
#pragma unroll
                for (int j = 0; j < kEvalRanks; ++j) {
                    const int d = d0 + j;
                    if (d >= R) break;
                    const int32_t a[4] = {a4[j].x, a4[j].y, a4[j].z, a4[j].w};
                    const int32_t t[4] = {t4[j].x, t4[j].y, t4[j].z, t4[j].w};
                    int32_t in = 0;
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        off += t[q] - (t[q] < a[q] ? t[q] : a[q]);
                        const bool replica = a[q] > 0 && d != h[q];
                        in += replica;
                        copies[q] += replica;
                    }
                    if (in != 0) atomicAdd(&num_in[d], in);
                }
            }
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (copies[q] != 0) atomicAdd(&num_out[h[q]], copies[q]);
        }
    } else {
        for (int e = tid; e < E; e += nthreads) off += evaluate_expert(bx, l, tpe_all, alloc, num_in, num_out, e);
    }
    // The warps' sums of `off` side by side in bx.red (a 64-bit atomic on one shared word serialises the warps).
    for (int o = 16; o > 0; o >>= 1) off += __shfl_xor_sync(kFull, off, o);
    if (tid % 32 == 0) bx.red[tid / 32] = off;
    __syncthreads();
    int64_t moved = 0;
    for (int wp = 0; wp < nthreads / 32; ++wp) moved += bx.red[wp];
    const PlanQuality q = quality_of(l, num_in, num_out, moved);
    __syncthreads();  // the workspace (and bx.red) may be overwritten after this
    return q;
}

// The home allocation (init_home) and the fixed targets of the counts in shared memory, computed by the whole block
// for warp 0's candidate (x then reports them ready). Begins and ends with a block barrier.
FLATEP_DEVICE void prepare_home(WarpExec& x, const BlockExec& bx, const Layout& l, const int32_t* counts,
                                const Workspace& w) {
    x.home_n = init_home(bx, l, counts, w.cand, w);
    x.home_alloc = w.cand;
    if (bx.tid == 0) fixed_targets(l, x.home_n, w);
    __syncthreads();
}

// The counts copied into shared memory (`counts`, [R*E]; null: not copied, the counts stay in tpe_all) and
// prepare_home's results in one pass: each thread takes four experts, loads their counts from every rank 16 bytes at a
// time (8 ranks in flight), stores them to `counts`, and writes the experts' T_e and home allocation; then the group
// loads and the targets. The same integers as copy_words + prepare_home, which it falls back to when E is not a
// multiple of 4 or an array is not 16-byte aligned.
// (The copy, then prepare_home over the copy, took about 1 + 3 us a K3 candidate block on the H200.) Begins and ends
// with a block barrier.
FLATEP_DEVICE void load_counts_and_home(WarpExec& x, const BlockExec& bx, const Layout& l, const int32_t* tpe_all,
                                        int32_t* counts, const Workspace& w) {
    const int R = l.num_ranks, E = l.num_experts;
    const uintptr_t ends = reinterpret_cast<uintptr_t>(tpe_all) | reinterpret_cast<uintptr_t>(counts) |
                           reinterpret_cast<uintptr_t>(w.cand) | reinterpret_cast<uintptr_t>(w.total);
    if (E % 4 != 0 || (ends & 15) != 0) {
        if (counts == nullptr) {
            prepare_home(x, bx, l, tpe_all, w);
            return;
        }
        __syncthreads();
        copy_words(counts, tpe_all, int64_t(R) * E, bx.tid, bx.nthreads);
        __syncthreads();
        prepare_home(x, bx, l, counts, w);
        return;
    }
    constexpr int kRanksInFlight = 8;
    const int64_t n = bx.sum(E / 4, [&](int quad) {
        int4 t{0, 0, 0, 0};
        for (int d0 = 0; d0 < R; d0 += kRanksInFlight) {
            int4 c[kRanksInFlight];
#pragma unroll
            for (int j = 0; j < kRanksInFlight; ++j)
                if (d0 + j < R) c[j] = reinterpret_cast<const int4*>(tpe_all + int64_t(d0 + j) * E)[quad];
#pragma unroll
            for (int j = 0; j < kRanksInFlight; ++j) {
                if (d0 + j >= R) break;
                if (counts != nullptr) reinterpret_cast<int4*>(counts + int64_t(d0 + j) * E)[quad] = c[j];
                t.x += c[j].x;
                t.y += c[j].y;
                t.z += c[j].z;
                t.w += c[j].w;
            }
        }
        reinterpret_cast<int4*>(w.total)[quad] = t;
        const int e = quad * 4;
        const int h0 = l.home_rank(e), h1 = l.home_rank(e + 1), h2 = l.home_rank(e + 2), h3 = l.home_rank(e + 3);
        for (int d = 0; d < R; ++d) {
            const int4 a{d == h0 ? t.x : 0, d == h1 ? t.y : 0, d == h2 ? t.z : 0, d == h3 ? t.w : 0};
            reinterpret_cast<int4*>(w.cand + int64_t(d) * E)[quad] = a;
        }
        return int64_t(t.x) + t.y + t.z + t.w;
    });
    bx.group_sum(R, l.experts_per_rank, w.total, w.load);
    x.home_n = n;
    x.home_alloc = w.cand;
    if (bx.tid == 0) fixed_targets(l, n, w);
    __syncthreads();
}

// Candidate blocks: kCandidateThreads threads. Warp 0 builds the candidate (planner_core on the warp executor: its
// sequential steps are latency-bound and gain nothing from more threads); the whole block loads the counts, computes
// the home allocation (init_home on BlockExec), stores the allocation and evaluates it (the O(R*E) passes), and the
// other warps build home_ahead's table of a path candidate, one rank per warp (nine warps: eight ranks at once). With
// 288 threads instead of 128 the K3 planner (E=896, R=8) took 41-47 us instead of 47-55 on the H200. Setting
// kCandidateThreads to 32 gives the one-warp blocks.
constexpr int kCandidateThreads = 288;
// Registers of a candidate block's thread (the kernel's __maxnreg__). On the H200 168 launched and 200 did not (out of
// resources, though 288 * 200 < 64K): consistent with an SM's registers being four banks of 16K, one per scheduler,
// with three of the nine warps on one bank (3 * 32 * 168 = 16128). __launch_bounds__(288) would cap it at 96.
constexpr int kCandidateRegisters = 168;
static_assert(kCandidateThreads % 32 == 0 && kCandidateThreads <= 1024, "whole warps");
static_assert((kCandidateThreads / 32 + 3) / 4 * 32 * kCandidateRegisters <= 16384,
              "a candidate block's warps must fit an SM's register banks");

}  // namespace flatep::planner
