// The GPU planner (design §4): from plan.tpe_all (in device memory) the global part of the plan, bitwise the host
// planner's (planner_core.hpp / plan_counts). The plan op runs it between the kernels' histogram + all-gather and
// their routing (the runtime wires the three: runtime/device_ops.cpp). No host synchronisation: graph-capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flatep/types.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace flatep::planner {

// Device scratch the GPU planner needs (launch_planner's `workspace`, 256-byte aligned), in bytes.
size_t planner_workspace_bytes(const Layout& layout);

// Where the balanced planner's candidate blocks keep the counts tpe_all [R*E] and the allocation each works on [R*E]
// (planner_core's small arrays and home_ahead's table in shared memory too, at most 200 KiB a block, except under
// kAllocShared). The plan is the same bitwise under every placement; only the speed differs.
enum class PlannerPlacement : int {
    kAuto = 0,          // everything in shared memory when it fits (E=896: R <= 16), else the counts in global memory
                        // when the rest fits (R=32), else kAllocShared when the allocation fits alone (R=64), else
                        // the counts and the allocation in global memory
    kShared = 1,        // the path before issue 22: everything in shared memory when it fits, else (E=896, R >= 32)
                        // plan_alloc on one thread of planner_parallel_kernel over global memory (ms)
    kCountsGlobal = 2,  // the counts in global memory, the allocation in shared memory when it fits, else global
    kGlobal = 3,        // the counts and the allocation in global memory (the workspace's stored / scratch slots)
    kAllocShared = 4,   // the allocation and planner_core's [R] arrays alone in shared memory, the counts and every
                        // [E] array (T_e, the pack items, home_ahead's table) in global memory; else global
};
// Process-wide; the default comes from FLATEP_PLANNER_PLACEMENT (auto | shared | counts-global | global |
// alloc-shared; auto when unset), read at the first planner launch. Applies to the planners launched afterwards (a
// captured graph keeps the kernels of its capture).
void set_planner_placement(PlannerPlacement placement);
PlannerPlacement planner_placement_now();

// Under the placement now in effect: the dynamic shared memory one block of the balanced planner's candidate path
// needs, whether launch_planner takes that path (only kShared leaves it, where everything does not fit), and the path
// by name: "shared", "counts-global", "global", or "core" (plan_alloc on one thread).
size_t planner_candidate_smem_bytes(const Layout& layout);
bool planner_uses_candidate_path(const Layout& layout);
const char* planner_path_name(const Layout& layout);

// How the planner step runs on the GPU.
enum class PlannerEngine : int {
    kParallel = 0,  // planner_core on warp executors: one warp per balanced-planner candidate (the default)
    kSerial = 1,    // one thread calling plan_alloc / derive_plan as written (reference; slow)
};

// From plan.tpe_all (already in device memory) computes the global part of the plan on `stream`. `workspace`: at
// least planner_workspace_bytes(layout) bytes of device memory, not null. placement: the static planner's placement
// table (planner/static_placement.hpp) in device memory, read by the kernels; the other planners ignore it.
void launch_planner(const Layout& layout, PlannerKind kind, const PlanView& plan, void* workspace, PlannerEngine engine,
                    cudaStream_t stream, const int32_t* placement = nullptr);

// Engine of the plan op's planner (process-wide; default kParallel).
void set_planner_engine(PlannerEngine engine);
PlannerEngine planner_engine();

// Planner profile (benchmarks only; off by default, and then free: the kernels test one null kernel argument).
// While set_planner_profile(records) holds a non-null device array of planner_profile_slots(layout).total records,
// every planner launched by launch_planner (kParallel engine, the plan op's too) writes %globaltimer (ns) and clock64
// (SM cycles) stamps of its blocks' phases there, one thread per block, each stamp taken after the block or warp
// barrier that ends the phase. Records are overwritten by every planner launched while the array is set (so a graph
// captures the pointer of its launch); stamps of phases not reached keep what was there (clear the array first).
struct PlannerProfileRecord {
    static constexpr int kStamps = 10;
    static constexpr int kTrace = 48;
    unsigned long long globaltimer[kStamps];  // ns; 0 = phase not reached
    long long clock[kStamps];                 // SM cycles
    int32_t index;                            // candidate: its index; select: the kept index (-1 = greedy)
    int32_t sm;                               // %smid of the block
    int32_t flags;                            // candidate: 1 = built a plan (0 = infeasible for its budget)
    int32_t count;                            // greedy / select: candidates select_candidate looks at
    int32_t trace_count;                      // candidate: entries of trace
    long long trace[kTrace];                  // candidate: clock64 at build start, then after every step of its
                                              // warp (WarpExec::single), the last one at the build's end
};
// Stamps of each record kind (index into globaltimer / clock); a phase lasts from the previous stamp to its own.
enum PlannerProfileStamp : int {
    // candidates_kernel, one record per candidate index (and the greedy block's record):
    kStampEntry = 0,      // block entry
    kStampLoaded = 1,     // counts ready (a shared-memory copy is made with the first home allocation)
    kStampBuilt = 2,      // candidate (or greedy) allocation built by warp 0
    kStampStored = 3,     // allocation copy to global memory issued (stored candidates; the greedy's to the plan)
    kStampEvaluated = 4,  // quality evaluated and written (end of the candidate)
    // select_derive_kernel (and, for the greedy planner kind, planner_parallel_kernel):
    kStampSelLoaded = 1,    // qualities (and counts) loaded; parallel kernel: home allocation
    kStampSelSelected = 2,  // selection done; parallel kernel: greedy done
    kStampSelCopied = 3,    // the winner's (or greedy's) allocation copied
    kStampSelRebuilt = 4,   // the winner rebuilt when it was not stored (= kStampSelCopied otherwise)
    kStampDeriveSums = 5,   // derive: its one pass (keep / spill / take, slot experts, group rows, sums)
    kStampDeriveSlots = 6,  // (= kStampDeriveSums; kept for the record layout)
    kStampDeriveRows = 7,   // (= kStampDeriveSums after one more block barrier)
    kStampDeriveEnd = 8,    // derive: statistics (end of the kernel)
    kStampSelWaited = 9,    // select_derive_kernel: the candidate kernels done (its wait for them returned)
};
// Record slots: [0, candidates) one per candidate index, then the greedy block, select_derive_kernel (its block 0),
// planner_parallel_kernel (greedy planner kind, or the balanced planner when its candidates do not fit in shared
// memory), and the select_derive_kernel block that computes the statistics (kStampEntry: it starts them, the others'
// sums added; kStampDeriveEnd; index: the block).
struct PlannerProfileSlots {
    int candidates, greedy, select, parallel, merge, total;
};
PlannerProfileSlots planner_profile_slots(const Layout& layout);
// The records (device memory) the planners launched from now on write to; nullptr turns profiling off.
void set_planner_profile(PlannerProfileRecord* records);

// Host: loads the planner's kernels on the current device now (see kernels::preload_all_kernels: no lazy module load
// while a peer's kernel spins). The runtime calls it with the kernels' preload.
void preload_planner_kernels();

}  // namespace flatep::planner
