// Routings of the benchmark sweeps at MoonEP's shapes (E=896, R up to 64) in host time a device run can afford:
// the count matrices drawn with the ranks spread over threads (bitwise routing::generate_counts), and the sigmas of
// target maxvios found once per (E, S, K, target, seed) and kept in a small CSV file that later runs read.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "flags.hpp"

namespace flatep::bench {

// routing::generate_counts(R, E, S, K, sigma, seed), bitwise, with the ranks drawn on up to `threads` threads
// (0: one per hardware thread).
std::vector<int32_t> generate_counts_parallel(int num_ranks, int num_experts, int num_tokens, int topk, double sigma,
                                              uint64_t seed, int threads = 0);

// The sigma of every case's skew (Skew::sigma_for with bisection_ranks), computed for all missing keys at once on
// parallel threads, cached in memory and, with a path, in a CSV file (read at construction, appended to).
class SigmaTable {
  public:
    explicit SigmaTable(int bisection_ranks, std::string path = "");
    // Computes (in parallel) the sigmas of every (case, seed) not yet known.
    void prepare(const std::vector<Case>& cases, const std::vector<uint64_t>& seeds);
    double sigma(const Case& c, uint64_t seed);  // prepare()'s value, or computed now

  private:
    using Key = std::tuple<int, int, int, int, double, uint64_t>;  // E, S, K, bisection ranks, target, seed
    Key key_of(const Case& c, uint64_t seed) const;
    void store(const Key& k, double sigma);
    int bisection_ranks_;
    std::string path_;
    std::map<Key, double> known_;
};

}  // namespace flatep::bench
