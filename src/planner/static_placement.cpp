#include "planner/static_placement.hpp"

#include <algorithm>

#include "common/check.hpp"

namespace flatep::planner {

std::string check_placement(const Layout& l, std::span<const int32_t> placement) {
    const int R = l.num_ranks, B = l.num_slots, E = l.num_experts;
    if (int64_t(placement.size()) != int64_t(R) * B)
        return detail::concat("placement must have R*B = ", R, "*", B, " = ", int64_t(R) * B,
                              " entries ([R][B] expert ids, -1 = empty), got ", placement.size());
    for (int d = 0; d < R; ++d) {
        for (int j = 0; j < B; ++j) {
            const int32_t e = placement[size_t(d) * B + j];
            const std::string at = detail::concat("placement[", d, "][", j, "] = ", e);
            if (e == -1) continue;
            if (e < 0 || e >= E) return at + detail::concat(" is not an expert id in [0, E=", E, ") or -1 (empty)");
            if (l.home_rank(e) == d)
                return at + detail::concat(" is rank ", d, "'s own expert; a slot holds another rank's expert");
            for (int k = 0; k < j; ++k) {
                if (placement[size_t(d) * B + k] == e)
                    return at + detail::concat(" repeats placement[", d, "][", k, "] (an expert at most once a rank)");
            }
        }
    }
    return "";
}

std::vector<int32_t> make_placement_table(const Layout& l, std::span<const int32_t> placement) {
    const std::string bad = check_placement(l, placement);
    FLATEP_CHECK(bad.empty(), bad);
    const int R = l.num_ranks, B = l.num_slots, E = l.num_experts;
    std::vector<int32_t> table(size_t(placement_table_words(l)), -1);
    std::copy(placement.begin(), placement.end(), table.begin());
    int32_t* const copy = table.data() + int64_t(R) * B;
    int32_t* const copies = copy + int64_t(R) * E;
    std::vector<char> held(size_t(R) * E, 0);
    for (int d = 0; d < R; ++d)
        for (int j = 0; j < B; ++j)
            if (placement[size_t(d) * B + j] >= 0) held[size_t(d) * E + placement[size_t(d) * B + j]] = 1;
    for (int e = 0; e < E; ++e) {
        int32_t n = 0;
        for (int d = 0; d < R; ++d)
            if (d == l.home_rank(e) || held[size_t(d) * E + e]) copy[int64_t(d) * E + e] = n++;
        copies[e] = n;
    }
    return table;
}

}  // namespace flatep::planner
