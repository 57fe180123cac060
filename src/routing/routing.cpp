#include "routing/routing.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "common/check.hpp"

namespace flatep::routing {

namespace {
constexpr uint64_t kPopularityStream = 0x706f70756c617269ull;  // "populari"
constexpr uint64_t kTokenStream = 0x746f6b656e737472ull;       // "tokenstr"
constexpr double kTwoPi = 6.283185307179586476925286766559;
}  // namespace

uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

double uniform(uint64_t stream, uint64_t index) {
    const uint64_t bits = mix64(mix64(stream) ^ index);
    // 53 random bits, offset by half a step so the result is never 0 or 1.
    return (double(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

uint16_t finite_bf16(uint64_t seed, uint64_t index) {
    const uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ull + index);
    return uint16_t(((r & 1) << 15) | ((110 + (r >> 1) % 23) << 7) | ((r >> 8) & 0x7f));  // exponents 2^-17 .. 2^5
}

float data_float(uint64_t seed, uint64_t index, float lo, float hi) {
    const uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ull + index);
    return lo + (hi - lo) * float(double(r >> 11) / double(uint64_t(1) << 53));
}

double normal(uint64_t stream, uint64_t index) {
    const double u1 = uniform(stream, 2 * index);
    const double u2 = uniform(stream, 2 * index + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

std::vector<double> popularity(int num_experts, double sigma, uint64_t seed) {
    FLATEP_CHECK(num_experts >= 1, "num_experts must be positive, got ", num_experts);
    FLATEP_CHECK(std::isfinite(sigma) && sigma >= 0, "sigma must be finite and >= 0, got ", sigma);
    std::vector<double> pop(num_experts);
    const uint64_t stream = mix64(seed ^ kPopularityStream);
    for (int e = 0; e < num_experts; ++e) pop[e] = std::exp(sigma * normal(stream, uint64_t(e)));
    return pop;
}

void sample_topk(const std::vector<double>& popularity, int num_tokens, int topk, uint64_t seed, int rank,
                 int32_t* topk_idx) {
    const int num_experts = int(popularity.size());
    FLATEP_CHECK(topk >= 1 && topk <= num_experts, "topk must be in [1, num_experts=", num_experts, "], got ", topk);
    FLATEP_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
    // Exponential race, equivalent to Gumbel top-k: with X_e = -log(u_e) ~ Exp(1), the K smallest X_e / p_e are K
    // draws without replacement with probability proportional to p (one log per draw instead of two).
    std::vector<double> inv_pop(num_experts);
    for (int e = 0; e < num_experts; ++e) inv_pop[e] = 1.0 / popularity[e];
    const uint64_t stream = mix64(mix64(seed ^ kTokenStream) + uint64_t(rank));
    std::vector<std::pair<double, int>> keys(num_experts);
    const auto before = [](const std::pair<double, int>& a, const std::pair<double, int>& b) {
        return a.first != b.first ? a.first < b.first : a.second < b.second;  // ties broken by expert id
    };
    for (int t = 0; t < num_tokens; ++t) {
        for (int e = 0; e < num_experts; ++e) {
            const double u = uniform(stream, uint64_t(t) * uint64_t(num_experts) + uint64_t(e));
            keys[e] = {-std::log(u) * inv_pop[e], e};
        }
        std::nth_element(keys.begin(), keys.begin() + (topk - 1), keys.end(), before);
        std::sort(keys.begin(), keys.begin() + topk, before);
        for (int k = 0; k < topk; ++k) topk_idx[int64_t(t) * topk + k] = keys[k].second;
    }
}

std::vector<int32_t> histogram(const int32_t* topk_idx, int64_t num_entries, int num_experts) {
    std::vector<int32_t> tpe(num_experts, 0);
    for (int64_t i = 0; i < num_entries; ++i) {
        const int32_t e = topk_idx[i];
        if (e >= 0 && e < num_experts) ++tpe[e];
    }
    return tpe;
}

std::vector<int32_t> generate_counts(int num_ranks, int num_experts, int num_tokens, int topk, double sigma,
                                     uint64_t seed) {
    const std::vector<double> pop = popularity(num_experts, sigma, seed);
    std::vector<int32_t> tpe_all(int64_t(num_ranks) * num_experts, 0);
    std::vector<int32_t> idx(int64_t(num_tokens) * topk);
    for (int r = 0; r < num_ranks; ++r) {
        sample_topk(pop, num_tokens, topk, seed, r, idx.data());
        const std::vector<int32_t> tpe = histogram(idx.data(), int64_t(idx.size()), num_experts);
        std::copy(tpe.begin(), tpe.end(), tpe_all.begin() + int64_t(r) * num_experts);
    }
    return tpe_all;
}

double maxvio(const int32_t* tpe_all, int num_ranks, int num_experts) {
    int64_t total = 0;
    int64_t peak = 0;
    for (int e = 0; e < num_experts; ++e) {
        int64_t t = 0;
        for (int r = 0; r < num_ranks; ++r) t += tpe_all[int64_t(r) * num_experts + e];
        total += t;
        peak = std::max(peak, t);
    }
    if (total == 0) return 0.0;
    return double(peak) * double(num_experts) / double(total) - 1.0;
}

double sigma_for_maxvio(double target, int num_ranks, int num_experts, int num_tokens, int topk, uint64_t seed) {
    FLATEP_CHECK(std::isfinite(target), "target maxvio must be finite, got ", target);
    if (target <= 0) return 0.0;
    const double ceiling = double(num_experts) / double(topk) - 1.0;  // every token hits the same K experts
    FLATEP_CHECK(target < ceiling, "target maxvio ", target, " is unreachable: with E=", num_experts, " and K=", topk,
                 " the largest possible maxvio is ", ceiling);
    auto realised = [&](double sigma) {
        const std::vector<int32_t> c = generate_counts(num_ranks, num_experts, num_tokens, topk, sigma, seed);
        return maxvio(c.data(), num_ranks, num_experts);
    };
    double lo = 0.0, hi = 1.0;
    while (realised(hi) < target && hi < 64.0) hi *= 2.0;
    double best = hi, best_err = std::abs(realised(hi) - target);
    for (int it = 0; it < 30; ++it) {
        const double mid = 0.5 * (lo + hi);
        const double v = realised(mid);
        if (std::abs(v - target) < best_err) best = mid, best_err = std::abs(v - target);
        if (v < target)
            lo = mid;
        else
            hi = mid;
        if (best_err <= 5e-3 * std::max(1.0, target)) break;
    }
    return best;
}

std::vector<int32_t> spread_counts(int num_ranks, int num_experts, int num_tokens, int topk, double sigma,
                                   uint64_t seed) {
    const int R = num_ranks, E = num_experts, S = num_tokens, K = topk;
    const std::vector<double> pop = popularity(E, sigma, seed);
    std::vector<int32_t> tpe(size_t(R) * E, 0);
    for (int r = 0; r < R; ++r) {
        std::vector<double> w(static_cast<size_t>(E));
        const uint64_t stream = mix64(seed * 131 + uint64_t(r));
        for (int e = 0; e < E; ++e) w[size_t(e)] = pop[size_t(e)] * std::exp(0.3 * normal(stream, uint64_t(e)));
        int32_t* row = tpe.data() + size_t(r) * E;
        int64_t left = int64_t(S) * K;
        while (left > 0) {
            double open = 0;
            for (int e = 0; e < E; ++e) open += row[e] < S ? w[size_t(e)] : 0.0;
            int64_t added = 0;
            for (int e = 0; e < E && open > 0; ++e) {
                if (row[e] >= S) continue;
                const int64_t share = std::min<int64_t>(int64_t(double(left) * w[size_t(e)] / open), S - row[e]);
                row[e] += int32_t(share);
                added += share;
            }
            for (int e = 0; e < E && added == 0 && left > 0; ++e) {  // rounding left a remainder: one each
                if (row[e] < S) ++row[e], --left;
            }
            left -= added;
        }
    }
    return tpe;
}

}  // namespace flatep::routing
