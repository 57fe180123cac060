// Device memory a benchmark case needs, estimated from its shapes before anything is allocated (issue 59 item 4): the
// C++ drivers print the estimate, then refuse a case that does not fit the free device memory (exit 2, one line)
// instead of dying of an uncaught out-of-memory error halfway through. Host arithmetic only (no CUDA): the drivers
// pass in what only the CUDA build knows (the plan op's workspace bytes, cudaMemGetInfo's free bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "internal/api.hpp"

namespace flatep::bench {

inline constexpr int64_t kGiB = int64_t(1) << 30;
// cudaMalloc hands out large blocks in 2 MiB pages: every allocation of an estimate is rounded up to one (for small
// ones an overestimate, which is the side to err on).
inline constexpr int64_t kAllocationGranule = int64_t(2) << 20;
// What no estimate below counts: the kernels' own scratch (kernels::scratch_buffer), LocalDeviceGroup's epochs and
// wait records, the allocator's fragmentation. An allowance, not measured.
inline constexpr int64_t kMemoryAllowance = kGiB;

// One named part: `count` allocations of `bytes` each (every rank's, or one), each rounded up to the granule.
struct MemoryPart {
    std::string name;
    int64_t bytes = 0;  // one allocation, as asked for
    int64_t count = 1;
    int64_t total() const;
};

// The device memory of one case on one device: the parts held at its peak, plus kMemoryAllowance.
struct MemoryEstimate {
    std::string what;  // e.g. "preset k3 (R8_S4096_E896_H7168_K8)"
    std::vector<MemoryPart> parts;

    void add(std::string name, int64_t bytes, int64_t count = 1);
    int64_t total() const;         // the parts (rounded) and the allowance
    std::string describe() const;  // "symmetric region 8 x 4.29 GiB, plan 8 x 2.00 MiB, ...; 97.31 GiB"
};

// "12.34 GiB" (>= 1 GiB), "5.6 MiB" (>= 1 MiB) or "0.5 KiB".
std::string size_text(int64_t bytes);

// The device buffers of common/kernel_step.cuh's KernelStep on each of the layout's R virtual ranks (one GPU): the
// symmetric region, the plan and its workspace (plan_workspace_bytes: runtime::plan_workspace_bytes(l), CUDA-side),
// the inputs (top-k ids, rows, weights), the expert outputs and combine output, the expert pools (own experts and
// pool_slots slots per projection, "of projection q" where there are several) and, with grads, fp32 gradients and
// reduce pools of projection 0.
MemoryEstimate kernel_step_memory(const Layout& l, const std::vector<int64_t>& expert_bytes, int pool_slots, bool grads,
                                  int64_t plan_workspace_bytes);

// One rank process of ep_bench_multi (one GPU): its Buffer (symmetric region, plan_slots plans, the plan op's
// workspace: plan_workspace_bytes), the inputs, expert outputs and combine output, the checks' row lists, and the
// NCCL baselines' send, receive and reverse rows (dedup: a row per (token, home rank); entries: a row per (token,
// expert)) at their worst case, every source's rows to this rank (the routing is drawn later), plus an allowance for
// NCCL's own buffers (not measured).
MemoryEstimate ep_rank_memory(const Layout& l, int64_t plan_workspace_bytes, int plan_slots);
inline constexpr int64_t kNcclAllowance = kGiB;

// "" when `need` fits `free_bytes`, else the refusal: "WHAT needs N GiB on DEVICE, F GiB free (--memory-gib
// overrides)" (given: "F GiB by --memory-gib" instead of "F GiB free ...").
std::string does_not_fit(const MemoryEstimate& e, int64_t free_bytes, const std::string& device, bool given);

// The free bytes to compare with: --memory-gib's when > 0, else `device_free` (cudaMemGetInfo's).
int64_t available_bytes(double memory_gib, int64_t device_free);

// Prints every estimate ("memory estimate: ...", one line for equal ones); when one does not fit, prints "PROGRAM: does
// not fit: ..." for the first such on stderr and exits 2. The drivers call it before they allocate anything.
void require_fit(const std::string& program, const std::vector<MemoryEstimate>& estimates, int64_t free_bytes,
                 const std::string& device, bool given);

}  // namespace flatep::bench
