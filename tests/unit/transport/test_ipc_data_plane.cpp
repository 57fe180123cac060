// The full CPU data plane (plan, dispatch, prefetch, combine, reduce_grad through Buffer and ExpertPools) run by R
// processes over the ipc transport on host memory must match, bitwise, the same steps run by R threads over the
// local transport (LocalHostWorld). Children write their outputs into a MAP_SHARED area the parent compares.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "routing/routing.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

struct Case {
    int R, epn, S, K, H, align;
    double sigma;
    uint64_t seed;
};

std::string describe(const Case& c) {
    std::ostringstream os;
    os << "R=" << c.R << " epn=" << c.epn << " S=" << c.S << " K=" << c.K << " H=" << c.H << " align=" << c.align
       << " sigma=" << c.sigma << " seed=" << c.seed;
    return os.str();
}

constexpr int kSteps = 2;
constexpr uint16_t kCanaryX = 0xa5a5;
const ProjectionShape kShapes[2] = {{16, 24}, {24, 8}};

// Appends raw bytes of a span to the output record.
template <typename T>
void put(std::vector<uint8_t>& record, std::span<const T> values) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(values.data());
    record.insert(record.end(), bytes, bytes + values.size_bytes());
}
template <typename T>
void put(std::vector<uint8_t>& record, const std::vector<T>& values) {
    put(record, std::span<const T>(values));
}

// One rank's whole run; every input is a function of (case, step, rank), so threads and processes compute the
// same thing. Returns the record of everything the rank observed.
std::vector<uint8_t> run_rank(const Case& c, int rank, std::shared_ptr<Transport> transport, int* num_replicas) {
    Config cfg;
    cfg.num_ranks = c.R;
    cfg.rank = rank;
    cfg.num_experts = c.R * c.epn;
    cfg.num_tokens = c.S;
    cfg.topk = c.K;
    cfg.hidden = c.H;
    cfg.align = c.align;
    Buffer buffer(cfg, transport);
    ExpertPools pools(transport, c.epn, {kShapes[0], kShapes[1]});
    ExpertLayer layer = pools.register_layer();
    const Layout& l = internal::layout(buffer);
    const int nvs = l.num_recv_rows, E = c.R * c.epn;
    for (int p = 0; p < 2; ++p) {
        const int64_t n = kShapes[p].elems();
        for (int64_t i = 0; i < c.epn * n; ++i) {
            layer.own_weights(p)[i] = float_to_bf16(testing::uniform_float(1000 + rank * 2 + p, i, -2.0f, 2.0f));
            layer.own_grads(p)[i] = testing::uniform_float(2000 + rank * 2 + p, i, -1.0f, 1.0f);
        }
    }
    std::vector<uint8_t> record;
    for (int step = 0; step < kSteps; ++step) {
        const uint64_t seed = c.seed * 100 + step;
        const std::vector<double> pop = routing::popularity(E, c.sigma, seed);
        const int s = step == 0 ? c.S : (c.S * (rank + 2)) % (c.S + 1);  // second step: ragged token counts
        std::vector<int32_t> idx(size_t(c.S) * c.K);
        routing::sample_topk(pop, c.S, c.K, seed, rank, idx.data());
        const uint64_t stream = routing::mix64(seed * 131 + uint64_t(rank));
        const std::vector<uint16_t> x = testing::random_bf16(size_t(s) * c.H, stream ^ 1);
        const std::vector<float> w = testing::random_floats(size_t(s) * c.K, stream ^ 2, 0.05f, 1.0f);
        const std::vector<uint16_t> y = testing::random_bf16_wide(size_t(nvs) * c.H, stream ^ 3);

        const Plan plan = buffer.plan(idx.data(), 4, s);
        std::vector<uint16_t> recv_x(size_t(nvs) * c.H, kCanaryX);
        std::vector<float> recv_w(nvs, -7.0f);
        buffer.dispatch(plan, x.data(), w.data(), recv_x.data(), recv_w.data());
        pools.prefetch(plan, layer);
        std::vector<uint16_t> out(size_t(c.S) * c.H, kCanaryX), out_weighted(size_t(c.S) * c.H, kCanaryX);
        buffer.combine(plan, y.data(), nullptr, out.data());
        buffer.combine(plan, y.data(), recv_w.data(), out_weighted.data());
        // Replica gradients "computed" into the reduce-pool half of the grads view, then reduced to the owners.
        for (int p = 0; p < 2; ++p) {
            const int64_t n = kShapes[p].elems();
            float* pool_half = layer.grads(p) + c.epn * n;
            for (int64_t i = 0; i < c.epn * n; ++i)
                pool_half[i] = testing::uniform_float(3000 + seed * 64 + rank * 2 + p, i, -1.0f, 1.0f);
        }
        pools.reduce_grad(plan, layer);
        buffer.check_status();

        put(record, plan.alloc());
        put(record, plan.cu_seqlens(rank));
        for (int d = 0; d < c.R; ++d) put(record, plan.slot_expert(d));
        const int32_t replicas = plan.stats().total_replicas;
        put(record, std::span<const int32_t>(&replicas, 1));
        if (num_replicas != nullptr) *num_replicas += replicas;
        put(record, recv_x);
        put(record, recv_w);
        put(record, out);
        put(record, out_weighted);
        for (int p = 0; p < 2; ++p) {
            const int64_t n = kShapes[p].elems();
            put(record, std::span<const uint16_t>(layer.weights(p), size_t(2 * c.epn * n)));
            put(record, std::span<const float>(layer.grads(p), size_t(2 * c.epn * n)));
        }
    }
    return record;
}

constexpr size_t kRecordCapacity = size_t(1) << 21;  // per rank, in the shared area (8-byte length prefix)

class IpcDataPlane : public ::testing::TestWithParam<Case> {};

TEST_P(IpcDataPlane, ProcessesMatchThreadsBitwise) {
    const Case c = GetParam();
    // Reference: R threads over the local transport.
    std::vector<std::vector<uint8_t>> expected(c.R);
    std::vector<int> replicas(c.R, 0);
    LocalHostWorld world(c.R, 30.0);
    const std::vector<std::string> errors = testing::run_ranks(
        c.R, [&](int rank) { expected[rank] = run_rank(c, rank, world.transport(rank), &replicas[rank]); });
    ASSERT_EQ(testing::failures(errors), "") << describe(c);
    ASSERT_GT(replicas[0], 0) << "the case places no replicas, so prefetch and reduce_grad move nothing";

    // R processes over the ipc transport, writing their records into a shared anonymous mapping.
    const size_t area_bytes = kRecordCapacity * c.R;
    void* area = ::mmap(nullptr, area_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(area, MAP_FAILED);
    auto* base = static_cast<uint8_t*>(area);
    const std::vector<int> codes = run_forked(
        c.R,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, 10.0);
            const std::vector<uint8_t> record = run_rank(c, rank, transport, nullptr);
            if (record.size() + 8 > kRecordCapacity) return 2;
            uint8_t* slot = base + kRecordCapacity * rank;
            const uint64_t size = record.size();
            std::memcpy(slot, &size, 8);
            std::memcpy(slot + 8, record.data(), record.size());
            return 0;
        },
        ForkOptions{10.0, 60.0});
    EXPECT_EQ(codes, std::vector<int>(c.R, 0)) << describe(c);
    for (int r = 0; r < c.R && codes[r] == 0; ++r) {
        uint64_t size = 0;
        std::memcpy(&size, base + kRecordCapacity * r, 8);
        ASSERT_EQ(size, expected[r].size()) << "rank " << r << " " << describe(c);
        const uint8_t* got = base + kRecordCapacity * r + 8;
        size_t first = 0;
        while (first < size && got[first] == expected[r][first]) ++first;
        EXPECT_EQ(first, size) << "rank " << r << ": first differing byte " << first << " of " << size << " ("
                               << describe(c) << ")\nrepro: flatep_transport_tests --gtest_filter='*IpcDataPlane*'";
    }
    ::munmap(area, area_bytes);
}

// The same steps on virtual ranks (make_virtual_ranks: R threads of this process, each with the ipc transport over an
// in-process all-gather, as flatep.virtual builds them), driven by run_threads: the threads' bits again.
TEST_P(IpcDataPlane, VirtualRanksMatchThreadsBitwise) {
    const Case c = GetParam();
    std::vector<std::vector<uint8_t>> expected(c.R), got(c.R);
    LocalHostWorld world(c.R, 30.0);
    ASSERT_EQ(testing::failures(testing::run_ranks(
                  c.R, [&](int rank) { expected[rank] = run_rank(c, rank, world.transport(rank), nullptr); })),
              "");
    const std::vector<std::shared_ptr<Transport>> ranks = make_virtual_ranks(c.R, MemoryKind::kHost, 30.0);
    ASSERT_EQ(ranks.size(), size_t(c.R));
    for (int r = 0; r < c.R; ++r) {
        EXPECT_EQ(ranks[r]->rank(), r);
        EXPECT_STREQ(ranks[r]->name(), "ipc");
    }
    run_threads(c.R, [&](int rank) { got[rank] = run_rank(c, rank, ranks[rank], nullptr); });
    for (int r = 0; r < c.R; ++r) EXPECT_EQ(got[r], expected[r]) << "rank " << r << " " << describe(c);
}

INSTANTIATE_TEST_SUITE_P(Cases, IpcDataPlane,
                         ::testing::Values(Case{2, 2, 32, 2, 64, 8, 1.5, 1}, Case{4, 2, 32, 4, 64, 4, 2.0, 2},
                                           Case{8, 2, 24, 4, 32, 1, 2.0, 3}));

// A rank that dies between two data-plane ops: every survivor's next op fails with a timeout naming it (the host
// barrier helper's wait on that peer's flag), within the timeout, and the survivors exit cleanly.
TEST(IpcDataPlane, RankDyingBeforeDispatchIsNamedBySurvivors) {
    constexpr double kTimeout = 1.0;
    const Case c{4, 2, 16, 2, 32, 4, 1.0, 9};
    const std::vector<int> codes = run_forked(
        c.R,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, kTimeout);
            Config cfg;
            cfg.num_ranks = c.R;
            cfg.rank = rank;
            cfg.num_experts = c.R * c.epn;
            cfg.num_tokens = c.S;
            cfg.topk = c.K;
            cfg.hidden = c.H;
            cfg.align = c.align;
            Buffer buffer(cfg, transport);
            std::vector<int32_t> idx(size_t(c.S) * c.K);
            routing::sample_topk(routing::popularity(c.R * c.epn, c.sigma, c.seed), c.S, c.K, c.seed, rank, idx.data());
            const Plan plan = buffer.plan(idx.data(), 4, c.S);
            if (rank == 2) ::_exit(3);
            const std::vector<uint16_t> x(size_t(c.S) * c.H, 0x3f80);
            std::vector<uint16_t> recv_x(size_t(buffer.num_recv_rows()) * c.H);
            const auto start = std::chrono::steady_clock::now();
            try {
                buffer.dispatch(plan, x.data(), nullptr, recv_x.data(), nullptr);
            } catch (const Error& e) {
                const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                if (e.category() != ErrorCategory::kTimeout || e.message().find("peer 2 ") == std::string::npos ||
                    elapsed > kTimeout + 1.0) {
                    std::fprintf(stderr, "rank %d: unexpected (%.2f s): %s\n", rank, elapsed, e.what());
                    return 1;
                }
                return 0;
            }
            std::fprintf(stderr, "rank %d: dispatch succeeded without rank 2\n", rank);
            return 1;
        },
        ForkOptions{kTimeout, 20.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0, 3, 0}));
}

TEST(VirtualRanks, RunThreadsRethrowsTheLowestFailingRanksError) {
    std::vector<int> ran(4, 0);
    const std::string message = testing::error_message([&] {
        run_threads(4, [&](int rank) {
            ran[rank] = 1;
            if (rank == 1 || rank == 3) FLATEP_THROW(ErrorCategory::kRuntime, "rank ", rank, " failed");
        });
    });
    EXPECT_EQ(message, "rank 1 failed");
    EXPECT_EQ(ran, std::vector<int>(4, 1)) << "every rank runs, whatever the others do";
}

TEST(VirtualRanks, BadArgumentsAreNamed) {
    EXPECT_EQ(testing::error_message([] { make_virtual_ranks(0, MemoryKind::kHost); }),
              "virtual ranks: num_ranks must be in [1, 64], got 0");
    EXPECT_EQ(testing::error_message([] { make_virtual_ranks(2, MemoryKind::kHost, -1.0); }),
              "virtual ranks: timeout_s must be a finite number of seconds in (0, 86400], got -1");
}

}  // namespace
}  // namespace flatep
