// The static planner's placement (design §4 "The static planner"): B slots a rank that hold fixed replicas, set once
// (Buffer::set_placement) and used by every step's plan until the next placement, as serving engines place redundant
// experts periodically. Its plan is a fixed function of the step's counts: no search, no slot choice.
//
// The split rule. Expert e's copies are its home rank, then the ranks whose slots hold e, in ascending rank order
// (n_e copies; copy c is the c-th of them). Its T_e = sum_s tpe_all[s][e] entries of the step are split as evenly as
// integers allow: every copy gets floor(T_e / n_e), and the T_e mod n_e copies starting at copy (e mod n_e), taken
// cyclically, get one more. That is alloc[d][e]; which source's entries go to which copy is plan.hpp's keep / spill /
// take order, as for every planner, so the same counts always route the same entries of a rank to the same copy.
//
// The placement table (int32 words, in device memory for the GPU planner, set up by set_placement and read by every
// plan op): the placement [R][B] as given, then copy [R][E] (copy index c of rank d for expert e, -1 when d holds no
// copy of e) and copies [E] (n_e), both derived from the placement on the host once, so that a plan reads one word
// per cell.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/macros.hpp"
#include "layout/layout.hpp"

namespace flatep::planner {

struct PlacementView {
    const int32_t* slots;   // [R][B] expert of each rank's slot, -1 empty (the placement as given)
    const int32_t* copy;    // [R][E] rank d's copy index for expert e (home and slot holders, ascending rank); -1: none
    const int32_t* copies;  // [E] n_e: 1 + the slots holding e over all ranks
};

// int32 words of a placement table: R*B + R*E + E.
FLATEP_HD int64_t placement_table_words(const Layout& l) {
    const int64_t r = l.num_ranks, e = l.num_experts;
    return r * l.num_slots + r * e + e;
}

FLATEP_HD PlacementView make_placement_view(const Layout& l, const int32_t* table) {
    PlacementView v{};
    v.slots = table;
    v.copy = table + int64_t(l.num_ranks) * l.num_slots;
    v.copies = v.copy + int64_t(l.num_ranks) * l.num_experts;
    return v;
}

// The split rule for one copy: entries of copy `copy` among `copies` copies of `expert`, whose step has `total`.
FLATEP_HD int32_t static_share(int32_t total, int32_t copies, int32_t copy, int expert) {
    const int32_t first = expert % copies;                      // the first copy that gets one more
    const int32_t offset = (copy - first + copies) % copies;    // its place in the cyclic order from there
    return total / copies + (offset < total % copies ? 1 : 0);  // floor(T_e / n_e), +1 for T_e mod n_e of them
}

// alloc[d][e] for every rank d of one expert e, from the counts tpe [R][E] and the placement. The host planner calls
// it for every expert, the GPU planner's threads for theirs.
FLATEP_HD void static_alloc_expert(const Layout& l, const int32_t* tpe, const PlacementView& placed, int32_t* alloc,
                                   int e) {
    const int R = l.num_ranks, E = l.num_experts;
    int32_t total = 0;
    for (int s = 0; s < R; ++s) total += tpe[int64_t(s) * E + e];
    const int32_t copies = placed.copies[e];
    for (int d = 0; d < R; ++d) {
        const int32_t c = placed.copy[int64_t(d) * E + e];
        alloc[int64_t(d) * E + e] = c < 0 ? 0 : static_share(total, copies, c, e);
    }
}

// Host: "" when `placement` is a valid [R][B] placement for the layout (R*B entries; each an expert id in [0, E) or
// -1 for an empty slot; never the rank's own expert; no expert twice on one rank), else a one-line description of the
// first violation, naming the entry and its value ("placement[1][0] = 9 ...").
std::string check_placement(const Layout& l, std::span<const int32_t> placement);

// Host: the placement table of a valid placement (throws kInvalidArgument with check_placement's message otherwise).
std::vector<int32_t> make_placement_table(const Layout& l, std::span<const int32_t> placement);

}  // namespace flatep::planner
