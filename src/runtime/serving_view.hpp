// The serving view's geometry (design §5 "Serving layout"): per projection one virtual range holding every rank's own
// experts and then this rank's B slots, rank r's expert l at view row r*Q + l and slot j at row R*Q + j, the same on
// every rank. Each rank's chunk is a separate allocation (that rank's memory, mapped in place), and allocations map at
// multiples of the granularity G: chunk r is mapped at floor(r*Q*eb / G)*G and holds its data at the rest of r*Q*eb,
// so the data lands exactly on its row whatever eb (one expert's bytes) is. Q >= epn is the smallest stride for which
// no two chunks overlap in every projection; Q - epn rows between two chunks are empty pad rows (none when epn*eb
// is a multiple of G, e.g. Kimi K3's and DeepEP's shapes on CUDA's 2 MiB granularity).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/check.hpp"
#include "common/math.hpp"

namespace flatep::runtime {

struct ServingGeometry {
    std::vector<size_t> offset;   // [R + 1]: where rank r's chunk (r < R) and the slot chunk (r = R) map, bytes
    std::vector<size_t> data_at;  // [R + 1]: the data's offset inside each chunk's allocation
    size_t own_bytes = 0;         // every rank's own-weights allocation (the same size on every rank)
    size_t slot_bytes = 0;        // the slot pool's allocation (0 when B = 0)
    size_t view_bytes = 0;
};

// The geometry of one projection at stride q; `ok` false when two chunks would overlap.
inline ServingGeometry serving_geometry(int num_ranks, int epn, int num_slots, int64_t expert_bytes, size_t granularity,
                                        int64_t q, bool* ok) {
    const size_t g = granularity, eb = size_t(expert_bytes);
    ServingGeometry s;
    size_t max_at = 0;
    for (int r = 0; r <= num_ranks; ++r) {
        const size_t start = size_t(r) * size_t(q) * eb;
        s.offset.push_back(start / g * g);
        s.data_at.push_back(start % g);
        if (r < num_ranks) max_at = max_of(max_at, start % g);
    }
    s.own_bytes = round_up<size_t>(max_at + size_t(epn) * eb, g);
    s.slot_bytes = num_slots > 0 ? round_up<size_t>(s.data_at[num_ranks] + size_t(num_slots) * eb, g) : 0;
    *ok = true;
    for (int r = 0; r + 1 <= num_ranks; ++r) {
        const bool last = r + 1 == num_ranks;
        if (last && num_slots == 0) break;
        if (s.offset[r + 1] < s.offset[r] + s.own_bytes) *ok = false;
    }
    // The view spans every row [0, R*q + B) of the tensor laid over it (with B = 0, the last chunk's pad rows too).
    s.view_bytes = num_slots > 0 ? s.offset[num_ranks] + s.slot_bytes : s.offset[num_ranks - 1] + s.own_bytes;
    s.view_bytes = max_of(s.view_bytes, round_up<size_t>((size_t(num_ranks) * size_t(q) + num_slots) * eb, g));
    return s;
}

// The smallest stride Q >= epn that fits every projection (expert_bytes[p]). A chunk takes at most epn*eb + 2G bytes
// and starts less than G before its row, so pad rows of 3G bytes always fit: the search ends by epn + ceil(3G/eb).
inline int64_t serving_stride(int num_ranks, int epn, int num_slots, const std::vector<int64_t>& expert_bytes,
                              size_t granularity) {
    int64_t limit = epn;
    for (int64_t eb : expert_bytes)
        limit = max_of<int64_t>(limit, epn + ceil_div<int64_t>(3 * int64_t(granularity), eb));
    for (int64_t q = epn; q <= limit; ++q) {
        bool all = true;
        for (int64_t eb : expert_bytes) {
            bool ok = false;
            serving_geometry(num_ranks, epn, num_slots, eb, granularity, q, &ok);
            all = all && ok;
        }
        if (all) return q;
    }
    FLATEP_THROW(ErrorCategory::kRuntime, "serving view: no stride up to ", limit, " fits (epn ", epn, ", granularity ",
                 granularity, ")");
}

}  // namespace flatep::runtime
