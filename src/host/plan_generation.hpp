// Cross-rank check that every rank passes a plan of the same step to a data-plane op (design §8). Each rank publishes
// the generation of its plan in its own symmetric region before the op's entry barrier and compares every peer's
// after it. The slot is safe to read until the op's second barrier: no peer can publish for its next op before every
// rank has passed that barrier, which is why a mismatch is thrown only after that barrier. Generation 0 (a plan not
// stamped by a Buffer) is not checked. The CUDA kernels do not check this yet.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/check.hpp"
#include "layout/layout.hpp"
#include "planner/plan.hpp"

namespace flatep::host {

inline uint64_t plan_generation(const PlanView& p) {
    return uint64_t(uint32_t(p.header[kHeaderGenerationLo])) |
           (uint64_t(uint32_t(p.header[kHeaderGenerationHi])) << 32);
}

inline uint64_t* generation_slot(uint8_t* base, const SymmetricLayout& sym) {
    return reinterpret_cast<uint64_t*>(base + sym.generation_offset);
}

// Before the entry barrier (whose release store orders this write before every peer's reads).
inline void publish_plan_generation(uint8_t* own_base, const SymmetricLayout& sym, uint64_t generation) {
    std::atomic_ref<uint64_t>(*generation_slot(own_base, sym)).store(generation, std::memory_order_relaxed);
}

// After the entry barrier: "" when every peer passed a plan of this rank's step (or an unstamped one), else the
// error text naming both steps. Every rank sees a difference when any two differ, so all of them fail; they must first
// pass the op's second barrier together (no peer may publish for its next op before all have read), then throw.
inline std::string plan_generation_mismatch(const char* op, int rank, int num_ranks, uint8_t* const* peers,
                                            const SymmetricLayout& sym, uint64_t mine) {
    if (mine == 0) return "";
    for (int p = 0; p < num_ranks; ++p) {
        const uint64_t theirs =
            std::atomic_ref<uint64_t>(*generation_slot(peers[p], sym)).load(std::memory_order_relaxed);
        if (theirs != 0 && theirs != mine) {
            return detail::concat(op, ": rank ", rank, " passed the plan of step ", mine, " but rank ", p,
                                  " the plan of step ", theirs, "; every rank must pass its plan of the same step");
        }
    }
    return "";
}

}  // namespace flatep::host
