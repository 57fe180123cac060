// libFuzzer target: Config::validate and make_layout on arbitrary fields.
//
// Each field is either near its valid range or an arbitrary int32 (capacity_factor: special values or raw double
// bits, NaN and infinities included). validate() must agree with an independent oracle written with 128-bit
// arithmetic; a rejection is one kInvalidArgument line naming a field; an accepted config builds a Layout whose
// derived sizes match the oracle, whose buffer offsets increase, and whose int32 index products (what the planner,
// plan views and kernels compute in int) fit int32. hash/mismatch/to_string never misbehave.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "fuzz_input.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace {

using flatep::fuzz::ByteReader;
using i128 = __int128;
constexpr i128 kInt32Max = std::numeric_limits<int32_t>::max();

int field(ByteReader& in, int near_lo, int near_hi) {
    const uint8_t kind = in.u8();
    if (kind < 160) return in.range(near_lo, near_hi);
    if (kind < 200) return int(1u << (in.u8() % 31)) - (kind & 1);  // powers of two and one below
    return in.i32();
}

double factor(ByteReader& in) {
    static const double kSpecial[] = {1.0,
                                      1.0,
                                      1.25,
                                      4.0,
                                      4.000000001,
                                      0.999999999,
                                      0.0,
                                      -1.0,
                                      std::numeric_limits<double>::quiet_NaN(),
                                      std::numeric_limits<double>::infinity(),
                                      -std::numeric_limits<double>::infinity(),
                                      1e300,
                                      1.0 + 1e-15,
                                      2.5,
                                      3.999,
                                      1e-300};
    const uint8_t kind = in.u8();
    if (kind < 128) return kSpecial[kind % 16];
    if (kind < 220) return 1.0 + double(in.u32()) / 4294967295.0 * 3.5;
    return in.f64();
}

struct Oracle {
    bool valid = false;
    i128 capacity = 0, nvs = 0;
};

Oracle oracle(const flatep::Config& c) {
    Oracle o;
    if (c.num_ranks < 1 || c.num_ranks > flatep::kMaxRanks) return o;
    if (c.rank < 0 || c.rank >= c.num_ranks) return o;
    if (c.num_experts < 1 || c.num_experts % c.num_ranks != 0) return o;
    if (2 * i128(c.num_ranks) * c.num_experts > kInt32Max) return o;  // plan indices [d*E + e], two R*E arrays
    if (c.num_tokens < 1) return o;
    if (c.topk < 1 || c.topk > flatep::kMaxTopk || c.topk > c.num_experts) return o;
    if (c.hidden < 8 || c.hidden % 8 != 0) return o;
    if (c.align < 1 || c.align > 4096) return o;
    if (!(c.capacity_factor >= 1.0 && c.capacity_factor <= 4.0)) return o;  // false for NaN
    const i128 sk = i128(c.num_tokens) * c.topk;
    if (sk > kInt32Max) return o;
    o.capacity = c.capacity_factor == 1.0 ? sk : i128(std::ceil(c.capacity_factor * double(sk)));
    if (o.capacity > kInt32Max) return o;
    const i128 epn = c.num_experts / c.num_ranks;
    const i128 raw = o.capacity + 2 * epn * (c.align - 1);
    o.nvs = (raw + c.align - 1) / c.align * c.align;
    if (o.nvs * c.num_ranks > kInt32Max) return o;
    if (o.nvs * c.hidden > (i128(1) << 40)) return o;
    o.valid = true;
    return o;
}

const char* const kFieldNames[] = {
    "num_ranks",     "rank",  "num_experts",     "num_tokens", "topk",
    "hidden",        "align", "capacity_factor", "capacity",   "num_ranks * receive rows",
    "receive buffer"};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    ByteReader in(data, size);
    flatep::Config c;
    c.num_ranks = field(in, -1, 66);
    c.rank = field(in, -1, 66);
    c.num_experts = field(in, -1, 1 << 12);
    c.num_tokens = field(in, -1, 1 << 16);
    c.topk = field(in, -1, 34);
    c.hidden = field(in, -1, 1 << 15);
    c.align = field(in, -1, 4100);
    c.capacity_factor = factor(in);

    const Oracle want = oracle(c);
    const std::string text = c.to_string();
    FUZZ_ASSERT(!text.empty(), "empty to_string");
    (void)c.hash();

    bool valid = true;
    try {
        c.validate();
    } catch (const flatep::Error& e) {
        valid = false;
        FUZZ_ASSERT(e.category() == flatep::ErrorCategory::kInvalidArgument, "category %s: %s",
                    flatep::category_name(e.category()), e.what());
        FUZZ_ASSERT(!e.message().empty() && e.message().find('\n') == std::string::npos, "not one line: %s", e.what());
        bool named = false;
        for (const char* name : kFieldNames) named = named || e.message().find(name) != std::string::npos;
        FUZZ_ASSERT(named, "the message names no field: %s", e.what());
    }
    FUZZ_ASSERT(valid == want.valid, "validate() %s %s, the oracle says %s", valid ? "accepts" : "rejects",
                text.c_str(), want.valid ? "valid" : "invalid");
    if (!valid) return 0;
    // Only validated configs reach the cross-rank comparison (Buffer validates first; a NaN capacity_factor, which
    // would mismatch itself, never gets there).
    FUZZ_ASSERT(c.mismatch(c).empty(), "a config mismatches itself: %s", c.mismatch(c).c_str());
    flatep::Config other = c;
    other.rank = c.rank == 0 ? 1 : 0;
    FUZZ_ASSERT(other.hash() == c.hash() && other.mismatch(c).empty(), "rank changes the hash or the mismatch");

    const flatep::Layout l = flatep::make_layout(c);
    FUZZ_ASSERT(l.capacity == want.capacity && l.num_recv_rows == want.nvs, "layout C=%d NvS=%d for %s", l.capacity,
                l.num_recv_rows, text.c_str());
    FUZZ_ASSERT(l.exact == (c.capacity_factor == 1.0), "exact flag");
    FUZZ_ASSERT(l.capacity >= l.num_entries() && l.num_recv_rows >= l.capacity, "C < S*K or NvS < C for %s",
                text.c_str());
    // The index products the code computes in int (plan.hpp's [d*E + e], [d*2*epn + g], entry t*K + k, rows of all
    // ranks) must fit int32 for every validated config.
    const i128 R = l.num_ranks, E = l.num_experts;
    // Found by this target and fixed (validate() bounds 2*R*E); FLATEP_FUZZ_IGNORE=r_times_e would skip it.
    if (flatep::fuzz::ignored("r_times_e") && (R * E > kInt32Max || R * l.num_groups() > kInt32Max)) return 0;
    FUZZ_ASSERT(R * E <= kInt32Max, "R*E = %lld overflows int32 (tpe_all/alloc index d*E+e) for %s", (long long)(R * E),
                text.c_str());
    FUZZ_ASSERT(R * l.num_groups() <= kInt32Max, "R*2*epn overflows int32 for %s", text.c_str());
    FUZZ_ASSERT(i128(l.num_tokens) * l.topk <= kInt32Max, "S*K overflows int32 for %s", text.c_str());
    FUZZ_ASSERT(R * l.num_recv_rows <= kInt32Max, "R*NvS overflows int32 for %s", text.c_str());

    const flatep::SymmetricLayout s = flatep::make_symmetric_layout(l);
    FUZZ_ASSERT(0 <= s.barrier_offset && s.barrier_offset < s.status_offset && s.status_offset < s.tpe_all_offset &&
                    s.tpe_all_offset < s.recv_x_offset && s.recv_x_offset < s.recv_w_offset &&
                    s.recv_w_offset < s.row_head_offset && s.row_head_offset < s.row_next_offset &&
                    s.row_next_offset < s.partial_offset && s.partial_offset < s.total_bytes,
                "symmetric layout offsets do not increase for %s", text.c_str());
    FUZZ_ASSERT(s.recv_x_offset - s.tpe_all_offset >= R * E * 4 &&
                    s.total_bytes - s.partial_offset >= i128(l.num_recv_rows) * l.row_bytes(),
                "a symmetric region is too small for %s", text.c_str());
    const flatep::PlanSizes p = flatep::make_plan_sizes(l);
    FUZZ_ASSERT(p.total_words > 0 && p.header + flatep::kPlanHeaderWords <= p.total_words, "plan sizes for %s",
                text.c_str());
    return 0;
}
