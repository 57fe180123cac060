// libFuzzer target: the host planner on arbitrary count matrices and configs.
//
// Input bytes decode to (mode, R, epn, S, K, align, capacity factor, and with mode bit 5 the serving layout's B)
// inside the validated ranges (R <= 16, E <= 128, S <= 256, mostly <= 48) and a count matrix tpe[R][E]:
//   raw mode:    every count is an arbitrary int32 (mostly invalid): planner::validate_counts must agree with an
//                independent oracle, and planner::plan_counts must reject exactly the matrices it rejects, with its
//                message;
//   shaped mode: each row distributes its total (S*K, or any value up to it: partial batches) over the experts by
//                cubed byte weights (so a few hot experts dominate), optionally one popularity shared by all rows.
// Every valid matrix is planned by the greedy and balanced planners and, on their own layouts (capacity R*S*K), by the
// owner planner and by the static planner with a placement decoded from the rest of the input (an invalid one must be
// refused with check_placement's message); check_plan (design §4 constraints 1-4, groups, slots, stats; the owner's
// and the static planner's rules) must return "" and a second run must give the same plan (determinism).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "fuzz_input.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "planner/static_placement.hpp"

namespace planner = flatep::planner;

namespace {

using flatep::fuzz::ByteReader;

constexpr int kAligns[16] = {1, 1, 2, 4, 8, 16, 32, 64, 128, 128, 3, 5, 7, 100, 256, 4096};

// Independent oracle of planner::validate_counts: non-negative counts, row sums <= S*K.
bool counts_valid(const flatep::Layout& l, const std::vector<int32_t>& tpe) {
    for (int s = 0; s < l.num_ranks; ++s) {
        int64_t sum = 0;
        for (int e = 0; e < l.num_experts; ++e) {
            const int32_t v = tpe[size_t(s) * l.num_experts + e];
            if (v < 0) return false;
            sum += v;
        }
        if (sum > int64_t(l.num_tokens) * l.topk) return false;
    }
    return true;
}

// Distributes `total` entries over E experts in proportion to `weights` (largest part first for the remainder).
void distribute(int64_t total, const std::vector<uint64_t>& weights, int fallback, int32_t* row) {
    const int E = int(weights.size());
    uint64_t sum = 0;
    for (uint64_t w : weights) sum += w;
    if (sum == 0) {
        row[fallback] = int32_t(total);
        return;
    }
    int64_t used = 0;
    for (int e = 0; e < E; ++e) {
        row[e] = int32_t(int64_t((unsigned __int128)total * weights[e] / sum));
        used += row[e];
    }
    for (int e = 0; used < total; e = (e + 1) % E) {
        if (weights[e] > 0) ++row[e], ++used;
    }
}

void compare_plans(const flatep::Layout& l, const flatep::PlanView& a, const flatep::PlanView& b, const char* name) {
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    FUZZ_ASSERT(std::equal(a.alloc, a.alloc + re, b.alloc), "%s: alloc differs between two runs", name);
    FUZZ_ASSERT(std::equal(a.group_row, a.group_row + re, b.group_row), "%s: group_row differs between two runs", name);
    FUZZ_ASSERT(std::equal(a.slot_expert, a.slot_expert + int64_t(l.num_ranks) * l.experts_per_rank, b.slot_expert),
                "%s: slot_expert differs between two runs", name);
    FUZZ_ASSERT(std::equal(a.cu_seqlens, a.cu_seqlens + int64_t(l.num_ranks) * l.num_groups(), b.cu_seqlens),
                "%s: cu_seqlens differs between two runs", name);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    ByteReader in(data, size);
    const uint8_t mode = in.u8();
    flatep::Config c;
    c.num_ranks = 1 + in.u8() % 16;
    const int epn = 1 + in.u8() % (128 / c.num_ranks);
    c.num_experts = c.num_ranks * epn;
    // Mostly small S (check_plan re-derives every entry's row: cost ~ R*R*S*K); mode bit 4 allows up to 256.
    c.num_tokens = 1 + int(in.u16() % ((mode & 16) ? 256 : 48));
    c.topk = 1 + in.u8() % std::min(32, c.num_experts);
    c.hidden = 8;
    c.align = kAligns[in.u8() % 16];
    // Keep the receive buffer (NvS ~ C + 2*epn*(align-1) rows, allocated per plan) small enough for fast runs.
    while (c.align > 1 && 2 * epn * c.align > (1 << 14)) c.align /= 2;
    const uint8_t f = in.u8();
    c.capacity_factor = f < 128 ? 1.0 : (f == 128 ? 1.0000001 : 1.0 + double(f - 128) / 127.0 * 3.0);
    // Mode bit 5: the serving layout (B = num_slots < epn slots a rank; B = epn is the training layout).
    flatep::ViewShape view;
    if ((mode & 32) != 0) view.num_slots = in.u8() % (epn + 1);
    try {
        c.validate();
    } catch (const flatep::Error& e) {
        FUZZ_ASSERT(false, "the decoder made an invalid config %s: %s", c.to_string().c_str(), e.what());
    }
    const flatep::Layout l = flatep::make_layout(c, flatep::PlannerKind::kBalanced, view);
    const int R = l.num_ranks, E = l.num_experts;
    const int64_t sk = int64_t(l.num_tokens) * l.topk;
    std::vector<int32_t> tpe(size_t(R) * E, 0);

    if ((mode & 3) == 0) {
        // Raw counts: near-valid values most of the time, arbitrary int32 otherwise.
        for (int32_t& v : tpe) {
            const uint8_t kind = in.u8();
            v = kind < 200 ? int32_t(in.u8()) : (kind < 250 ? int32_t(in.u16()) - 256 : in.i32());
        }
        const bool valid = counts_valid(l, tpe);
        const std::string message = planner::validate_counts(l, tpe.data());
        FUZZ_ASSERT(valid == message.empty(), "planner::validate_counts says '%s' but the oracle says %s",
                    message.c_str(), valid ? "valid" : "invalid");
        if (!valid) {
            planner::HostPlan plan(l);
            std::copy(tpe.begin(), tpe.end(), plan.view.tpe_all);
            try {
                planner::plan_counts(l, flatep::PlannerKind::kBalanced, plan.view);
                FUZZ_ASSERT(false, "planner::plan_counts accepted invalid counts (%s)", message.c_str());
            } catch (const flatep::Error& e) {
                FUZZ_ASSERT(e.category() == flatep::ErrorCategory::kInvalidArgument && e.message() == message,
                            "planner::plan_counts threw '%s', expected '%s'", e.what(), message.c_str());
            }
            return 0;
        }
    } else {
        const bool shared_popularity = (mode & 4) != 0;
        const bool partial = (mode & 8) != 0;
        std::vector<uint64_t> weights(static_cast<size_t>(E));
        auto draw_weights = [&] {
            for (uint64_t& w : weights) {
                const uint64_t b = in.u8();
                w = b * b * b;
            }
        };
        draw_weights();
        for (int s = 0; s < R; ++s) {
            if (s > 0 && !shared_popularity) draw_weights();
            const int64_t total = partial ? int64_t(in.u32() % uint32_t(sk + 1)) : sk;
            distribute(total, weights, in.u8() % E, tpe.data() + size_t(s) * E);
        }
        const std::string message = planner::validate_counts(l, tpe.data());
        FUZZ_ASSERT(message.empty(), "shaped counts were rejected: %s", message.c_str());
    }

    for (const flatep::PlannerKind kind : {flatep::PlannerKind::kGreedy, flatep::PlannerKind::kBalanced}) {
        const char* name = flatep::planner_name(kind);
        planner::HostPlan first(l), second(l);
        std::copy(tpe.begin(), tpe.end(), first.view.tpe_all);
        std::copy(tpe.begin(), tpe.end(), second.view.tpe_all);
        try {
            planner::plan_counts(l, kind, first.view);
            planner::plan_counts(l, kind, second.view);
        } catch (const flatep::Error& e) {
            FUZZ_ASSERT(false, "%s planner threw on valid counts, %s: %s", name, c.to_string().c_str(), e.what());
        }
        const std::string violation = flatep::planner::check_plan(l, first.view);
        FUZZ_ASSERT(violation.empty(), "%s plan violates design 4 for %s: %s", name, c.to_string().c_str(),
                    violation.c_str());
        compare_plans(l, first.view, second.view, name);
    }
    // The owner planner on its own layout (capacity R*S*K): the same counts, the same checks. A config whose owner
    // capacity does not fit int32 is refused by make_layout, which the decoder's small shapes never reach.
    const flatep::Layout lo = flatep::make_layout(c, flatep::PlannerKind::kOwner, view);
    planner::HostPlan first(lo), second(lo);
    std::copy(tpe.begin(), tpe.end(), first.view.tpe_all);
    std::copy(tpe.begin(), tpe.end(), second.view.tpe_all);
    try {
        planner::plan_counts(lo, flatep::PlannerKind::kOwner, first.view);
        planner::plan_counts(lo, flatep::PlannerKind::kOwner, second.view);
    } catch (const flatep::Error& e) {
        FUZZ_ASSERT(false, "owner planner threw on valid counts, %s: %s", c.to_string().c_str(), e.what());
    }
    const std::string violation = flatep::planner::check_plan(lo, first.view);
    FUZZ_ASSERT(violation.empty(), "owner plan violates its rules for %s: %s", c.to_string().c_str(),
                violation.c_str());
    compare_plans(lo, first.view, second.view, "owner");

    // The static planner on its own layout, with a placement from the rest of the input. Raw (a byte of 1 mod 4):
    // every entry a signed byte (-1 empty; other negatives, ids >= E, own experts and repeats invalid). Otherwise
    // valid by construction: a byte b gives b mod (E + 1) - 1, an own expert or a repeat becomes -1. An invalid one
    // must be refused by make_placement_table with check_placement's message; a valid one planned twice, the same,
    // and check_plan (the split rule written out, the slot table the placement) must accept it.
    const flatep::Layout ls = flatep::make_layout(c, flatep::PlannerKind::kStatic, view);
    std::vector<int32_t> placement(size_t(ls.num_ranks) * ls.num_slots);
    const bool raw = in.u8() % 4 == 1;
    for (int d = 0; d < ls.num_ranks; ++d) {
        for (int j = 0; j < ls.num_slots; ++j) {
            const uint8_t b = in.u8();
            int32_t e = raw ? int32_t(int8_t(b)) : int32_t(b % (E + 1)) - 1;
            const auto row = placement.begin() + int64_t(d) * ls.num_slots;
            if (!raw && e >= 0 && (ls.home_rank(e) == d || std::find(row, row + j, e) != row + j)) e = -1;
            placement[size_t(d) * ls.num_slots + j] = e;
        }
    }
    const std::string bad = planner::check_placement(ls, placement);
    std::vector<int32_t> table;
    try {
        table = planner::make_placement_table(ls, placement);
        FUZZ_ASSERT(bad.empty(), "make_placement_table took a placement check_placement refuses: %s", bad.c_str());
    } catch (const flatep::Error& e) {
        FUZZ_ASSERT(!bad.empty() && e.message() == bad,
                    "make_placement_table refused with '%s', check_placement "
                    "said '%s'",
                    e.message().c_str(), bad.c_str());
        return 0;
    }
    planner::HostPlan one(ls), two(ls);
    std::copy(tpe.begin(), tpe.end(), one.view.tpe_all);
    std::copy(tpe.begin(), tpe.end(), two.view.tpe_all);
    try {
        planner::plan_counts(ls, flatep::PlannerKind::kStatic, one.view, table.data());
        planner::plan_counts(ls, flatep::PlannerKind::kStatic, two.view, table.data());
    } catch (const flatep::Error& e) {
        FUZZ_ASSERT(false, "static planner threw on valid counts, %s: %s", c.to_string().c_str(), e.what());
    }
    const std::string broken = flatep::planner::check_plan(ls, one.view, placement.data());
    FUZZ_ASSERT(broken.empty(), "static plan violates its rules for %s: %s", c.to_string().c_str(), broken.c_str());
    compare_plans(ls, one.view, two.view, "static");
    return 0;
}
