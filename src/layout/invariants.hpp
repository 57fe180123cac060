// Invariants of the library's memory layouts, checked where the memory is made: every byte a layout places lies inside
// its allocation, regions and arrays are aligned and do not overlap, every view maps what its rows read, and a plan's
// slot table stays within the slots. Each *_violation function recomputes nothing of the layout it checks: it takes
// what was computed (offsets, sizes, mapped bytes) and states the bounds they must satisfy, so an arithmetic slip in
// the layout shows as a violation rather than passing by construction. It returns "" when the layout holds, else
// one line naming the first bound broken.
//
// The runtime checks them with FLATEP_CHECK_INVARIANT(where, <one of them>) where each layout is made (a Buffer's
// symmetric region and plan arrays, the pools' serving chunks and training views) and at each pools op (its plan's
// slot table): one line at each site. The checks run when FLATEP_DEBUG is set (README; read once per process) and
// always in a build with FLATEP_CHECK_INVARIANTS (the sanitizer job's, scripts/sanitize.sh); otherwise the macro
// evaluates nothing. tests/unit/host/test_layout_invariants.cpp calls the *_violation functions directly, over random
// shapes, in every build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "layout/layout.hpp"

namespace flatep {

// Whether the checks run: FLATEP_CHECK_INVARIANTS builds always, others when FLATEP_DEBUG is set at the first call.
bool invariant_checks_enabled();

// When `violation` is not empty: throws kRuntime "layout invariant broken (<where>): <violation>" (a library bug,
// never bad input).
void check_invariant(const char* where, const std::string& violation);

// Evaluates `violation` (a *_violation call) and checks it, only when invariant_checks_enabled().
#define FLATEP_CHECK_INVARIANT(where, violation)                                               \
    do {                                                                                       \
        if (::flatep::invariant_checks_enabled()) ::flatep::check_invariant(where, violation); \
    } while (0)

// Consecutive pieces of one allocation of `limit` units (bytes or words), in order: each starts `align`-aligned, at or
// after the end of the one before, and ends by `limit`.
struct Piece {
    const char* name;
    int64_t at, size;
};
std::string pieces_violation(int64_t align, int64_t limit, const std::vector<Piece>& pieces);

// A Buffer's symmetric region (make_symmetric_layout(l)) inside `region_bytes`: every region 256-byte aligned, in
// order, holding its bytes (barrier flags, status words, tpe_all [R][E], recv_x [NvS][H] bf16 -- also the FP8 rows and
// scales -- recv_w, row_head, row_next [NvS], partial [NvS][H], recv_marks [NvS]), the last ending by total_bytes.
std::string symmetric_layout_violation(const Layout& l, int64_t region_bytes);

// A plan allocation of `words` int32 words (make_plan_sizes(l)): every array 64-word aligned, in order, of its size.
std::string plan_sizes_violation(const Layout& l, int64_t words);

// One projection of a serving view (runtime/serving_view.hpp: R + 1 chunks, rank r's own experts at view row r*Q and
// the B slots at row R*Q): chunk r maps at offset[r] (a multiple of the granularity) and holds its data at
// data_at[r], exactly row r*Q (slot chunk: R*Q); rank r's epn experts end inside own_bytes, the B slots inside
// slot_bytes; no two chunks overlap; the view (view_bytes) spans every chunk and every row [0, R*Q + B).
std::string serving_chunks_violation(int num_ranks, int epn, int num_slots, int64_t expert_bytes, size_t granularity,
                                     int64_t view_stride, const size_t* offset, const size_t* data_at, size_t own_bytes,
                                     size_t slot_bytes, size_t view_bytes);

// One projection of a training view ([2*epn] rows of row_bytes: the layer's own memory of own_bytes mapped first with
// its epn rows at its end, then the pool of pool_mapped_bytes, holding pool_rows rows, continuing the view): the
// layer's data (data_bytes, epn rows) fits its memory and ends where the pool starts, the pool's rows fit its
// allocation (pool_bytes, mapped as pool_mapped_bytes), and the view (view_bytes) holds every row.
std::string training_view_violation(int epn, int pool_rows, int64_t row_bytes, size_t data_bytes, size_t own_bytes,
                                    size_t pool_bytes, size_t pool_mapped_bytes, size_t view_bytes);

// A plan's slot table slot_expert [R][epn] (host memory; null: nothing to check, e.g. a device plan): slot j of rank d
// holds -1 or an expert id in [0, E) that rank d does not own, j >= B holds -1, and the used slots come first, in
// ascending expert id; a static placement's table (l.placed) keeps the user's order and gaps, an expert at most once
// a rank.
std::string slot_table_violation(const Layout& l, const int32_t* slot_expert);

}  // namespace flatep
