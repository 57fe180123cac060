// Which kind of row a receive-buffer row is, read from a plan (design §5): the device counterpart of
// host/group_rows.hpp.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace flatep::kernels {

enum RowKind : int {
    kRowReal = 0,     // an entry row: start <= r < start + alloc of its group
    kRowPadding = 1,  // inside a group's padded range but past its entries: zero
    kRowPastEnd = 2,  // past the last group's padded end: unspecified, never touched
};

// Kind of row r of `rank` (find_group over the rank's inclusive group ends; layout/plan.hpp).
FLATEP_DEVICE RowKind classify_row(const Layout& l, const PlanView& p, int rank, int64_t r) {
    const int G = l.num_groups();
    const int32_t* cu = p.cu_seqlens + int64_t(rank) * G;
    const int lo = find_group(cu, G, r);
    if (lo >= G) return kRowPastEnd;
    const int32_t start = lo == 0 ? 0 : cu[lo - 1];
    const int expert = group_expert(l, p, rank, lo);
    const int32_t size = expert < 0 ? 0 : p.alloc[int64_t(rank) * l.num_experts + expert];
    return r - start < size ? kRowReal : kRowPadding;
}

// The row that position v of a walk over rows [0, end) visits: a fixed bijection, r = v * P mod end with P = 2^31 - 1
// (prime and above any end, so coprime to it). A group's rows are contiguous, its real ones first, and group starts
// are multiples of align; a warp-per-row walk r = warp, warp + num_warps, ... would hand a decode-sized call's real
// rows to the few warps whose index those starts share. This order spreads them evenly over the warps.
FLATEP_DEVICE int64_t spread_row(int64_t v, int32_t end) {
    return int64_t((uint64_t(v) * 2147483647ull) % uint64_t(end));
}

// Padded end of the last group of `rank` (rows at or past it are kRowPastEnd).
FLATEP_DEVICE int32_t rows_end(const Layout& l, const PlanView& p, int rank) {
    return p.cu_seqlens[int64_t(rank) * l.num_groups() + l.num_groups() - 1];
}

}  // namespace flatep::kernels
