// The transports' own argument checks, called directly as a custom launcher or a test would call them (the Python
// front never passes these values): each bad argument gives one kInvalidArgument line naming the argument and the
// value, and the object or function still works with a good one right after.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "flatep/error.hpp"
#include "flatep/ipc.hpp"
#include "transport/bootstrap_mesh.hpp"
#include "transport/host_memory.hpp"
#include "transport/ipc_memory.hpp"
#include "transport/ipc_socket.hpp"
#include "transport/ipc_transport.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::IpcTransport;
using transport::LocalHostWorld;
using transport::MeshBootstrap;
namespace host_memory = transport::host_memory;
namespace ipc = transport::ipc;

using testing::Outcome;
using testing::outcome_of;
using testing::ScopedEnv;

// Every row of these tests expects this category.
constexpr int kInvalid = int(ErrorCategory::kInvalidArgument);

// A bootstrap of any claimed size whose all_gather returns this rank's blob alone (the checks run before any
// all_gather of more than one rank).
class ClaimedBootstrap final : public Bootstrap {
  public:
    explicit ClaimedBootstrap(int size) : size_(size) {}
    int rank() const override { return 0; }
    int size() const override { return size_; }
    std::vector<std::string> all_gather(const std::string& blob) override { return {blob}; }

  private:
    int size_;
};

std::vector<ipc::Fd> no_sockets(int n) { return std::vector<ipc::Fd>(size_t(n)); }

TEST(TransportArgs, MeshBootstrapRefusesASizeRankOrSocketCountOutOfRange) {
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"mesh: num_ranks must be in [1, 64], got 0", [] { MeshBootstrap b(0, 0, {}, 1.0, "mesh"); }},
        {"mesh: num_ranks must be in [1, 64], got 65", [] { MeshBootstrap b(0, 65, no_sockets(65), 1.0, "mesh"); }},
        {"mesh: rank -1 outside [0, 2)", [] { MeshBootstrap b(-1, 2, no_sockets(2), 1.0, "mesh"); }},
        {"mesh: rank 2 outside [0, 2)", [] { MeshBootstrap b(2, 2, no_sockets(2), 1.0, "mesh"); }},
        {"mesh: 1 sockets for 2 ranks", [] { MeshBootstrap b(1, 2, no_sockets(1), 1.0, "mesh"); }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    // One rank needs no connection: its all_gather is its own blob.
    MeshBootstrap solo(0, 1, no_sockets(1), 1.0, "mesh");
    EXPECT_EQ(solo.rank(), 0);
    EXPECT_EQ(solo.size(), 1);
    EXPECT_EQ(solo.all_gather("blob"), std::vector<std::string>{"blob"});
    EXPECT_EQ(solo.pid_of(0), getpid());
}

TEST(TransportArgs, SocketRendezvousRefusesNumRanksOutOfRange) {
    for (const int n : {0, 65, -3}) {
        const Outcome o = outcome_of([&] { make_socket_bootstrap("job", 0, n, 1.0); });
        EXPECT_EQ(o.message, "socket rendezvous: num_ranks must be in [1, 64], got " + std::to_string(n));
        EXPECT_EQ(o.category, kInvalid);
    }
    const Outcome o = outcome_of([] { make_socket_bootstrap("job", -1, 2, 1.0); });
    EXPECT_EQ(o.message, "socket rendezvous: rank -1 outside [0, 2)");
}

TEST(TransportArgs, SocketRendezvousFromEnvNamesTheMissingOrBadVariable) {
    const std::string job = "argchecks-" + std::to_string(getpid());
    struct Case {
        const char *job, *rank, *num_ranks;
        std::string want;
    };
    const std::vector<Case> cases = {
        {nullptr, "0", "1",
         "socket rendezvous: set FLATEP_JOB_ID, FLATEP_RANK and FLATEP_NUM_RANKS (got '', '0', '1')"},
        {"j", nullptr, "1",
         "socket rendezvous: set FLATEP_JOB_ID, FLATEP_RANK and FLATEP_NUM_RANKS (got 'j', '', '1')"},
        {"j", "0", nullptr,
         "socket rendezvous: set FLATEP_JOB_ID, FLATEP_RANK and FLATEP_NUM_RANKS (got 'j', '0', '')"},
        {"j", "x", "1", "FLATEP_RANK must be a non-negative integer, got 'x'"},
        {"j", "0x", "1", "FLATEP_RANK must be a non-negative integer, got '0x'"},
        {"j", "-1", "1", "FLATEP_RANK must be a non-negative integer, got '-1'"},
        {"j", "0", "99999999999", "FLATEP_NUM_RANKS must be a non-negative integer, got '99999999999'"},
        {"j", "0", "65", "socket rendezvous: num_ranks must be in [1, 64], got 65"},
    };
    for (const Case& c : cases) {
        ScopedEnv a("FLATEP_JOB_ID", c.job), b("FLATEP_RANK", c.rank), n("FLATEP_NUM_RANKS", c.num_ranks);
        const Outcome o = outcome_of([] { make_socket_bootstrap_from_env(1.0); });
        EXPECT_EQ(o.message, c.want);
        EXPECT_EQ(o.category, kInvalid) << c.want;
    }
    // Good values: a world of one rank, no peer to wait for.
    ScopedEnv a("FLATEP_JOB_ID", job.c_str()), b("FLATEP_RANK", "0"), n("FLATEP_NUM_RANKS", "1");
    const std::shared_ptr<Bootstrap> boot = make_socket_bootstrap_from_env(1.0);
    EXPECT_EQ(boot->rank(), 0);
    EXPECT_EQ(boot->size(), 1);
    EXPECT_EQ(boot->all_gather("x"), std::vector<std::string>{"x"});
}

TEST(TransportArgs, HostMemoryRefusesSizesOffsetsAndAddressesOffThePage) {
    const size_t page = host_memory::page_size();
    const std::string P = std::to_string(page);
    const int fd = host_memory::create(page, "argchecks");
    ASSERT_GE(fd, 0);
    void* const unaligned = reinterpret_cast<void*>(uintptr_t(page) + 1);
    std::ostringstream unaligned_text;
    unaligned_text << unaligned;
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"host_memory::create: bytes must be a positive multiple of the page size (" + P + "), got 0",
         [] { host_memory::create(0, "argchecks"); }},
        {"host_memory::create: bytes must be a positive multiple of the page size (" + P + "), got 100",
         [] { host_memory::create(100, "argchecks"); }},
        {"host_memory::map: offset must be a multiple of the page size (" + P + "), got 100",
         [&] { host_memory::map(fd, page, 100); }},
        {"host_memory::reserve: bytes must be a positive multiple of the page size (" + P + "), got 0",
         [] { host_memory::reserve(0); }},
        {"host_memory::map_fixed: address must be page aligned, got " + unaligned_text.str(),
         [&] { host_memory::map_fixed(unaligned, fd, page); }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    // The fd still maps, at a page-aligned address inside a reserved range too.
    auto* mapped = static_cast<uint8_t*>(host_memory::map(fd, page, 0));
    mapped[0] = 42;
    auto* range = static_cast<uint8_t*>(host_memory::reserve(2 * page));
    host_memory::map_fixed(range + page, fd, page);
    EXPECT_EQ(range[page], 42);
    host_memory::unmap(range, 2 * page);
    host_memory::unmap(mapped, page);
    host_memory::close_fd(fd);
}

TEST(TransportArgs, SocketPlumbingRefusesBadNamesMessageCountsAndMeshSpecs) {
    std::string longest = "argchecks-" + std::to_string(getpid()) + "-";  // unique on the machine, then 106 bytes
    longest.resize(106, 'n');
    const auto namer = [](int peer) { return "rank " + std::to_string(peer); };
    auto spec_of = [](int rank, int size) {
        ipc::MeshSpec s;
        s.name_prefix = "argchecks";
        s.rank = rank;
        s.size = size;
        s.timeout_s = 1.0;
        s.what = "mesh";
        return s;
    };
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"socket name must be 1..106 bytes, got ''", [] { ipc::listen_abstract("", 1); }},
        {"socket name must be 1..106 bytes, got '" + longest + "n'", [&] { ipc::listen_abstract(longest + "n", 1); }},
        {"exchange: 1 messages for 2 ranks",
         [&] {
             ipc::exchange({-1, -1}, 0, {ipc::Message{}}, 7, 1.0, "all_gather #1", namer);
         }},
        {"all_gather #1: no connection to rank 1",
         [&] {
             ipc::exchange({-1, -1}, 0, {ipc::Message{}, ipc::Message{}}, 7, 1.0, "all_gather #1", namer);
         }},
        {"mesh: rank 0 outside [0, 0)", [&] { ipc::build_mesh(spec_of(0, 0), -1, nullptr); }},
        {"mesh: rank -1 outside [0, 2)", [&] { ipc::build_mesh(spec_of(-1, 2), -1, nullptr); }},
        {"mesh: rank 2 outside [0, 2)", [&] { ipc::build_mesh(spec_of(2, 2), -1, nullptr); }},
        {"mesh: token longer than 64 bytes",
         [&] {
             ipc::MeshSpec s = spec_of(0, 1);
             s.token.assign(65, 't');
             ipc::build_mesh(s, -1, nullptr);
         }},
        {"mesh: 1 expected pids for 2 ranks",
         [&] {
             ipc::MeshSpec s = spec_of(0, 2);
             s.expected_pids = {getpid()};
             ipc::build_mesh(s, -1, nullptr);
         }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    // The longest name listens; a mesh of one rank with its pid and a 64-byte token needs no peer.
    ipc::Fd listener = ipc::listen_abstract(longest, 1);
    EXPECT_TRUE(listener.valid());
    ipc::MeshSpec s = spec_of(0, 1);
    s.token.assign(64, 't');
    s.expected_pids = {getpid()};
    int refused = 0;
    const std::vector<ipc::Fd> sockets = ipc::build_mesh(s, listener.get(), &refused);
    ASSERT_EQ(sockets.size(), 1u);
    EXPECT_FALSE(sockets[0].valid());
    EXPECT_EQ(refused, 0);
}

TEST(TransportArgs, IpcTransportRefusesNullMemoryBadWorldSizeZeroBytesAndBadDevice) {
    auto make = [](int size, bool with_memory) {
        IpcTransport t(std::make_shared<ClaimedBootstrap>(size),
                       with_memory ? transport::make_host_ipc_memory() : nullptr, transport::IpcOptions{});
    };
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"ipc transport: memory is null", [&] { make(1, false); }},
        {"ipc transport: num_ranks must be in [1, 64], got 0", [&] { make(0, true); }},
        {"ipc transport: num_ranks must be in [1, 64], got 65", [&] { make(65, true); }},
        {"ipc transport: device must be a CUDA device ordinal or -1, got -2",
         [] { make_ipc_transport(std::make_shared<ClaimedBootstrap>(1), MemoryKind::kHost, 1.0, false, -2); }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    std::unique_ptr<Transport> t = make_ipc_transport(std::make_shared<ClaimedBootstrap>(1), MemoryKind::kHost, 1.0);
    const Outcome zero = outcome_of([&] { t->allocate(0); });
    EXPECT_EQ(zero.message, "ipc allocate: bytes must be > 0, got 0");
    EXPECT_EQ(zero.category, kInvalid);
    // Still usable: a region of 100 bytes maps one granule, zero-filled.
    SymmetricRegion region = t->allocate(100);
    EXPECT_EQ(region.bytes, 100u);
    EXPECT_EQ(region.mapped_bytes, t->granularity());
    EXPECT_EQ(region.local[99], 0);
    EXPECT_EQ(static_cast<IpcTransport&>(*t).num_live_regions(), 1);
    t->release(region);
    EXPECT_EQ(static_cast<IpcTransport&>(*t).num_live_regions(), 0);
}

TEST(TransportArgs, LocalHostWorldRefusesBadSizesRanksAndByteCounts) {
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"LocalHostWorld: num_ranks must be in [1, 64], got 0", [] { LocalHostWorld w(0, 1.0); }},
        {"LocalHostWorld: num_ranks must be in [1, 64], got 65", [] { LocalHostWorld w(65, 1.0); }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    LocalHostWorld world(2, 1.0);
    for (const int rank : {-1, 2}) {
        const Outcome o = outcome_of([&] { world.transport(rank); });
        EXPECT_EQ(o.message, "LocalHostWorld::transport: rank must be in [0, 2), got " + std::to_string(rank));
        EXPECT_EQ(o.category, kInvalid);
    }
    const std::shared_ptr<Transport> t = world.transport(1);
    EXPECT_EQ(t->rank(), 1);
    EXPECT_EQ(world.transport(1), t);  // the same object again
    const Outcome zero = outcome_of([&] { t->allocate(0); });
    EXPECT_EQ(zero.message, "allocate: bytes must be positive, got 0");
    EXPECT_EQ(zero.category, kInvalid);
}

TEST(TransportArgs, LocalMemoryAndViewsRefuseHugeSizesAndPiecesPastTheEnd) {
    LocalHostWorld world(1, 1.0);
    const std::shared_ptr<Transport> t = world.transport(0);
    const size_t g = t->granularity();
    const Outcome huge = outcome_of([&] { t->allocate_local(SIZE_MAX); });
    EXPECT_EQ(huge.message, "allocate_local: bytes must be in [1, " + std::to_string(SIZE_MAX - g) + "], got " +
                                std::to_string(SIZE_MAX));
    EXPECT_EQ(huge.category, kInvalid);
    LocalMemory two = t->allocate_local(2 * g);
    ViewPiece piece;
    piece.local_id = two.id;
    piece.offset = g;  // starts inside the view, ends one granule past it
    const Outcome past = outcome_of([&] { t->map_view(2 * g, {piece}); });
    EXPECT_EQ(past.message, "map_view: piece 0 (" + std::to_string(2 * g) + " bytes at offset " + std::to_string(g) +
                                ") ends past the view's " + std::to_string(2 * g) + " bytes");
    EXPECT_EQ(past.category, kInvalid);
    // The same piece at offset 0 maps and reads the memory.
    two.ptr[g] = 7;
    piece.offset = 0;
    MappedView view = t->map_view(2 * g, {piece});
    EXPECT_EQ(view.base[g], 7);
    t->unmap_view(view);
    t->release_local(two);
}

TEST(TransportArgs, VirtualRanksRefuseSizesDevicesAndMemoryKindsTheyCannotSplit) {
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"virtual ranks: num_ranks must be in [1, 64], got 65", [] { make_virtual_ranks(65, MemoryKind::kHost); }},
        {"virtual ranks: 2 ranks cannot be split evenly over 1 devices (host memory has none)",
         [] { make_virtual_ranks(2, MemoryKind::kHost, 1.0, {0}); }},
        {"virtual ranks: 3 ranks cannot be split evenly over 2 devices",
         [] {
             make_virtual_ranks(3, MemoryKind::kDevice, 1.0, {0, 1});
         }},
        {"virtual ranks: 1 ranks cannot be split evenly over 2 devices",
         [] {
             make_virtual_ranks(1, MemoryKind::kDevice, 1.0, {0, 1});
         }},
        {"virtual ranks: memory kind must be kHost (0) or kDevice (1), got 7",
         [] { make_virtual_ranks(2, static_cast<MemoryKind>(7)); }},
    };
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    const std::vector<std::shared_ptr<Transport>> ranks = make_virtual_ranks(2, MemoryKind::kHost, 1.0);
    ASSERT_EQ(ranks.size(), 2u);
    EXPECT_EQ(ranks[1]->rank(), 1);
    EXPECT_EQ(ranks[1]->num_ranks(), 2);
}

TEST(TransportArgs, AnAllocateMetByAnotherCollectiveNamesThePeerInsteadOfReadingPastItsBlob) {
    // Rank 1 is in a plain all-gather of an empty blob while rank 0 allocates: rank 0 used to copy a region's 24
    // bytes out of that empty blob (reading past it) and report the garbage as the bytes rank 1 asked for.
    LocalHostWorld world(2, 10.0);
    std::vector<Outcome> got(2);
    std::vector<std::string> gathered;
    const std::vector<std::string> errors = testing::run_ranks(2, [&](int rank) {
        const std::shared_ptr<Transport> t = world.transport(rank);
        if (rank == 0) {
            got[0] = outcome_of([&] { t->allocate(4096); });
        } else {
            gathered = t->bootstrap().all_gather("");
        }
        SymmetricRegion region = t->allocate(4096);  // both in step again: the world still works
        got[rank].category = region.peers[1 - rank] != nullptr ? got[rank].category : -2;
        t->release(region);
    });
    EXPECT_EQ(testing::failures(errors), "");
    EXPECT_EQ(got[0].message,
              "allocate: rank 0 asked for 4096 bytes but rank 1 is in another collective (it sent 0 "
              "bytes, not a region's 24)");
    EXPECT_EQ(got[0].category, int(ErrorCategory::kMismatch));
    EXPECT_EQ(got[1].category, -1);  // no error, and the peer's region mapped
    ASSERT_EQ(gathered.size(), 2u);
    EXPECT_EQ(gathered[0].size(), 24u);
    EXPECT_EQ(gathered[1], "");
}

}  // namespace
}  // namespace flatep
