// PTX wrappers for cross-rank memory ordering. Names read like the instruction they emit.
//
// Ordering contracts (PTX memory model, system scope so they hold across GPUs and for host-mapped memory):
//   st_release_sys(p, v): every memory access of this thread that precedes it in program order (and every write
//     it has observed, release being cumulative) is visible to a thread that load-acquires v from p.
//   ld_acquire_sys(p): no later access of this thread is performed before this load; pairs with st_release_sys.
//   fence_acq_rel_sys(): a release fence followed by an acquire fence; used before a release store that must also
//     cover writes other threads of the block made before a __syncthreads().
#pragma once

#include <cstdint>

#include "common/macros.hpp"

namespace flatep::sync::device {

FLATEP_DEVICE uint64_t ld_acquire_sys(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

FLATEP_DEVICE void st_release_sys(uint64_t* ptr, uint64_t value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// Relaxed (no ordering) system-scope load: polls a word another agent writes, without caching it in L1.
FLATEP_DEVICE int32_t ld_relaxed_sys(const int32_t* ptr) {
    int32_t value;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

FLATEP_DEVICE uint64_t ld_relaxed_sys(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

FLATEP_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Nanoseconds of the GPU's global timer (coarse: ticks of about a microsecond on some parts).
FLATEP_DEVICE uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

}  // namespace flatep::sync::device
