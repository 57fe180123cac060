// The ipc transport on host memory: R processes share memfd regions passed over the socket mesh (SCM_RIGHTS).
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "common/check.hpp"
#include "flatep/error.hpp"
#include "flatep/ipc.hpp"
#include "transport/host_memory.hpp"
#include "transport/ipc_transport.hpp"
#include "unit/transport/test_ipc_util.hpp"

namespace flatep {
namespace {

using transport::IpcOptions;
using transport::IpcTransport;
using transport::make_host_ipc_memory;
namespace host_memory = transport::host_memory;

using test::count_mappings;
using test::count_open_fds;
using test::expect_timeout_naming;
using test::Failure;
using test::seconds_since;
using test::victim;
using Clock = std::chrono::steady_clock;

uint32_t pattern(int owner, int region_idx, size_t word_idx) {
    return static_cast<uint32_t>(owner * 0x01000193u + region_idx * 0x9e3779b9u + word_idx * 2654435761u);
}

// Every rank fills its own regions, then reads every peer's; then every rank writes one word into every peer's
// region and checks, after a barrier, that all peers' words arrived in its own memory.
int check_shared_regions(int rank, std::shared_ptr<Bootstrap> boot) {
    const int num_ranks = boot->size();
    std::unique_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, 5.0);
    CHILD_CHECK(transport->rank() == rank && transport->num_ranks() == num_ranks, "rank/size");
    CHILD_CHECK(std::string(transport->name()) == "ipc" && transport->memory_kind() == MemoryKind::kHost, "kind");
    const size_t sizes[] = {4096, 1000, 3 * 65536 + 8};
    std::vector<SymmetricRegion> regions;
    for (const size_t bytes : sizes) {
        SymmetricRegion region = transport->allocate(bytes);
        CHILD_CHECK(region.bytes == bytes && region.mapped_bytes >= bytes &&
                        region.mapped_bytes % host_memory::page_size() == 0,
                    "sizes ", region.bytes, " ", region.mapped_bytes);
        CHILD_CHECK(region.local == region.peers[rank] && region.local_fd >= 0, "local");
        for (int p = 0; p < num_ranks; ++p) CHILD_CHECK(region.peers[p] != nullptr, "peer ", p, " unmapped");
        for (int p = num_ranks; p < kMaxRanks; ++p) CHILD_CHECK(region.peers[p] == nullptr, "peer ", p, " set");
        for (size_t i = 0; i < region.mapped_bytes; ++i) CHILD_CHECK(region.local[i] == 0, "byte ", i, " not zero");
        regions.push_back(region);
    }
    for (size_t j = 0; j < regions.size(); ++j) {
        auto* words = reinterpret_cast<uint32_t*>(regions[j].local);
        for (size_t i = 0; i < sizes[j] / 4; ++i) words[i] = pattern(rank, static_cast<int>(j), i);
    }
    boot->all_gather("filled");
    for (size_t j = 0; j < regions.size(); ++j) {
        for (int p = 0; p < num_ranks; ++p) {
            const auto* words = reinterpret_cast<const uint32_t*>(regions[j].peers[p]);
            for (size_t i = 0; i < sizes[j] / 4; ++i)
                CHILD_CHECK(words[i] == pattern(p, static_cast<int>(j), i), "region ", j, " of rank ", p, " word ", i);
        }
    }
    boot->all_gather("read");
    // Remote writes: rank r writes word r of every peer's region 2.
    for (int p = 0; p < num_ranks; ++p) reinterpret_cast<uint32_t*>(regions[2].peers[p])[rank] = 1000 + rank;
    boot->all_gather("written");
    for (int p = 0; p < num_ranks; ++p)
        CHILD_CHECK(reinterpret_cast<uint32_t*>(regions[2].local)[p] == static_cast<uint32_t>(1000 + p), "word ", p);
    // local_fd is this rank's memory: mapping it again shows the same bytes.
    void* again = host_memory::map(regions[0].local_fd, regions[0].mapped_bytes);
    CHILD_CHECK(std::memcmp(again, regions[0].local, regions[0].mapped_bytes) == 0, "local_fd maps other memory");
    host_memory::unmap(again, regions[0].mapped_bytes);
    for (SymmetricRegion& region : regions) transport->release(region);
    CHILD_CHECK(regions[0].local == nullptr && regions[0].local_fd == -1, "release did not clear the region");
    return 0;
}

class IpcHostRegions : public ::testing::TestWithParam<int> {};

TEST_P(IpcHostRegions, EveryRankSeesEveryPeersWrites) {
    const int num_ranks = GetParam();
    const std::vector<int> codes = run_forked(num_ranks, check_shared_regions, ForkOptions{5.0, 60.0});
    EXPECT_EQ(codes, std::vector<int>(num_ranks, 0))
        << "repro: flatep_transport_tests --gtest_filter='*IpcHostRegions*'";
}

INSTANTIATE_TEST_SUITE_P(Ranks, IpcHostRegions, ::testing::Values(1, 2, 4, 8));

TEST(IpcTransport, CreateAllocateDestroyCyclesLeakNothing) {
    const std::vector<int> codes = run_forked(
        2,
        [](int rank, std::shared_ptr<Bootstrap> boot) {
            // One warm-up cycle first, so that lazily created process state (log mutex, locale) is not counted.
            int fds_before = -1, memfd_maps_before = -1, maps_before = -1;
            for (int cycle = 0; cycle < 6; ++cycle) {
                if (cycle == 1) {
                    fds_before = count_open_fds();
                    memfd_maps_before = count_mappings("memfd:");
                    maps_before = count_mappings("");
                }
                std::unique_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, 5.0);
                SymmetricRegion a = transport->allocate(1 << 16);
                SymmetricRegion b = transport->allocate(12345);
                SymmetricRegion c = transport->allocate(1 << 20);
                CHILD_CHECK(count_mappings("memfd:") >= memfd_maps_before + 6, "regions not mapped");
                a.peers[1 - rank][7] = static_cast<uint8_t>(cycle);
                transport->release(b);
                transport->release(b);  // a second release is a logged no-op
                boot->all_gather("written");
                CHILD_CHECK(a.local[7] == static_cast<uint8_t>(cycle), "cycle ", cycle);
                boot->all_gather("checked");
                // a and c are released by the destructor.
                (void)c;
            }
            CHILD_CHECK(count_open_fds() == fds_before, "descriptors leaked: ", fds_before, " -> ", count_open_fds());
            CHILD_CHECK(count_mappings("memfd:") == memfd_maps_before, "memfd mappings leaked: ", memfd_maps_before,
                        " -> ", count_mappings("memfd:"));
            CHILD_CHECK(count_mappings("") <= maps_before + 2, "mappings grew: ", maps_before, " -> ",
                        count_mappings(""));
            return 0;
        },
        ForkOptions{5.0, 60.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

// A process that is not a rank (a child of rank 0: same uid, knows the job's socket name and nonce) connects to
// rank 0's socket before the real peer does. It must be refused and logged, and the job must still work.
TEST(IpcTransport, ForeignConnectionIsRefusedAndTheJobWorks) {
    const std::vector<int> codes = run_forked(
        2,
        [](int rank, std::shared_ptr<Bootstrap> boot) {
            pid_t intruder = -1;
            IpcOptions options;
            options.timeout_s = 5.0;
            if (rank == 0) {
                options.on_listening = [&intruder](const std::string& name) {
                    int ready[2];
                    if (::pipe(ready) != 0) return;
                    intruder = ::fork();
                    if (intruder == 0) {
                        // Exit codes: 0 refused (connection closed without a reply), 1 accepted, 2 could not connect.
                        sockaddr_un addr{};
                        addr.sun_family = AF_UNIX;
                        std::memcpy(addr.sun_path + 1, name.data(), name.size());
                        const socklen_t length = offsetof(sockaddr_un, sun_path) + 1 + name.size();
                        const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
                        if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), length) != 0) ::_exit(2);
                        // Claim to be rank 1 with the right token: the pid check must refuse it anyway.
                        char hello[128] = {};
                        const ssize_t sent = ::send(fd, hello, sizeof(hello), MSG_NOSIGNAL);
                        (void)sent;
                        const char byte = 1;
                        if (::write(ready[1], &byte, 1) != 1) ::_exit(2);
                        pollfd pfd{fd, POLLIN, 0};
                        if (::poll(&pfd, 1, 10000) <= 0) ::_exit(1);
                        char reply[16];
                        ::_exit(::recv(fd, reply, sizeof(reply), 0) > 0 ? 1 : 0);
                    }
                    char byte = 0;
                    pollfd pfd{ready[0], POLLIN, 0};
                    if (::poll(&pfd, 1, 5000) == 1) (void)!::read(ready[0], &byte, 1);  // connected: now let rank 1 in
                    ::close(ready[0]);
                    ::close(ready[1]);
                };
            }
            auto transport = std::make_unique<IpcTransport>(boot, make_host_ipc_memory(), options);
            SymmetricRegion region = transport->allocate(4096);
            region.peers[1 - rank][0] = static_cast<uint8_t>(40 + rank);
            boot->all_gather("written");
            CHILD_CHECK(region.local[0] == static_cast<uint8_t>(40 + 1 - rank), "peer write missing");
            if (rank == 0) {
                CHILD_CHECK(intruder > 0, "intruder not started");
                CHILD_CHECK(transport->num_refused() == 1, "refused ", transport->num_refused(), " connections");
                int status = 0;
                const auto start = Clock::now();
                while (::waitpid(intruder, &status, WNOHANG) == 0 && seconds_since(start) < 15)
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
                CHILD_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "intruder status ", status);
            } else {
                CHILD_CHECK(transport->num_refused() == 0, "refused ", transport->num_refused());
            }
            return 0;
        },
        ForkOptions{5.0, 60.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

class IpcPeerFailure : public ::testing::TestWithParam<Failure> {};

TEST_P(IpcPeerFailure, NextAllocateTimesOutNamingTheRank) {
    const Failure failure = GetParam();
    constexpr double kTimeout = 1.0;
    const auto start = Clock::now();
    const std::vector<int> codes = run_forked(
        4,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            std::unique_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, kTimeout);
            SymmetricRegion first = transport->allocate(8192);
            if (rank == 2) return victim(failure);
            const int code = expect_timeout_naming(2, kTimeout, [&] { transport->allocate(8192); });
            // The survivor is still consistent: its first region is intact and releases cleanly.
            first.local[0] = 1;
            transport->release(first);
            return code;
        },
        ForkOptions{kTimeout, 20.0});
    const int victim_code = failure == Failure::kSigkill ? 128 + SIGKILL : 3;
    EXPECT_EQ(codes, (std::vector<int>{0, 0, victim_code, 0}));
    EXPECT_LT(seconds_since(start), 8.0);
}

INSTANTIATE_TEST_SUITE_P(Failures, IpcPeerFailure,
                         ::testing::Values(Failure::kExit, Failure::kSigkill, Failure::kStall));

TEST(IpcTransport, RankMissingAtConstructionTimesOutNamingIt) {
    constexpr double kTimeout = 1.0;
    const std::vector<int> codes = run_forked(
        3,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            if (rank == 1) return victim(Failure::kExit);
            return expect_timeout_naming(1, kTimeout, [&] { make_ipc_transport(boot, MemoryKind::kHost, kTimeout); });
        },
        ForkOptions{kTimeout, 20.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 3, 0}));
}

TEST(IpcTransport, MismatchedAllocationSizesNameThePeer) {
    const std::vector<int> codes = run_forked(
        2,
        [](int rank, std::shared_ptr<Bootstrap> boot) {
            std::unique_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, 5.0);
            try {
                transport->allocate(rank == 0 ? 4096 : 8192);
            } catch (const Error& e) {
                CHILD_CHECK(e.category() == ErrorCategory::kMismatch, e.what());
                CHILD_CHECK(e.message().find(detail::concat("rank ", 1 - rank, " (pid")) != std::string::npos,
                            e.what());
                return 0;
            }
            CHILD_CHECK(false, "mismatched sizes were accepted");
            return 1;
        },
        ForkOptions{5.0, 30.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

TEST(IpcTransport, PeerMemoryOutlivesThePeer) {
    const std::vector<int> codes = run_forked(
        2,
        [](int rank, std::shared_ptr<Bootstrap> boot) {
            std::unique_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, 5.0);
            SymmetricRegion region = transport->allocate(4096);
            region.local[100] = static_cast<uint8_t>(7 + rank);
            boot->all_gather("written");
            if (rank == 1) return 0;  // exits, destroying its transport
            try {                     // returns (throws) once rank 1 has exited: its sockets close with the process
                boot->all_gather("exited?");
                CHILD_CHECK(false, "rank 1 answered after returning");
            } catch (const Error& e) {
                CHILD_CHECK(e.message().find("rank 1 (pid") != std::string::npos, e.what());
            }
            CHILD_CHECK(region.peers[1][100] == 8, "peer memory changed after the peer exited");
            transport->release(region);
            return 0;
        },
        ForkOptions{5.0, 30.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

}  // namespace
}  // namespace flatep
