// Row ranges of the groups of one rank's receive buffer (design §5), read from a plan: the helper dispatch and
// combine share to visit real rows and padding rows.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace flatep::host {

struct GroupRows {
    int32_t start;       // first row of the group
    int32_t real_end;    // start + entries computed in the group
    int32_t padded_end;  // inclusive padded end (cu_seqlens)
};

// Group g (< l.num_groups(), either layout: layout.hpp) of `rank`.
inline GroupRows group_rows(const Layout& l, const PlanView& p, int rank, int g) {
    const int32_t* cu = p.cu_seqlens + int64_t(rank) * l.num_groups();
    const int32_t start = g == 0 ? 0 : cu[g - 1];
    return GroupRows{start, start + group_entries(l, p, rank, g), cu[g]};
}

}  // namespace flatep::host
