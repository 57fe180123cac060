// The GPU planner (design §4): planner_core's own functions on the GPU executors of planner/warp_exec.cuh (every
// candidate of the balanced planner built by warp 0 of its own block, the O(R*E) loops split over lanes, every
// selection a warp reduction with the host's key and tie rule), then select_candidate and derive_plan over one block
// or several.
// Integer arithmetic only, so the plan is bitwise the host planner's.
#include <atomic>
#include <string>
#include <utility>

#include "common/check.hpp"
#include "common/cuda.hpp"
#include "common/env.hpp"
#include "planner/candidates.hpp"
#include "planner/derive.hpp"
#include "planner/gpu_device.cuh"
#include "planner/gpu_planner.cuh"
#include "planner/gpu_select.cuh"
#include "planner/gpu_workspace.cuh"
#include "planner/planner.hpp"
#include "planner/warp_exec.cuh"

namespace flatep::planner {

namespace {

std::atomic<int> g_engine{int(PlannerEngine::kParallel)};
std::atomic<PlannerProfileRecord*> g_profile{nullptr};  // set_planner_profile; null = off

// Shared state of the planner block.
struct PlannerShared {
    int32_t load[kMaxRanks];  // greedy: current load
    int32_t target[kMaxRanks];
    unsigned long long n;
    int32_t winner;   // index of the kept candidate, -1 = keep the greedy
    DeriveSums sums;  // derive_plan's
};

__global__ void __launch_bounds__(kPlannerThreads)
    planner_parallel_kernel(Layout l, PlannerKind kind, PlanView p, PlannerWorkspace ws, bool use_smem,
                            PlannerProfileRecord* rec, PlacementView placed) {
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

    // init_home: T_e, the home allocation (the static planner: its split over the placed copies), group loads, N.
    if (tid < kMaxRanks) sh.load[tid] = 0;
    if (tid == 0) sh.n = 0;
    __syncthreads();
    // One expert per thread; the sums are reduced over the warp first (one shared atomic per rank and warp: atomics
    // of a whole block on a few shared words serialise).
    for (int e0 = tid - lane; e0 < E; e0 += blockDim.x) {
        const int e = e0 + lane;
        const bool valid = e < E;
        int32_t t = 0;
        const int h = valid ? l.home_rank(e) : -1;
        if (valid) {
            for (int s = 0; s < R; ++s) t += p.tpe_all[s * E + e];
            total[e] = t;
            if (kind == PlannerKind::kStatic) {
                static_alloc_expert(l, p.tpe_all, placed, alloc, e);
            } else {
                for (int d = 0; d < R; ++d) alloc[d * E + e] = d == h ? t : 0;
            }
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
        Workspace w{};
        w.load = sh.load;
        w.target = sh.target;
        fixed_targets(l, n, w);
        profile_stamp(rec, kStampSelLoaded);
    }
    __syncthreads();

    // The owner planner's allocation is the home allocation above, the static planner's its split: both go straight to
    // the derive.
    // One-donor greedy (greedy_alloc), by warp 0 (the balanced planner reruns it inside plan_alloc).
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
        // The balanced planner's candidate search runs as plan_alloc wrote it, on one thread, over
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
        if (tid == 0) plan_alloc(l, kind, tpe_s, alloc_s, core_ws);
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
    derive_plan(BlockDerive{tid, int(blockDim.x), rec, rec}, l, p, p.tpe_all, alloc, total, sh.sums, placed);
}

// Main launch (first == 0, gridDim.x = G + 1): block G runs the greedy (the plan when no candidate is kept, and
// its quality, which bounds how many candidates select_candidate looks at); blocks [0, G) build candidate
// blockIdx.x at once, whether or not the greedy's bound will include it, so nothing waits for the greedy.
// Overflow launch (first == G): the candidates [G, count) the greedy's bound asks for, grid-stride; its blocks
// return at once when count <= G (the usual case).
// prof: the profile records (null = off): one per candidate index, then the greedy block's.
// kPlace: kPlaceAny (the mode from mode_arg), or the kernel compiled for one mode, so that the compiler sees where
// every workspace pointer points and addresses shared memory directly: kPlaceShared (CandidateMode{true, true, true}:
// every array in shared memory), kPlaceAlloc (CandidateMode{true, false, true, true}: the allocation and the [R]
// arrays).
enum CandidatePlace : int { kPlaceAny = 0, kPlaceShared = 1, kPlaceAlloc = 2 };
template <int kPlace>
__global__ void __maxnreg__(kCandidateRegisters)
    candidates_kernel(Layout l, PlanView p, PlannerWorkspace ws, int stored, int first, CandidateMode mode_arg,
                      PlannerProfileRecord* prof) {
    const CandidateMode mode = kPlace == kPlaceShared  ? CandidateMode{true, true, true}
                               : kPlace == kPlaceAlloc ? CandidateMode{true, false, true, true}
                                                       : mode_arg;
    extern __shared__ int4 smem_words[];  // 16-byte aligned
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
        // Only the candidates select_candidate will read (the main launch's qualities often decide it, e.g. an
        // acceptable candidate of a budget up to 6): warp 0 finds how many; the others are marked as yielding no plan,
        // which select_candidate never reads either.
        if (begin < end) {  // uniform over the block
            if (warp == 0) {
                const int read = candidates_read(greedy_quality(ws), ws.cand_quality, first, end, tid);
                if (tid == 0) built = read;
            }
            __syncthreads();
            const int read = built;
            __syncthreads();  // `built` is rewritten per candidate below
            if (tid == 0)
                for (int index = begin; index < end; index += step)
                    if (index >= read) ws.cand_quality[index] = PlanQuality{kNoCandidate, 0, 0};
            end = read;
        }
    }
    if (!greedy_block && begin >= end) return;  // uniform over the block
    const CandidateSmem cs =
        carve_candidate_smem(l, p, mode, smem, ws.block_small + int64_t(blockIdx.x) * block_small_words(l));
    Workspace w = cs.w;
    const int32_t* const counts = cs.counts;
    int32_t* const ahead_s = cs.table;  // [E] home_ahead's table
    // Counts in shared memory: the block's first home allocation is computed as they are copied; later ones from the
    // copy. Counts in global memory: every home allocation from them, with the copy's batched loads.
    const Stamp loaded = prof != nullptr ? stamp_now() : Stamp{};
    auto home = [&](bool first) {
        if (!mode.counts_smem) {
            load_counts_and_home(x, bx, l, p.tpe_all, nullptr, w);
        } else if (first) {
            load_counts_and_home(x, bx, l, p.tpe_all, const_cast<int32_t*>(counts), w);
        } else {
            prepare_home(x, bx, l, counts, w);
        }
    };
    if (greedy_block) {
        PlannerProfileRecord* rec = prof != nullptr ? prof + max_candidates(l) : nullptr;
        clear_derive_merge(ws.derive_merge, tid, nthreads);  // select_derive_kernel adds to it after its wait
        if (!mode.alloc_smem) w.cand = p.alloc;              // the greedy's plan is built where the plan keeps it
        home(true);  // the whole block; warp 0 then skips init_home and fixed_targets
        if (warp == 0) greedy_alloc(x, l, counts, w.cand, w);
        __syncthreads();
        if (tid == 0) profile_stamp(rec, kStampBuilt);
        if (mode.alloc_smem) copy_words(p.alloc, w.cand, re, tid, nthreads);
        if (tid == 0) profile_stamp(rec, kStampStored);
        const PlanQuality greedy = evaluate_alloc_block(bx, l, counts, w.cand, w.num_in, w.num_out);
        if (tid == 0) {
            const int count = min_of(num_candidates(greedy.makespan), max_candidates(l));
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
        // The whole block; warp 0 then skips init_home and fixed_targets.
        home(index == begin);
        const bool path = index < kNumPathVariants && nthreads > 32;
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
            const bool ok = build_candidate(x, l, counts, w.cand, w, index);
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
        // The copy first: its stores drain while the block evaluates. With the small arrays in global memory, the
        // allocation goes where the global placement builds it: select_derive_kernel then runs as under that one.
        if (ok && index < stored && mode.alloc_smem) {
            copy_words(ws.stored_alloc + int64_t(index) * re, w.cand, re, tid, nthreads);
        } else if (ok && mode.small_global) {
            copy_words(ws.cand_scratch + int64_t(blockIdx.x) * re, w.cand, re, tid, nthreads);
        }
        if (tid == 0) profile_stamp(rec, kStampStored);
        const PlanQuality q =
            ok ? evaluate_alloc_block(bx, l, counts, w.cand, w.num_in, w.num_out) : PlanQuality{kNoCandidate, 0, 0};
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

// Threads of a select_derive_kernel<true> block: its blocks (derive_grid) hold more warps than derive_plan has tasks at
// K3 (36), and a block of 512 threads gets 128 registers a thread, where one of 1024 (64) spilled in the rebuild.
constexpr int kSelectSharedThreads = 512;
// Threads of a select_derive_kernel block: its launch bounds and its launches both take them from here.
constexpr int select_threads(bool shared) { return shared ? kSelectSharedThreads : kPlannerThreads; }

// select_derive_kernel: warp 0 rebuilds candidate `index` (not stored) into w.cand from the counts and copies it to
// the plan's allocation when w.cand is elsewhere (plan_alloc null: no copy); then a block barrier.
FLATEP_DEVICE void rebuild_winner(const Layout& l, const int32_t* counts, const Workspace& w, int index,
                                  int32_t* plan_alloc, int tid) {
    if (tid < 32) {
        build_candidate(WarpExec{tid}, l, counts, w.cand, w, index);
        if (plan_alloc != nullptr && w.cand != plan_alloc)
            copy_words<kWideBatch>(plan_alloc, w.cand, int64_t(l.num_ranks) * l.num_experts, tid, 32);
    }
    __syncthreads();
}

// The select record once the winner's allocation is in place (null = off).
FLATEP_DEVICE void record_selection(PlannerProfileRecord* rec, int tid, int kept, int count) {
    if (rec == nullptr || tid != 0) return;
    profile_stamp(rec, kStampSelRebuilt);
    rec->index = kept;
    rec->sm = sm_id();
    rec->count = count;
}

// prof: the select record (null = off); merge_rec: the record of the block that computes the statistics when merged.
// Every block selects the same winner; block 0 writes the plan's allocation and the profile. The derive runs over the
// grid (BlockDerive): merge false, block 0 computes the statistics in a pass of its own while the others run the
// tasks; merge true, every block runs tasks and the last to finish them computes the statistics from everyone's sums
// (ws.derive_merge, cleared by the candidate kernel's greedy block). Block 0 alone when the winner must be rebuilt.
template <bool kShared>
__global__ void __launch_bounds__(select_threads(kShared))
    select_derive_kernel(Layout l, PlanView p, PlannerWorkspace ws, int stored, CandidateMode mode_arg,
                         PlannerProfileRecord* prof, PlannerProfileRecord* merge_rec, bool merge) {
    const CandidateMode mode = kShared ? CandidateMode{true, true, true} : mode_arg;
    constexpr int kBatch = kShared ? kCopyBatch : kWideBatch;  // copy_words' batch for this block's registers
    extern __shared__ int4 smem_words[];
    int32_t* smem = reinterpret_cast<int32_t*>(smem_words);
    __shared__ PlannerShared sh;
    __shared__ PlanQuality quality[kSelectCached];  // the qualities, loaded in parallel
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const bool lead = blockIdx.x == 0;
    PlannerProfileRecord* const rec = lead ? prof : nullptr;
    int32_t* const plan_alloc = lead ? p.alloc : nullptr;  // the copy of the winner's allocation to the plan
    PlannerProfileRecord* const task_rec = gridDim.x == 1 ? rec : blockIdx.x == 1 ? prof : nullptr;
    const BlockDerive dx{
        tid, nthreads, rec, task_rec, int(blockIdx.x), int(gridDim.x), merge ? ws.derive_merge : nullptr, merge_rec};
    if (tid == 0) profile_stamp(rec, kStampEntry);
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    // The counts go to shared memory at once (the selection does not need them, and no planner kernel writes them),
    // and the qualities of the main launch's candidates (every one written by this planner) without waiting for the
    // count; those of the overflow candidates (greedy P above 6) once the count is known.
    const CandidateSmem cs = carve_candidate_smem(l, p, mode, smem);
    if (mode.counts_smem) copy_words<kBatch>(const_cast<int32_t*>(cs.counts), p.tpe_all, re, tid, nthreads);
    wait_prior_grids();  // the candidate kernels: qualities, count, stored allocations, the greedy's plan.alloc
    if (tid == 0) profile_stamp(rec, kStampSelWaited);
    const int main_count = min_of(min_of(kCandidateBlocks, max_candidates(l)), kSelectCached);
    for (int i = tid; i < main_count; i += nthreads) quality[i] = ws.cand_quality[i];
    const int count = ws.cand_meta[kMetaCount];
    const PlanQuality greedy = greedy_quality(ws);  // loaded with the count (one memory round trip)
    for (int i = main_count + tid; i < min_of(count, kSelectCached); i += nthreads) quality[i] = ws.cand_quality[i];
    __syncthreads();
    if (tid == 0) profile_stamp(rec, kStampSelLoaded);
    if (tid < 32) {
        const PlanQuality* q = count <= kSelectCached ? quality : ws.cand_quality;
        if (kWarpSelect) {
            long long* trace = rec != nullptr ? rec->trace : nullptr;
            if (trace != nullptr && tid == 0) trace[4] = clock64();
            const int winner = quality_keys_fit(greedy) ? select_candidate_keys(greedy, q, count, tid)
                                                        : select_candidate_warp(greedy, q, count, tid, trace);
            if (trace != nullptr && tid == 0) trace[0] = trace[1] = trace[2] = trace[3] = clock64();
            if (trace != nullptr && tid == 0) rec->trace_count = 5;
            if (tid == 0) sh.winner = winner;
        } else if (tid == 0) {
            sh.winner = select_candidate(greedy, q, count);
        }
    }
    __syncthreads();
    const int kept = sh.winner;
    if (tid == 0) profile_stamp(rec, kStampSelSelected);
    if (!mode.counts_smem || !mode.alloc_smem) {
        // Counts or allocation in global memory. Every block derives from the winner's allocation where it lies (the
        // stored or scratch slot, or the greedy's in the plan), copied to the block's shared memory when the
        // allocation lives there; block 0 copies it to the plan. A winner lost from its slot is rebuilt by block 0
        // into the plan (or its shared memory), which then derives alone: the other blocks return.
        Workspace w = cs.w;
        // Where the winner's allocation is (null: rebuild it).
        const int32_t* from = nullptr;
        if (kept >= 0 && kept < stored) {
            from = ws.stored_alloc + int64_t(kept) * re;
        } else if (kept >= 0 && !mode.alloc_smem) {
            const int slot = scratch_slot(kept, min_of(kCandidateBlocks, max_candidates(l)), count);
            if (slot >= 0) from = ws.cand_scratch + int64_t(slot) * re;
        }
        const bool rebuild = kept >= 0 && from == nullptr;
        if (rebuild && !lead) return;  // uniform over the block
        const int32_t* alloc_s = mode.alloc_smem ? w.cand : from != nullptr ? from : p.alloc;
        if (mode.alloc_smem && from != nullptr) {
            copy_words<kBatch>(w.cand, from, re, tid, nthreads, plan_alloc);
        } else if (mode.alloc_smem && kept < 0) {
            copy_words<kBatch>(w.cand, p.alloc, re, tid, nthreads);
        } else if (from != nullptr && lead) {
            copy_words<kBatch>(p.alloc, from, re, tid, nthreads);
        }
        __syncthreads();
        if (tid == 0) profile_stamp(rec, kStampSelCopied);
        if (rebuild) {
            w.cand = mode.alloc_smem ? w.cand : p.alloc;
            rebuild_winner(l, cs.counts, w, kept, p.alloc, tid);
            alloc_s = w.cand;
        }
        record_selection(rec, tid, kept, count);
        if (!rebuild && task_rec != nullptr && task_rec != rec && tid == 0) task_rec->trace[7] = clock64();
        const BlockDerive alone{tid, nthreads, rec, rec};
        derive_plan(rebuild ? alone : dx, l, p, cs.counts, alloc_s, cs.table, sh.sums);
        return;
    }
    // Shared memory: the counts [R*E], then the allocation derived from (the winner's, or the greedy's).
    int32_t* alloc_s = smem + re;
    if (kept >= 0 && kept < stored) {
        copy_words<kBatch>(alloc_s, ws.stored_alloc + int64_t(kept) * re, re, tid, nthreads, plan_alloc);
    } else if (kept < 0) {
        copy_words<kBatch>(alloc_s, p.alloc, re, tid, nthreads);  // the greedy's, written by candidates_kernel
    }
    __syncthreads();
    if (tid == 0) profile_stamp(rec, kStampSelCopied);
    if (kept >= stored) {  // not stored: warp 0 rebuilds it next to the counts
        const Workspace w = make_workspace(l, smem + re);
        rebuild_winner(l, smem, w, kept, plan_alloc, tid);
        alloc_s = w.cand;
    }
    record_selection(rec, tid, kept, count);
    if (task_rec != nullptr && task_rec != rec && tid == 0) task_rec->trace[7] = clock64();  // its own clock's start
    // The slot experts go right after the allocation: inside planner_core's workspace region either way.
    derive_plan(dx, l, p, smem, alloc_s, alloc_s + re, sh.sums);
}

__global__ void planner_serial_kernel(Layout l, PlannerKind kind, PlanView p, int32_t* ws, PlacementView placed) {
    if (kind == PlannerKind::kStatic) {
        for (int e = 0; e < l.num_experts; ++e) static_alloc_expert(l, p.tpe_all, placed, p.alloc, e);
    } else {
        plan_alloc(l, kind, p.tpe_all, p.alloc, ws);
    }
    derive_plan(l, p, placed);
}

// select_derive_kernel's grid: its blocks, and whether the statistics are merged by the last block to finish its tasks
// (BlockDerive::merge_to) or computed by block 0 in a pass of its own while the others run the tasks. H200, graph of
// planners, every plan bitwise the host's (benchmarks/results/planner_k3_ab_h200.csv, rows "s9"):
// * K3 (R=8, K 8/16, maxvio 1/5/20): 28.1-30.7 us with block 0's pass over 4, 8 or 16 blocks (f890ebc, four blocks:
//   28.1-30.4 us); 29.9-32.3 us merged over 8. Block 0's pass (4.2 us) and a rank task (3.6 us) are about even, and the
//   merge's atomics, fence and ticket add some 2.6 us after the tasks.
// * R=64 (K 8/16): merged over 16 blocks 124.3-143.9 us against 125.9-146.6 us (f890ebc) and 126.7-147.5 us with
//   block 0's pass over 8 or 16 blocks: that pass (14.2 us) outlasts the tasks (9 us) there.
// * R=16 and 32 (K=8) with block 0's pass over 8 blocks: 41.2-79.8 and 70.1-74.8 us, as f890ebc's 41.5-80.5 and
//   70.0-74.1 (the merge not measured there).
struct DeriveGrid {
    int blocks;
    bool merge;
};
DeriveGrid derive_grid(const Layout& l) { return l.num_ranks > 32 ? DeriveGrid{16, true} : DeriveGrid{8, false}; }

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

void launch_planner_impl(const Layout& l, PlannerKind kind, const PlanView& p, const PlannerWorkspace& ws,
                         PlannerEngine engine, cudaStream_t stream, const PlacementView& placed) {
    if (engine == PlannerEngine::kSerial) {
        planner_serial_kernel<<<1, 1, 0, stream>>>(l, kind, p, ws.serial_ws, placed);
    } else {
        PlannerProfileRecord* const prof = g_profile.load();
        const PlannerProfileSlots slots = planner_profile_slots(l);
        const CandidateMode mode = candidate_mode(l, planner_placement_now());
        const size_t cand_smem = candidate_smem_bytes(l, mode);
        const bool candidates = kind == PlannerKind::kBalanced && mode.candidates;
        if (candidates) {
            const bool shared = mode.counts_smem && mode.alloc_smem;
            const auto cand_kernel = shared              ? candidates_kernel<kPlaceShared>
                                     : mode.small_global ? candidates_kernel<kPlaceAlloc>
                                                         : candidates_kernel<kPlaceAny>;
            const auto select_kernel = shared ? select_derive_kernel<true> : select_derive_kernel<false>;
            // The small arrays in global memory: select_derive_kernel as under the global placement (the candidate
            // blocks copied their allocations where that one builds them).
            const CandidateMode select_mode = mode.small_global ? CandidateMode{true, false, false} : mode;
            const size_t select_smem = candidate_smem_bytes(l, select_mode);
            allow_smem(reinterpret_cast<const void*>(cand_kernel), cand_smem);
            allow_smem(reinterpret_cast<const void*>(select_kernel), select_smem);
            const int stored = stored_candidates(l);
            const int blocks = min_of(kCandidateBlocks, max_candidates(l));
            cand_kernel<<<blocks + 1, kCandidateThreads, cand_smem, stream>>>(l, p, ws, stored, 0, mode, prof);
            FLATEP_CUDA_CHECK_LAUNCH();
            if (max_candidates(l) > blocks) {  // only when the greedy's P may exceed 6
                launch_programmatic(cand_kernel, blocks, kCandidateThreads, cand_smem, stream, l, p, ws, stored, blocks,
                                    mode, prof);
            }
            PlannerProfileRecord* const select_rec = prof != nullptr ? prof + slots.select : nullptr;
            PlannerProfileRecord* const merge_rec = prof != nullptr ? prof + slots.merge : nullptr;
            const DeriveGrid grid = derive_grid(l);
            launch_programmatic(select_kernel, grid.blocks, select_threads(shared), select_smem, stream, l, p, ws,
                                stored, select_mode, select_rec, merge_rec, grid.merge);
            FLATEP_CUDA_CHECK_LAUNCH();
            return;
        }
        const size_t core_smem =
            (2 * size_t(l.num_ranks) * l.num_experts + size_t(planner_workspace_words(l))) * sizeof(int32_t);
        // Greedy kind: T_e [E] and the allocation [R*E] in shared memory when they fit.
        const size_t greedy_smem = (size_t(l.num_ranks) + 1) * l.num_experts * sizeof(int32_t);
        // The owner and static planners: their allocation (this kernel's first phase), then the derive; T_e alone in
        // shared memory.
        const bool use_smem = kind == PlannerKind::kBalanced ? core_smem <= kMaxPlannerSmem
                              : kind == PlannerKind::kGreedy ? greedy_smem <= kMaxPlannerSmem
                                                             : false;
        const size_t smem = max_of(size_t(l.num_experts) * sizeof(int32_t),
                                   use_smem ? (kind == PlannerKind::kBalanced ? core_smem : greedy_smem) : size_t(0));
        allow_smem(reinterpret_cast<const void*>(planner_parallel_kernel), smem);
        planner_parallel_kernel<<<1, kPlannerThreads, smem, stream>>>(
            l, kind, p, ws, use_smem, prof != nullptr ? prof + slots.parallel : nullptr, placed);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t planner_workspace_bytes(const Layout& l) { return size_t(planner_workspace_sizes(l).total) * sizeof(int32_t); }

size_t planner_candidate_smem_bytes(const Layout& l) {
    return candidate_smem_bytes(l, candidate_mode(l, planner_placement_now()));
}

bool planner_uses_candidate_path(const Layout& l) { return candidate_mode(l, planner_placement_now()).candidates; }

const char* planner_path_name(const Layout& l) {
    const CandidateMode m = candidate_mode(l, planner_placement_now());
    if (!m.candidates) return "core";  // planner_parallel_kernel: plan_alloc on one thread
    if (m.counts_smem && m.alloc_smem) return "shared";
    if (m.small_global) return "alloc-shared";
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
    if (v == "alloc-shared") return PlannerPlacement::kAllocShared;
    FLATEP_CHECK(false, "FLATEP_PLANNER_PLACEMENT must be auto, shared, counts-global, global or alloc-shared, got '",
                 v, "'");
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

PlannerEngine planner_engine() { return PlannerEngine(g_engine.load()); }

PlannerProfileSlots planner_profile_slots(const Layout& l) {
    PlannerProfileSlots s{};
    s.candidates = max_candidates(l);
    s.greedy = s.candidates;
    s.select = s.greedy + 1;
    s.parallel = s.select + 1;
    s.merge = s.parallel + 1;
    s.total = s.merge + 1;
    return s;
}

void set_planner_profile(PlannerProfileRecord* records) { g_profile.store(records); }

void launch_planner(const Layout& l, PlannerKind kind, const PlanView& plan, void* workspace, PlannerEngine engine,
                    cudaStream_t stream, const int32_t* placement) {
    FLATEP_CHECK(workspace != nullptr, "launch_planner: workspace is null");
    FLATEP_CHECK(l.num_ranks <= kMaxRanks, "launch_planner: num_ranks ", l.num_ranks, " above ", kMaxRanks);
    check_planner_kind(kind, "launch_planner: ");
    FLATEP_CHECK(layout_fits(l, kind), "launch_planner: planner ", planner_name(kind), " on a layout made for ",
                 layout_kind_name(l));
    FLATEP_CHECK(kind != PlannerKind::kStatic || placement != nullptr,
                 "launch_planner: planner static needs a placement table in device memory, got null");
    const PlacementView placed = kind == PlannerKind::kStatic ? make_placement_view(l, placement) : PlacementView{};
    launch_planner_impl(l, kind, plan, make_planner_workspace(l, workspace), engine, stream, placed);
}

void preload_planner_kernels() {
    cudaFuncAttributes attr{};
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, planner_parallel_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, planner_serial_kernel));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, candidates_kernel<kPlaceShared>));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, candidates_kernel<kPlaceAlloc>));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, candidates_kernel<kPlaceAny>));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, select_derive_kernel<true>));
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, select_derive_kernel<false>));
}

}  // namespace flatep::planner
