#include "layout/invariants.hpp"

#include <algorithm>

#include "common/check.hpp"
#include "common/env.hpp"
#include "layout/plan.hpp"

namespace flatep {

using detail::concat;

std::string pieces_violation(int64_t align, int64_t limit, const std::vector<Piece>& pieces) {
    int64_t end = 0;
    for (const Piece& p : pieces) {
        if (p.at % align != 0) return concat(p.name, " at ", p.at, " is not ", align, "-aligned");
        if (p.at < end) return concat(p.name, " at ", p.at, " overlaps the piece before it, which ends at ", end);
        if (p.size < 0 || p.at + p.size > limit)
            return concat(p.name, " [", p.at, ", ", p.at + p.size, ") ends past ", limit);
        end = p.at + p.size;
    }
    return "";
}

bool invariant_checks_enabled() {
#if defined(FLATEP_CHECK_INVARIANTS) && FLATEP_CHECK_INVARIANTS
    return true;
#else
    static const bool enabled = env::debug();
    return enabled;
#endif
}

void check_invariant(const char* where, const std::string& violation) {
    if (violation.empty()) return;
    FLATEP_THROW(ErrorCategory::kRuntime, "layout invariant broken (", where, "): ", violation);
}

std::string symmetric_layout_violation(const Layout& l, int64_t region_bytes) {
    const SymmetricLayout s = make_symmetric_layout(l);
    const int64_t rows = l.num_recv_rows, row_bytes = int64_t(l.hidden) * 2;
    if (s.total_bytes > region_bytes)
        return concat("total_bytes ", s.total_bytes, " exceeds the region's ", region_bytes);
    // recv_x holds the bf16 rows, or FP8 dispatch's [NvS][H] e4m3 rows and [NvS][H/128] fp32 scales (fewer bytes).
    return pieces_violation(SymmetricLayout::kAlignBytes, s.total_bytes,
                            {{"barrier flags", s.barrier_offset, int64_t(kMaxRanks) * 8},
                             {"status words", s.status_offset, 16},
                             {"tpe_all", s.tpe_all_offset, int64_t(l.num_ranks) * l.num_experts * 4},
                             {"recv_x", s.recv_x_offset, rows * row_bytes},
                             {"recv_w", s.recv_w_offset, rows * 4},
                             {"row_head", s.row_head_offset, rows * 4},
                             {"row_next", s.row_next_offset, rows * 4},
                             {"partial", s.partial_offset, rows * row_bytes},
                             {"recv_marks", s.recv_marks_offset, rows}});
}

std::string plan_sizes_violation(const Layout& l, int64_t words) {
    const PlanSizes s = make_plan_sizes(l);
    if (s.total_words > words) return concat("total_words ", s.total_words, " exceeds the allocation's ", words);
    const int64_t re = int64_t(l.num_ranks) * l.num_experts, sk = int64_t(l.num_tokens) * l.topk;
    return pieces_violation(64, s.total_words,
                            {{"tpe_all", s.tpe_all, re},
                             {"alloc", s.alloc, re},
                             {"keep", s.keep, re},
                             {"spill_start", s.spill_start, re},
                             {"take_start", s.take_start, re},
                             {"group_row", s.group_row, re},
                             {"slot_expert", s.slot_expert, int64_t(l.num_ranks) * l.experts_per_rank},
                             {"cu_seqlens", s.cu_seqlens, int64_t(l.num_ranks) * l.num_groups()},
                             {"stats", s.stats, int64_t(sizeof(PlanStats) + 3) / 4},
                             {"entry_rank", s.entry_rank, sk},
                             {"entry_row", s.entry_row, sk},
                             {"row_head", s.row_head, l.num_recv_rows},
                             {"row_next", s.row_next, l.num_recv_rows},
                             {"header", s.header, kPlanHeaderWords}});
}

std::string serving_chunks_violation(int num_ranks, int epn, int num_slots, int64_t expert_bytes, size_t granularity,
                                     int64_t view_stride, const size_t* offset, const size_t* data_at, size_t own_bytes,
                                     size_t slot_bytes, size_t view_bytes) {
    const int64_t g = int64_t(granularity), eb = expert_bytes, Q = view_stride;
    const int R = num_ranks, B = num_slots;
    if (g < 1 || int64_t(own_bytes) % g != 0 || int64_t(slot_bytes) % g != 0)
        return concat("own_bytes ", own_bytes, " or slot_bytes ", slot_bytes, " is not whole granules of ", g);
    for (int r = 0; r <= R; ++r) {
        if (r == R && B == 0) break;
        const char* what = r < R ? "rank's chunk" : "slot chunk";
        if (int64_t(offset[r]) % g != 0) return concat(what, " ", r, " maps at ", offset[r], ", not a granule");
        if (int64_t(offset[r] + data_at[r]) != int64_t(r) * Q * eb)
            return concat(what, " ", r, ": its data at ", offset[r] + data_at[r], " is not view row ", int64_t(r) * Q,
                          " (byte ", int64_t(r) * Q * eb, ")");
        const int64_t need = int64_t(data_at[r]) + (r < R ? epn : B) * eb;
        const int64_t has = int64_t(r < R ? own_bytes : slot_bytes);
        if (need > has) return concat(what, " ", r, ": its data ends at ", need, ", past its allocation of ", has);
        if (r > 0 && offset[r] < offset[r - 1] + own_bytes)
            return concat(what, " ", r, " at ", offset[r], " overlaps chunk ", r - 1, ", which ends at ",
                          offset[r - 1] + own_bytes);
    }
    const size_t last_end = B > 0 ? offset[R] + slot_bytes : offset[R - 1] + own_bytes;
    const int64_t rows_end = (int64_t(R) * Q + B) * eb;
    if (last_end > view_bytes || rows_end > int64_t(view_bytes))
        return concat("view of ", view_bytes, " bytes: its chunks end at ", last_end, ", its rows at ", rows_end);
    return "";
}

std::string training_view_violation(int epn, int pool_rows, int64_t row_bytes, size_t data_bytes, size_t own_bytes,
                                    size_t pool_bytes, size_t pool_mapped_bytes, size_t view_bytes) {
    if (int64_t(data_bytes) != epn * row_bytes)
        return concat("the layer's data is ", data_bytes, " bytes, not epn=", epn, " rows of ", row_bytes);
    if (data_bytes > own_bytes) return concat("the layer's ", data_bytes, " bytes overflow its memory of ", own_bytes);
    if (int64_t(pool_bytes) < pool_rows * row_bytes || pool_bytes > pool_mapped_bytes)
        return concat("the pool's ", pool_rows, " rows of ", row_bytes, " bytes do not fit its allocation of ",
                      pool_bytes, " (mapped ", pool_mapped_bytes, ")");
    // Rows [0, epn) end at own_bytes, where the pool is mapped; rows [epn, epn + pool_rows) are the pool's.
    const int64_t rows_end = int64_t(own_bytes) + pool_rows * row_bytes;
    if (int64_t(own_bytes + pool_mapped_bytes) != int64_t(view_bytes) || rows_end > int64_t(view_bytes))
        return concat("view of ", view_bytes, " bytes: the layer's memory (", own_bytes, ") and the pool's (",
                      pool_mapped_bytes, ") are not its pieces, or its rows end at ", rows_end);
    return "";
}

std::string slot_table_violation(const Layout& l, const int32_t* slot_expert) {
    if (slot_expert == nullptr) return "";
    const int epn = l.experts_per_rank;
    for (int d = 0; d < l.num_ranks; ++d) {
        bool unused_seen = false;
        int32_t previous = -1;
        const int32_t* const row = slot_expert + int64_t(d) * epn;
        for (int j = 0; j < epn; ++j) {
            const int32_t e = row[j];
            // A planned table fills slots from 0 in ascending expert order; a static placement (l.placed) keeps the
            // user's order and gaps, and holds an expert at most once a rank.
            const char* why = e < -1 || e >= l.num_experts ? "not -1 or an expert id in [0, E)"
                              : e < 0                      ? nullptr
                              : j >= l.num_slots           ? "a used slot past the rank's B slots"
                              : l.home_rank(e) == d        ? "a replica of the rank's own expert"
                              : l.placed && std::find(row, row + j, e) != row + j ? "an expert repeated on the rank"
                              : l.placed                                          ? nullptr
                              : unused_seen                                       ? "a used slot after an unused one"
                              : e <= previous                                     ? "not above the slot before it"
                                                                                  : nullptr;
            if (why != nullptr)
                return concat("slot_expert[", d, "][", j, "] = ", e, ": ", why, " (E=", l.num_experts,
                              ", B=", l.num_slots, ")");
            unused_seen = unused_seen || e < 0;
            previous = e >= 0 ? e : previous;
        }
    }
    return "";
}

}  // namespace flatep
