// Device helpers of the GPU planner: profile stamps (see PlannerProfileRecord in planner/gpu_planner.cuh) and
// programmatic dependent launch.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "planner/gpu_planner.cuh"

namespace flatep::planner {

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

}  // namespace flatep::planner
