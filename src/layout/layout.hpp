// Layout: the one object that derives every size and offset from a Config (design §1, §5). Plain
// arithmetic, usable from host code and CUDA kernels alike; kernels receive it by value inside their Args.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "flatep/types.hpp"

namespace flatep {

struct Config;

// Expert `expert_idx` lives on its home rank expert_idx / epn (design §1), as its local expert expert_idx % epn there.
// Every backend derives an expert's home and local index through these two (or the Layout members below).
FLATEP_HD constexpr int home_rank(int expert_idx, int experts_per_rank) { return expert_idx / experts_per_rank; }
FLATEP_HD constexpr int local_expert(int expert_idx, int experts_per_rank) { return expert_idx % experts_per_rank; }

// The groups of a rank's receive buffer (design §5), in order; cu_seqlens has one entry per group.
//   Training (B == epn): 2*epn groups: group g < epn is the rank's own expert rank*epn + g, group epn + j its slot j.
//   Serving (B < epn): R*Q + B groups, one per row of the weight view [R*Q + B] every rank sees the same way: group
//   g < R*Q is view row g, rank g / Q's local expert g % Q (expert (g / Q)*epn + g % Q) when g % Q < epn, else a pad
//   row (no expert, always empty); group R*Q + j is slot j. A replica on a rank sits in a slot group or, when it got
//   no slot, in its expert's view-row group (the GEMM reads its weights in place from the home rank).
struct Layout {
    int num_ranks;         // R
    int num_experts;       // E
    int experts_per_rank;  // epn = E / R
    int num_tokens;        // S
    int topk;              // K
    int hidden;            // H
    int align;             // group padding
    int capacity;          // C: S*K (exact) or ceil(f*S*K) (slack); R*S*K for the owner planner
    int num_recv_rows;     // NvS = round_up(C + 2*epn*(align-1), align); owner: round_up(C + epn*(align-1), align)
    bool exact;            // capacity_factor == 1 (and not the owner planner)
    int num_slots;         // B: replica slots per rank, in [0, epn]
    int view_stride;       // Q: weight-view rows per rank, >= epn (serving layout only)
    bool serving;          // B < epn: the view layout of the groups
    bool owner;            // laid out for the owner planner (no replicas, capacity R*S*K)
    bool placed;           // laid out for the static planner (a fixed placement of B slots a rank, capacity R*S*K)

    FLATEP_HD int num_groups() const { return serving ? num_ranks * view_stride + num_slots : 2 * experts_per_rank; }
    // Serving: the weight-view row (and group) of expert e's rows on its home rank, home*Q + local.
    FLATEP_HD int expert_view_row(int expert_idx) const {
        return home_rank(expert_idx) * view_stride + local_expert(expert_idx);
    }
    // Group of slot 0: epn (training) or R*Q (serving).
    FLATEP_HD int first_slot_group() const { return serving ? num_ranks * view_stride : experts_per_rank; }
    FLATEP_HD int num_entries() const { return num_tokens * topk; }  // S*K: entries one rank routes at most
    FLATEP_HD int home_rank(int expert_idx) const { return flatep::home_rank(expert_idx, experts_per_rank); }
    FLATEP_HD int local_expert(int expert_idx) const { return flatep::local_expert(expert_idx, experts_per_rank); }
    FLATEP_HD int64_t row_bytes() const { return int64_t(hidden) * 2; }  // one bf16 row
    // The padded size of a group of `rows` rows (design §5): rows rounded up to align. Every group size and group
    // end (cu_seqlens) is derived through this one function.
    FLATEP_HD int padded(int rows) const { return round_up(rows, align); }
};

// The experts' weight view the groups follow (design §5): B replica slots per rank and Q view rows per rank. A Buffer
// made from ExpertPools takes the pools' (ExpertPools::num_slots, view_stride); the default is the training layout.
// The largest view stride Q.
inline constexpr int kMaxViewStride = 1 << 20;

struct ViewShape {
    int num_slots = -1;   // B: -1 = epn (training: 2*epn groups); 0..epn-1 = serving (R*Q + B groups)
    int view_stride = 0;  // Q: 0 = epn; else in [epn, 2^20] (the serving layout only uses it)
};

// The one range check of B: -1 (epn) or in [0, epn]. `who` prefixes the message ("" or e.g. "ExpertPools: ").
void check_num_slots(const char* who, int num_slots, int experts_per_rank);

// Builds the layout of a validated config (calls config.validate(planner), then checks `view` against it) for plans
// of `planner`: the owner planner gets capacity R*S*K and NvS = round_up(C + epn*(align-1), align) (own groups only);
// the static planner capacity R*S*K and NvS = round_up(C + (epn + B)*(align-1), align) (own groups and the B placed
// slots); every other planner C and NvS as above. The group layout (training or serving) follows view.num_slots
// whatever the planner.
Layout make_layout(const Config& config, PlannerKind planner = PlannerKind::kBalanced, const ViewShape& view = {});

// Throws kInvalidArgument "<op>planner kind must be greedy (0), balanced (1), owner (2) or static (3), got <kind>"
// for a value of no PlannerKind (op: a prefix such as "plan: ", or "").
void check_planner_kind(PlannerKind kind, const char* op = "");

// Whether a layout was made for `kind` (make_layout(config, kind)): the owner and the static planner each have a
// layout of their own, the balancing planners share theirs.
FLATEP_HD constexpr bool layout_fits(const Layout& l, PlannerKind kind) {
    return l.owner == (kind == PlannerKind::kOwner) && l.placed == (kind == PlannerKind::kStatic);
}

// Offsets (in bytes) of the regions of one rank's symmetric buffer. Every rank's buffer has the same
// layout, so a peer's region is peer_base + offset. Regions are 256-byte aligned.
struct SymmetricLayout {
    static constexpr int64_t kAlignBytes = 256;
    int64_t barrier_offset;     // uint64_t[kMaxRanks]: barrier epoch written by each peer (see transport/barrier)
    int64_t status_offset;      // int32_t[4]: device status word (first bad expert id etc.)
    int64_t tpe_all_offset;     // int32_t[R][E]: all-gathered token counts, row s written by rank s
    int64_t recv_x_offset;      // bf16[NvS][H]: rows pushed by sources (primary rows of each (source, token))
    int64_t recv_w_offset;      // float[NvS]: routing weight of every entry row
    int64_t row_head_offset;    // int32_t[NvS]: staging of the plan's per-row chain heads, written by sources
    int64_t row_next_offset;    // int32_t[NvS]: staging of the plan's per-row chain links, written by sources
    int64_t partial_offset;     // bf16[NvS][H]: combine partial sums, pulled by sources
    int64_t recv_marks_offset;  // uint8_t[NvS]: 0 where this rank's recv_x row is known zero (dispatch's fan-out)
    int64_t total_bytes;

    FLATEP_HD static int64_t align_up(int64_t x) { return round_up<int64_t>(x, kAlignBytes); }
};

// Typed view of the region at `offset` (one of SymmetricLayout's *_offset) of a symmetric buffer mapped at `base`
// (this rank's, or a peer's: peers[p]). Every backend reaches a region through this one accessor.
template <class T, class Byte>
FLATEP_HD T* region_at(Byte* base, int64_t offset) {
    return reinterpret_cast<T*>(base + offset);
}

FLATEP_HD SymmetricLayout make_symmetric_layout(const Layout& l) {
    SymmetricLayout s{};
    int64_t at = 0;
    s.barrier_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(kMaxRanks) * 8);
    s.status_offset = at;
    at = SymmetricLayout::align_up(at + 16);
    s.tpe_all_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(l.num_ranks) * l.num_experts * 4);
    s.recv_x_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows) * l.row_bytes());
    s.recv_w_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows) * 4);
    s.row_head_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows) * 4);
    s.row_next_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows) * 4);
    s.partial_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows) * l.row_bytes());
    s.recv_marks_offset = at;
    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows));
    s.total_bytes = at;
    return s;
}

}  // namespace flatep
