#include "routing_cases.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "internal/api.hpp"

namespace flatep::bench {

namespace {

// Runs fn(i) for i in [0, n) on up to `threads` threads (0: hardware concurrency). An exception of fn (an
// unreachable target maxvio, say) stops the other threads at their next item and is rethrown here, to the caller's
// error handling, instead of ending the process from a worker thread.
template <typename Fn>
void parallel_for(int n, int threads, const Fn& fn) {
    if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
    threads = std::min(threads, n);
    std::atomic<int> next{0};
    std::mutex failed_mutex;
    std::exception_ptr failed;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&] {
            try {
                for (int i = next++; i < n; i = next++) fn(i);
            } catch (...) {
                const std::lock_guard<std::mutex> lock(failed_mutex);
                if (!failed) failed = std::current_exception();
                next = n;
            }
        });
    }
    for (std::thread& t : pool) t.join();
    if (failed) std::rethrow_exception(failed);
}

}  // namespace

std::vector<int32_t> generate_counts_parallel(int num_ranks, int num_experts, int num_tokens, int topk, double sigma,
                                              uint64_t seed, int threads) {
    // generate_counts' steps, one rank per task: the popularity of (sigma, seed), each rank's draw and histogram.
    const std::vector<double> pop = routing::popularity(num_experts, sigma, seed);
    std::vector<int32_t> tpe_all(size_t(num_ranks) * num_experts, 0);
    parallel_for(num_ranks, threads, [&](int r) {
        std::vector<int32_t> idx(size_t(num_tokens) * topk);
        routing::sample_topk(pop, num_tokens, topk, seed, r, idx.data());
        const std::vector<int32_t> tpe = routing::histogram(idx.data(), int64_t(idx.size()), num_experts);
        std::copy(tpe.begin(), tpe.end(), tpe_all.begin() + int64_t(r) * num_experts);
    });
    return tpe_all;
}

SigmaTable::SigmaTable(int bisection_ranks, std::string path)
    : bisection_ranks_(bisection_ranks), path_(std::move(path)) {
    if (path_.empty()) return;
    std::ifstream in(path_);
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty() || line[0] == '#' || line[0] == 'E') continue;  // comment or header
        std::istringstream ss(line);
        int e = 0, s = 0, k = 0, r = 0;
        double target = 0, sigma = 0;
        unsigned long long seed = 0;
        char c1, c2, c3, c4, c5, c6;
        if (ss >> e >> c1 >> s >> c2 >> k >> c3 >> r >> c4 >> target >> c5 >> seed >> c6 >> sigma)
            known_[Key{e, s, k, r, target, seed}] = sigma;
    }
}

SigmaTable::Key SigmaTable::key_of(const Case& c, uint64_t seed) const {
    const Shape& s = c.shape;
    const int ranks = bisection_ranks_ > 0 ? std::min(s.ranks, bisection_ranks_) : s.ranks;
    return Key{s.experts, s.tokens, s.topk, ranks, c.skew.value, seed};
}

void SigmaTable::store(const Key& k, double sigma) {
    known_[k] = sigma;
    if (path_.empty()) return;
    std::ifstream probe(path_);
    const bool fresh = !probe.good() || probe.peek() == std::ifstream::traits_type::eof();
    std::ofstream out(path_, std::ios::app);
    if (fresh) out << "E,S,K,bisection_ranks,maxvio_target,seed,sigma\n";
    char buf[160];
    std::snprintf(buf, sizeof buf, "%d,%d,%d,%d,%.17g,%llu,%.17g\n", std::get<0>(k), std::get<1>(k), std::get<2>(k),
                  std::get<3>(k), std::get<4>(k), (unsigned long long)std::get<5>(k), sigma);
    out << buf;
}

void SigmaTable::prepare(const std::vector<Case>& cases, const std::vector<uint64_t>& seeds) {
    std::vector<std::pair<Key, Case>> todo;
    for (const Case& c : cases) {
        if (c.skew.is_sigma) continue;
        for (uint64_t seed : seeds) {
            const Key k = key_of(c, seed);
            const bool queued = std::any_of(todo.begin(), todo.end(), [&](const auto& t) { return t.first == k; });
            if (!known_.count(k) && !queued) todo.push_back({k, c});
        }
    }
    if (todo.empty()) return;
    std::printf("sigma for %zu target maxvios (bisections on the host, in parallel)\n", todo.size());
    std::fflush(stdout);
    std::vector<double> found(todo.size());
    // One bisection per thread: each draws one rank's tokens after another (no nested threads).
    parallel_for(int(todo.size()), 0, [&](int i) {
        const auto& [k, c] = todo[size_t(i)];
        found[size_t(i)] = c.skew.sigma_for(c.shape, std::get<5>(k), bisection_ranks_);
    });
    for (size_t i = 0; i < todo.size(); ++i) store(todo[i].first, found[i]);
}

double SigmaTable::sigma(const Case& c, uint64_t seed) {
    if (c.skew.is_sigma) return c.skew.value;
    const Key k = key_of(c, seed);
    auto it = known_.find(k);
    if (it != known_.end()) return it->second;
    const double s = c.skew.sigma_for(c.shape, seed, bisection_ranks_);
    store(k, s);
    return s;
}

}  // namespace flatep::bench
