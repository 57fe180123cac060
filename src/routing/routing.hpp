// Routing generator (design §9), shared by tests, benchmarks, the demo and (through the binding) Python.
// Expert popularity is exp(N(0, sigma)) drawn from a seed shared by all ranks; each rank draws, with its own
// stream, K distinct experts per token with probability proportional to popularity (Gumbel top-k, i.e.
// sampling without replacement). The random streams are our own counter-based generator (splitmix64), so the
// same seed gives the same routing on every platform and in every language binding.
#pragma once

#include <cstdint>
#include <vector>

namespace flatep::routing {

// splitmix64 of a counter: the one primitive every draw is built on.
uint64_t mix64(uint64_t x);
// Uniform double in (0, 1) from the `index`-th draw of stream `stream`.
double uniform(uint64_t stream, uint64_t index);
// Standard normal (Box-Muller on two uniforms) from the `index`-th pair of stream `stream`.
double normal(uint64_t stream, uint64_t index);

// Data of tests and benchmarks, value `index` of stream `seed`: the bits of a finite bf16 of either sign with a
// magnitude in [2^-17, 2^6) (no NaN or Inf: their payloads differ between CPU and GPU adds), and a float in [lo, hi).
uint16_t finite_bf16(uint64_t seed, uint64_t index);
float data_float(uint64_t seed, uint64_t index, float lo, float hi);

// Popularity of each expert: exp(sigma * z_e), z_e standard normal from `seed`. sigma = 0 gives all ones.
std::vector<double> popularity(int num_experts, double sigma, uint64_t seed);

// Fills topk_idx[num_tokens][topk] (int32) for `rank`: per token, K distinct experts drawn without replacement with
// probability proportional to `popularity` (Gumbel top-k as an exponential race), most likely first.
void sample_topk(const std::vector<double>& popularity, int num_tokens, int topk, uint64_t seed, int rank,
                 int32_t* topk_idx);

// Histogram of expert ids: tpe[e] = number of entries equal to e; ids outside [0, E) are ignored.
std::vector<int32_t> histogram(const int32_t* topk_idx, int64_t num_entries, int num_experts);

// Counts tpe_all[R][E] of the routing that sample_topk gives every rank (what plan() all-gathers).
std::vector<int32_t> generate_counts(int num_ranks, int num_experts, int num_tokens, int topk, double sigma,
                                     uint64_t seed);

// Count matrices tpe_all[R][E] of large shapes (MoonEP's sweep: R up to 64, E=896, S=8192) in microseconds instead
// of generate_counts' seconds, without sampling tokens: each rank's S*K entries spread over the experts in proportion
// to popularity(E, sigma, seed) (jittered per rank), at most S per expert (K distinct experts per token: a valid
// matrix). Not generate_counts' routing: its maxvio for a sigma differs.
std::vector<int32_t> spread_counts(int num_ranks, int num_experts, int num_tokens, int topk, double sigma,
                                   uint64_t seed);

// Realised global imbalance max_e(T_e / mean_e T_e) - 1 of counts tpe_all[R][E] (T_e summed over ranks).
double maxvio(const int32_t* tpe_all, int num_ranks, int num_experts);

// sigma whose realised maxvio (generate_counts with this seed) is closest to `target`, by bisection.
// target <= 0 returns 0 (uniform popularity).
double sigma_for_maxvio(double target, int num_ranks, int num_experts, int num_tokens, int topk, uint64_t seed);

}  // namespace flatep::routing
