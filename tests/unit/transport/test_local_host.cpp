// The local host transport (R ranks as threads), memfd host memory and the host barrier.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "flatep/error.hpp"
#include "sync/barrier_host.hpp"
#include "transport/host_memory.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;
namespace host_memory = transport::host_memory;

using testing::failures;
using testing::run_ranks;

TEST(HostMemory, FixedMappingsOfTwoMemfdsFormOneContiguousRange) {
    const size_t page = host_memory::page_size();
    const int a = host_memory::create(2 * page, "test-a");
    const int b = host_memory::create(page, "test-b");
    auto* plain_a = static_cast<uint8_t*>(host_memory::map(a, 2 * page));
    auto* plain_b = static_cast<uint8_t*>(host_memory::map(b, page));
    auto* range = static_cast<uint8_t*>(host_memory::reserve(3 * page));
    host_memory::map_fixed(range, a, 2 * page);
    host_memory::map_fixed(range + 2 * page, b, page);
    EXPECT_EQ(range[0], 0);    // zero-filled
    range[2 * page - 1] = 11;  // last byte of a
    range[2 * page] = 22;      // first byte of b
    EXPECT_EQ(plain_a[2 * page - 1], 11);
    EXPECT_EQ(plain_b[0], 22);
    plain_b[page - 1] = 33;
    EXPECT_EQ(range[3 * page - 1], 33);
    host_memory::unmap(range, 3 * page);
    host_memory::unmap(plain_a, 2 * page);
    host_memory::unmap(plain_b, page);
    host_memory::close_fd(a);
    host_memory::close_fd(b);
    EXPECT_EQ(host_memory::round_up_pages(1), page);
    EXPECT_EQ(host_memory::round_up_pages(page + 1), 2 * page);
    try {
        host_memory::create(page + 1, "bad");
        FAIL() << "no error";
    } catch (const Error& e) {
        EXPECT_EQ(e.message(), "host_memory::create: bytes must be a positive multiple of the page size (" +
                                   std::to_string(page) + "), got " + std::to_string(page + 1));
    }
}

TEST(LocalHost, AllGatherReturnsEveryRanksBlobInRankOrder) {
    const int R = 5;
    LocalHostWorld world(R, 10.0);
    std::vector<std::vector<std::string>> got(R);
    const auto errors = run_ranks(R, [&](int rank) {
        auto t = world.transport(rank);
        EXPECT_EQ(t->bootstrap().rank(), rank);
        EXPECT_EQ(t->bootstrap().size(), R);
        for (int round = 0; round < 20; ++round) {
            const auto blobs = t->bootstrap().all_gather(std::string(size_t(rank + 1), char('a' + round)));
            ASSERT_EQ(int(blobs.size()), R);
            for (int p = 0; p < R; ++p) ASSERT_EQ(blobs[p], std::string(size_t(p + 1), char('a' + round)));
        }
    });
    EXPECT_EQ(failures(errors), "");
}

TEST(LocalHost, AllocateMapsEveryPeerAndRegionsAreZeroAndShared) {
    const int R = 4;
    LocalHostWorld world(R, 10.0);
    const size_t bytes = 10000;
    std::vector<int> seen(R * R, -1);
    const auto errors = run_ranks(R, [&](int rank) {
        auto t = world.transport(rank);
        EXPECT_STREQ(t->name(), "local");
        EXPECT_EQ(t->memory_kind(), MemoryKind::kHost);
        SymmetricRegion region = t->allocate(bytes);
        EXPECT_EQ(region.bytes, bytes);
        EXPECT_EQ(region.mapped_bytes % host_memory::page_size(), 0u);
        EXPECT_GE(region.mapped_bytes, bytes);
        EXPECT_EQ(region.local, region.peers[rank]);
        EXPECT_GE(region.local_fd, 0);
        for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(region.local[i], 0);
        t->bootstrap().all_gather("");  // everyone checked zeros before anyone writes
        // Each rank writes its id into every peer's region at slot `rank`; after a rendezvous every rank reads
        // all slots of its own region.
        for (int p = 0; p < R; ++p) region.peers[p][rank * 8] = uint8_t(10 + rank);
        t->bootstrap().all_gather("");
        for (int p = 0; p < R; ++p) seen[rank * R + p] = region.local[p * 8];
        t->bootstrap().all_gather("");
        t->release(region);
        EXPECT_EQ(region.local, nullptr);
        t->release(region);  // a second release is a no-op
    });
    EXPECT_EQ(failures(errors), "");
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < R; ++p) EXPECT_EQ(seen[r * R + p], 10 + p) << "rank " << r << " slot " << p;
}

TEST(LocalHost, AllocateWithDifferentSizesIsAMismatchOnEveryRank) {
    const int R = 3;
    LocalHostWorld world(R, 10.0);
    std::vector<std::string> messages(R);
    run_ranks(R, [&](int rank) {
        try {
            world.transport(rank)->allocate(rank == 1 ? 8192 : 4096);
        } catch (const Error& e) {
            EXPECT_EQ(e.category(), ErrorCategory::kMismatch);
            messages[rank] = e.message();
        }
    });
    EXPECT_EQ(messages[0], "allocate: rank 0 asked for 4096 bytes but rank 1 asked for 8192");
    EXPECT_EQ(messages[1], "allocate: rank 1 asked for 8192 bytes but rank 0 asked for 4096");
    EXPECT_EQ(messages[2], "allocate: rank 2 asked for 4096 bytes but rank 1 asked for 8192");
}

// The agreement is on the bytes asked, not on the pages they round up to: two sizes on one page (what a region's
// mapped_bytes would not tell apart) are a mismatch like any other, on every rank, and the transports allocate
// normally afterwards (the refused round leaves no region behind). Pairs on one page, at a page's end and across
// pages.
TEST(LocalHost, AllocateAgreesOnTheBytesAskedNotOnTheirPages) {
    const size_t page = host_memory::page_size();
    const std::vector<std::pair<size_t, size_t>> pairs = {
        {100, 200}, {1, page}, {page - 1, page}, {page + 1, 2 * page}, {page, page + 1}, {page + 8, page + 16}};
    const int R = 2;
    LocalHostWorld world(R, 10.0);
    for (const auto& [a, b] : pairs) {
        ASSERT_NE(a, b);
        std::vector<std::string> messages(R);
        std::vector<int> categories(R, -1);
        const auto errors = run_ranks(R, [&](int rank) {
            auto t = world.transport(rank);
            const size_t mine = rank == 0 ? a : b;
            try {
                SymmetricRegion region = t->allocate(mine);
                t->release(region);
            } catch (const Error& e) {
                categories[rank] = int(e.category());
                messages[rank] = e.message();
            }
            // The same size on both ranks afterwards: allocated, and every peer's region is there.
            SymmetricRegion region = t->allocate(a);
            EXPECT_EQ(region.bytes, a);
            for (int p = 0; p < R; ++p) EXPECT_NE(region.peers[p], nullptr);
            t->bootstrap().all_gather("");
            t->release(region);
        });
        ASSERT_EQ(failures(errors), "");
        for (int r = 0; r < R; ++r) EXPECT_EQ(categories[r], int(ErrorCategory::kMismatch)) << a << " vs " << b;
        EXPECT_EQ(messages[0], "allocate: rank 0 asked for " + std::to_string(a) + " bytes but rank 1 asked for " +
                                   std::to_string(b));
        EXPECT_EQ(messages[1], "allocate: rank 1 asked for " + std::to_string(b) + " bytes but rank 0 asked for " +
                                   std::to_string(a));
    }
}

TEST(LocalHost, AllGatherTimesOutNamingTheMissingPeer) {
    const int R = 3;
    LocalHostWorld world(R, 0.5);
    std::vector<std::string> messages(R);
    std::vector<double> seconds(R, 0);
    run_ranks(R, [&](int rank) {
        if (rank == 2) return;
        const auto start = std::chrono::steady_clock::now();
        try {
            world.transport(rank)->bootstrap().all_gather("x");
        } catch (const Error& e) {
            EXPECT_EQ(e.category(), ErrorCategory::kTimeout);
            messages[rank] = e.message();
        }
        seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
    for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(messages[r], "timeout in all_gather: rank " + std::to_string(r) +
                                   " waited 0.5 s for peer 2 (round 0, 2 of 3 ranks arrived)");
        EXPECT_GE(seconds[r], 0.5);
        EXPECT_LT(seconds[r], 2.0);
    }
}

// Barrier state of R ranks in one process: flag arrays and epochs.
struct BarrierState {
    explicit BarrierState(int R) : flags(size_t(R) * kMaxRanks, 0), epochs(R, 0), status(size_t(R) * 4, 0) {}
    sync::SyncArgs sync(int rank, int R, double timeout) {
        sync::SyncArgs s{};
        for (int p = 0; p < R; ++p) s.flags[p] = flags.data() + size_t(p) * kMaxRanks;
        s.epoch = &epochs[rank];
        s.status = status.data() + size_t(rank) * 4;
        s.rank = rank;
        s.num_ranks = R;
        s.timeout_s = timeout;
        return s;
    }
    std::vector<uint64_t> flags, epochs;
    std::vector<int32_t> status;
};

TEST(HostBarrier, OrdersWritesBeforeTheBarrierWithReadsAfterIt) {
    // Each round every rank writes round-tagged values into its slot of a shared array (plain stores), then a
    // barrier, then checks every slot, then a barrier before the next round overwrites them.
    const int R = 6, rounds = 300;
    BarrierState state(R);
    std::vector<int64_t> data(R * 16, -1);
    const auto errors = run_ranks(R, [&](int rank) {
        const sync::SyncArgs sync = state.sync(rank, R, 10.0);
        for (int round = 0; round < rounds; ++round) {
            for (int i = 0; i < 16; ++i) data[rank * 16 + i] = int64_t(round) * 1000 + rank * 16 + i;
            sync::host::barrier(sync, sync::kOpDispatch);
            for (int p = 0; p < R; ++p)
                for (int i = 0; i < 16; ++i)
                    ASSERT_EQ(data[p * 16 + i], int64_t(round) * 1000 + p * 16 + i) << "round " << round;
            sync::host::barrier(sync, sync::kOpCombine);
        }
    });
    EXPECT_EQ(failures(errors), "");
    for (int r = 0; r < R; ++r) EXPECT_EQ(state.epochs[r], uint64_t(2 * rounds));
}

TEST(HostBarrier, TimeoutNamesOpRankPeerAndFlagsAndRecordsStatus) {
    const int R = 4;
    BarrierState state(R);
    std::vector<std::string> messages(R);
    std::vector<double> seconds(R, 0);
    run_ranks(R, [&](int rank) {
        const sync::SyncArgs sync = state.sync(rank, R, 0.5);
        if (rank == 3) return;
        const auto start = std::chrono::steady_clock::now();
        try {
            sync::host::barrier(sync, sync::kOpGradReduce);
        } catch (const Error& e) {
            EXPECT_EQ(e.category(), ErrorCategory::kTimeout);
            messages[rank] = e.message();
        }
        seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
    for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(messages[r], "timeout in reduce_grad: rank " + std::to_string(r) +
                                   " waited 0.5 s for peer 3 (flag 0 < expected 1)");
        // The wait honours its timeout: not before it, and not much after it (the sleeps are at most 1 ms).
        EXPECT_GE(seconds[r], 0.5) << "rank " << r;
        EXPECT_LT(seconds[r], 2.0) << "rank " << r;
        EXPECT_EQ(state.status[r * 4 + sync::kStatusCode], sync::kStatusTimeout);
        EXPECT_EQ(state.status[r * 4 + sync::kStatusIndex], sync::kOpGradReduce);
        EXPECT_EQ(state.status[r * 4 + sync::kStatusValue], 0);
        EXPECT_EQ(state.status[r * 4 + sync::kStatusPeer], 3);
    }
    EXPECT_EQ(state.status[3 * 4 + sync::kStatusCode], sync::kStatusOk);
}

}  // namespace
}  // namespace flatep
