#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>

#include "common/check.hpp"
#include "flatep/config.hpp"
#include "layout/layout.hpp"

namespace flatep {

namespace {
constexpr int kMaxAlign = 4096;
constexpr double kMaxCapacityFactor = 4.0;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// The owner and the static planner size the receive buffer for the worst case: every entry of the step on one rank.
bool worst_case(PlannerKind planner) { return planner == PlannerKind::kOwner || planner == PlannerKind::kStatic; }

int64_t capacity_of(const Config& c, PlannerKind planner) {
    const int64_t sk = int64_t(c.num_tokens) * c.topk;
    if (worst_case(planner)) return int64_t(c.num_ranks) * sk;  // every source's entries to one rank
    if (c.capacity_factor == 1.0) return sk;
    return int64_t(std::ceil(c.capacity_factor * double(sk)));
}

// Non-empty groups a rank may hold: epn own and (replicas, constraint 3) epn remote; the owner planner only its own;
// the static planner its own and its B slots (num_slots; -1 = epn).
int64_t recv_rows_of(const Config& c, int64_t capacity, PlannerKind planner, int num_slots = -1) {
    const int64_t epn = c.num_experts / c.num_ranks;
    const int64_t groups = planner == PlannerKind::kOwner    ? epn
                           : planner == PlannerKind::kStatic ? epn + (num_slots < 0 ? epn : num_slots)
                                                             : 2 * epn;
    return round_up<int64_t>(capacity + groups * (c.align - 1), c.align);
}

// B and Q of a view shape that is valid for `epn` experts per rank.
int slots_of(const ViewShape& v, int epn) { return v.num_slots < 0 ? epn : v.num_slots; }
int stride_of(const ViewShape& v, int epn) { return v.view_stride == 0 ? epn : v.view_stride; }

// The view shape against a valid config: B (check_num_slots), Q, and the groups' int32 indexing.
void check_view(const Config& c, const ViewShape& v) {
    const int epn = c.num_experts / c.num_ranks;
    check_num_slots("", v.num_slots, epn);
    FLATEP_CHECK(v.view_stride == 0 || (v.view_stride >= epn && v.view_stride <= kMaxViewStride),
                 "view_stride (Q) must be 0 (= epn) or in [epn=", epn, ", ", kMaxViewStride, "], got ", v.view_stride);
    // The serving groups: R*Q + B view rows, cu_seqlens [R][R*Q + B] indexed in int32.
    const int64_t view_rows = int64_t(c.num_ranks) * stride_of(v, epn) + slots_of(v, epn);
    FLATEP_CHECK(view_rows * c.num_ranks <= kInt32Max,
                 "view_stride (Q) too large: cu_seqlens' R*(R*Q + B) = ", c.num_ranks, "*", view_rows,
                 " must fit int32 (Q=", stride_of(v, epn), ")");
}
}  // namespace

void check_num_slots(const char* who, int num_slots, int experts_per_rank) {
    FLATEP_CHECK(num_slots == -1 || (num_slots >= 0 && num_slots <= experts_per_rank), who,
                 "num_slots (B) must be -1 (= epn) or in [0, epn=", experts_per_rank, "], got ", num_slots);
}

void check_planner_kind(PlannerKind kind, const char* op) {
    FLATEP_CHECK(kind == PlannerKind::kGreedy || kind == PlannerKind::kBalanced || kind == PlannerKind::kOwner ||
                     kind == PlannerKind::kStatic,
                 op, "planner kind must be greedy (0), balanced (1), owner (2) or static (3), got ", int(kind));
}

void Config::validate(PlannerKind planner) const {
    FLATEP_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks (R) must be in [1, ", kMaxRanks, "], got ",
                 num_ranks);
    FLATEP_CHECK(rank >= 0 && rank < num_ranks, "rank must be in [0, num_ranks=", num_ranks, "), got ", rank);
    FLATEP_CHECK(num_experts >= 1, "num_experts (E) must be positive, got ", num_experts);
    FLATEP_CHECK(num_experts % num_ranks == 0, "num_experts (E) must be a multiple of num_ranks (R): E=", num_experts,
                 " R=", num_ranks);
    // Plans index [d*E + e] and [d*2*epn + g] in int32, and the planner's workspace holds two R*E arrays.
    FLATEP_CHECK(int64_t(num_ranks) * num_experts * 2 <= kInt32Max,
                 "num_experts (E) too large: 2*R*E must fit int32, got 2*", num_ranks, "*", num_experts);
    check_planner_kind(planner);
    FLATEP_CHECK(num_tokens >= 1, "num_tokens (S) must be positive, got ", num_tokens);
    FLATEP_CHECK(topk >= 1 && topk <= kMaxTopk, "topk (K) must be in [1, ", kMaxTopk, "], got ", topk);
    FLATEP_CHECK(topk <= num_experts, "topk (K) must not exceed num_experts (E): K=", topk, " E=", num_experts);
    FLATEP_CHECK(hidden >= 8 && hidden % 8 == 0,
                 "hidden (H) must be a positive multiple of 8 (16-byte bf16 rows), got ", hidden);
    FLATEP_CHECK(align >= 1 && align <= kMaxAlign, "align must be in [1, ", kMaxAlign, "], got ", align);
    FLATEP_CHECK(std::isfinite(capacity_factor) && capacity_factor >= 1.0 && capacity_factor <= kMaxCapacityFactor,
                 "capacity_factor must be in [1, ", kMaxCapacityFactor, "], got ", capacity_factor);
    const int64_t sk = int64_t(num_tokens) * topk;
    FLATEP_CHECK(sk <= kInt32Max, "num_tokens*topk (S*K) must fit int32, got ", sk);
    const int64_t capacity = capacity_of(*this, planner);
    // The owner planner is for decode; a static placement serves any step, but sized for the worst case.
    const char* worst = planner == PlannerKind::kOwner ? "owner" : "static";
    const char* why =
        planner == PlannerKind::kOwner ? "it is meant for decode-sized S" : "the worst case of any placement";
    if (worst_case(planner)) {
        FLATEP_CHECK(capacity <= kInt32Max, worst, " planner: its receive capacity R*S*K = ", num_ranks, "*",
                     num_tokens, "*", topk, " = ", capacity, " rows must fit int32 (", why, ")");
    }
    FLATEP_CHECK(capacity <= kInt32Max, "capacity C = ceil(capacity_factor*S*K) must fit int32, got ", capacity);
    const int64_t nvs = recv_rows_of(*this, capacity, planner);  // static: with B = epn, the largest any view has
    if (worst_case(planner)) {
        FLATEP_CHECK(nvs * num_ranks <= kInt32Max, worst, " planner: receive rows NvS = ", nvs,
                     " (capacity R*S*K = ", capacity, ") times R = ", num_ranks, " must fit int32 (", why, ")");
    }
    FLATEP_CHECK(nvs * num_ranks <= kInt32Max, "num_ranks * receive rows (R*NvS) must fit int32, got ", nvs, "*",
                 num_ranks);
    FLATEP_CHECK(nvs * int64_t(hidden) <= (int64_t(1) << 40), "receive buffer NvS*H = ", nvs, "*", hidden,
                 " elements is too large");
}

uint64_t Config::hash() const {
    uint64_t h = kFnvOffset;
    h = fnv1a_mix(h, uint64_t(num_ranks));
    h = fnv1a_mix(h, uint64_t(num_experts));
    h = fnv1a_mix(h, uint64_t(num_tokens));
    h = fnv1a_mix(h, uint64_t(topk));
    h = fnv1a_mix(h, uint64_t(hidden));
    h = fnv1a_mix(h, uint64_t(align));
    uint64_t bits = 0;
    static_assert(sizeof(bits) == sizeof(capacity_factor));
    __builtin_memcpy(&bits, &capacity_factor, sizeof(bits));
    h = fnv1a_mix(h, bits);
    return h;
}

std::string Config::mismatch(const Config& o) const {
    std::ostringstream os;
    auto field = [&](const char* name, auto mine, auto theirs) {
        if (os.tellp() == 0 && mine != theirs) os << detail::concat(name, ": ", mine, " vs ", theirs);  // exact doubles
    };
    field("num_ranks", num_ranks, o.num_ranks);
    field("num_experts", num_experts, o.num_experts);
    field("num_tokens", num_tokens, o.num_tokens);
    field("topk", topk, o.topk);
    field("hidden", hidden, o.hidden);
    field("align", align, o.align);
    field("capacity_factor", capacity_factor, o.capacity_factor);
    return os.str();
}

std::string Config::to_string() const {
    return detail::concat("Config(R=", num_ranks, ", rank=", rank, ", E=", num_experts, ", S=", num_tokens,
                          ", K=", topk, ", H=", hidden, ", align=", align, ", capacity_factor=", capacity_factor, ")");
}

Layout make_layout(const Config& c, PlannerKind planner, const ViewShape& view) {
    c.validate(planner);
    check_view(c, view);
    Layout l{};
    l.num_ranks = c.num_ranks;
    l.num_experts = c.num_experts;
    l.experts_per_rank = c.num_experts / c.num_ranks;
    l.num_tokens = c.num_tokens;
    l.topk = c.topk;
    l.hidden = c.hidden;
    l.align = c.align;
    const int64_t capacity = capacity_of(c, planner);
    l.capacity = int(capacity);
    l.num_recv_rows = int(recv_rows_of(c, capacity, planner, view.num_slots));  // validate checked B = epn's
    l.owner = planner == PlannerKind::kOwner;
    l.placed = planner == PlannerKind::kStatic;
    l.exact = c.capacity_factor == 1.0 && !worst_case(planner);
    l.num_slots = slots_of(view, l.experts_per_rank);
    l.view_stride = stride_of(view, l.experts_per_rank);
    l.serving = l.num_slots < l.experts_per_rank;
    return l;
}

}  // namespace flatep
