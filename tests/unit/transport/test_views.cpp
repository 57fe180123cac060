// Transport::allocate_local / map_view on host memory, through both transports (local: rank threads; ipc: forked
// processes): a view of [local memory, this rank's region, a gap, the next rank's region] reads and writes through
// to the right memory, peers see what a rank wrote through its view, the memory outlives its owner's release while
// a view maps it, the gap stays inaccessible, and bad requests give one-line errors naming the piece.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "flatep/error.hpp"
#include "flatep/ipc.hpp"
#include "transport/host_memory.hpp"
#include "transport/ipc_transport.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"
#include "unit/transport/test_ipc_util.hpp"

namespace flatep {
namespace {

using transport::IpcTransport;
using transport::LocalHostWorld;
namespace host_memory = transport::host_memory;

using test::count_mappings;
using test::count_open_fds;
using testing::error_message;
using testing::failures;
using testing::run_ranks;

// Returns the first failed check's text from the enclosing function (children of run_forked and threads alike).
#define VIEW_CHECK(cond, ...)                                                                        \
    do {                                                                                             \
        if (!(cond)) return detail::concat(__FILE__, ":", __LINE__, ": ", #cond, ": ", __VA_ARGS__); \
    } while (0)

uint32_t word_of(int rank, int place, size_t i) { return uint32_t(rank * 0x01000193u + place * 0x9e3779b9u + i); }

// Permissions ("rw-p", "---p") of the /proc/self/maps line that starts at `address`; "" when none does.
std::string permissions_at(const void* address) {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    const uintptr_t want = reinterpret_cast<uintptr_t>(address);
    while (std::getline(maps, line)) {
        unsigned long start = 0, end = 0;
        char perms[8] = {};
        if (std::sscanf(line.c_str(), "%lx-%lx %7s", &start, &end, perms) == 3 && start == want) return perms;
    }
    return "";
}

// Collective over t's ranks. View of rank r: [local memory | r's region | one granularity unmapped | (r+1)'s region].
std::string check_view_pieces(Transport& t) {
    const int rank = t.rank(), R = t.num_ranks(), next = (rank + 1) % R;
    const size_t g = t.granularity();
    VIEW_CHECK(g == host_memory::page_size(), "granularity ", g);
    SymmetricRegion region = t.allocate(3 * g - 100);  // mapped: 3 pages
    LocalMemory local = t.allocate_local(g + 1);       // mapped: 2 pages
    VIEW_CHECK(local.bytes == 2 * g && local.ptr != nullptr && local.id >= 0, "local ", local.bytes, " ", local.id);
    VIEW_CHECK(region.mapped_bytes == 3 * g, "region ", region.mapped_bytes);
    for (size_t i = 0; i < local.bytes; ++i) VIEW_CHECK(local.ptr[i] == 0, "local byte ", i, " not zero");
    const size_t own_at = local.bytes, peer_at = own_at + region.mapped_bytes + g,
                 total = peer_at + region.mapped_bytes;
    ViewPiece piece_local, piece_own, piece_peer;
    piece_local.local_id = local.id;
    piece_own.region_id = region.id;
    piece_own.rank = rank;
    piece_own.offset = own_at;
    piece_peer.region_id = region.id;
    piece_peer.rank = next;
    piece_peer.offset = peer_at;
    // Pieces in any order: the view places each at its offset.
    MappedView view = t.map_view(total, {piece_peer, piece_local, piece_own});
    VIEW_CHECK(view.base != nullptr && view.bytes == total && view.id >= 0, "view ", view.bytes);
    VIEW_CHECK(permissions_at(view.base + own_at + region.mapped_bytes) == "---p", "the gap is ",
               permissions_at(view.base + own_at + region.mapped_bytes));

    // Writes through the originals show in the view, and writes through the view in the originals.
    auto* local_words = reinterpret_cast<uint32_t*>(local.ptr);
    auto* own_words = reinterpret_cast<uint32_t*>(region.local);
    const size_t local_n = local.bytes / 4, region_n = region.mapped_bytes / 4;
    for (size_t i = 0; i < local_n; ++i) local_words[i] = word_of(rank, 0, i);
    for (size_t i = 0; i < region_n / 2; ++i) own_words[i] = word_of(rank, 1, i);  // first half: this rank's
    t.bootstrap().all_gather("written");
    const auto* v = reinterpret_cast<uint32_t*>(view.base);
    for (size_t i = 0; i < local_n; ++i) VIEW_CHECK(v[i] == word_of(rank, 0, i), "local word ", i);
    for (size_t i = 0; i < region_n / 2; ++i) {
        VIEW_CHECK(v[own_at / 4 + i] == word_of(rank, 1, i), "own region word ", i);
        VIEW_CHECK(v[peer_at / 4 + i] == word_of(next, 1, i), "rank ", next, "'s region word ", i);
    }
    auto* vw = reinterpret_cast<uint32_t*>(view.base);
    for (size_t i = 0; i < local_n; ++i) vw[i] = word_of(rank, 2, i);
    for (size_t i = region_n / 2; i < region_n; ++i) vw[peer_at / 4 + i] = word_of(rank, 3, i);  // second half: peer's
    t.bootstrap().all_gather("written through views");
    for (size_t i = 0; i < local_n; ++i) VIEW_CHECK(local_words[i] == word_of(rank, 2, i), "local word ", i);
    const int prev = (rank + R - 1) % R;  // wrote the second half of this rank's region through its view
    for (size_t i = region_n / 2; i < region_n; ++i)
        VIEW_CHECK(own_words[i] == word_of(prev, 3, i), "word ", i, " rank ", prev, " wrote through its view");
    t.bootstrap().all_gather("read");

    // The owners release; the view keeps the memory.
    t.release_local(local);
    VIEW_CHECK(local.ptr == nullptr && local.id == -1, "release_local did not clear the LocalMemory");
    t.release_local(local);  // a second release is a no-op
    t.release(region);
    t.bootstrap().all_gather("released");  // every rank's region is released everywhere
    for (size_t i = 0; i < local_n; ++i) VIEW_CHECK(v[i] == word_of(rank, 2, i), "local word ", i, " after release");
    for (size_t i = 0; i < region_n / 2; ++i)
        VIEW_CHECK(v[peer_at / 4 + i] == word_of(next, 1, i), "peer word ", i, " after release");
    vw[own_at / 4 + region_n - 1] = 7;  // still writable (a word no peer reads any more)
    VIEW_CHECK(v[own_at / 4 + region_n - 1] == 7, "own region not writable after release");
    t.unmap_view(view);
    VIEW_CHECK(view.base == nullptr && view.id == -1, "unmap_view did not clear the MappedView");
    t.unmap_view(view);  // a second unmap is a no-op
    return "";
}

TEST(TransportViews, LocalTransportViewsReadAndWriteThroughToLocalOwnAndPeerMemory) {
    const int R = 3;
    LocalHostWorld world(R, 10.0);
    std::vector<std::string> results(R);
    const auto errors = run_ranks(R, [&](int rank) { results[rank] = check_view_pieces(*world.transport(rank)); });
    EXPECT_EQ(failures(errors), "");
    for (int r = 0; r < R; ++r) EXPECT_EQ(results[r], "") << "rank " << r;
}

TEST(TransportViews, IpcTransportViewsReadAndWriteThroughToLocalOwnAndPeerMemory) {
    const std::vector<int> codes = run_forked(3, [](int, std::shared_ptr<Bootstrap> boot) {
        std::unique_ptr<Transport> t = make_ipc_transport(boot, MemoryKind::kHost, 10.0);
        const std::string failure = check_view_pieces(*t);
        if (!failure.empty()) std::fprintf(stderr, "%s\n", failure.c_str());
        return failure.empty() ? 0 : 1;
    });
    EXPECT_EQ(codes, std::vector<int>(3, 0));
}

// Every bad request on a one-rank transport, with its exact message; none of them leaves a view behind.
std::string check_bad_views(Transport& t, int* live_views_after) {
    const size_t g = t.granularity();
    SymmetricRegion region = t.allocate(g);
    LocalMemory local = t.allocate_local(g);
    LocalMemory released = t.allocate_local(g);
    const int released_id = released.id;
    t.release_local(released);
    auto region_piece = [&](int rank, size_t offset) {
        ViewPiece p;
        p.region_id = region.id;
        p.rank = rank;
        p.offset = offset;
        return p;
    };
    auto local_piece = [&](int id, size_t offset) {
        ViewPiece p;
        p.local_id = id;
        p.offset = offset;
        return p;
    };
    ViewPiece both = region_piece(0, 0), neither;
    both.local_id = local.id;
    const std::string G = std::to_string(g);
    const std::vector<std::pair<std::string, std::function<void()>>> cases = {
        {"map_view: bytes must be a positive multiple of the granularity (" + G + "), got " + std::to_string(g + 8),
         [&] { t.map_view(g + 8, {local_piece(local.id, 0)}); }},
        {"map_view: bytes must be a positive multiple of the granularity (" + G + "), got 0",
         [&] { t.map_view(0, {local_piece(local.id, 0)}); }},
        {"map_view: pieces is empty; a view maps at least one piece", [&] { t.map_view(g, {}); }},
        {"map_view: piece 1 must name exactly one of region_id and local_id, got region_id " +
             std::to_string(region.id) + " and local_id " + std::to_string(local.id),
         [&] {
             t.map_view(4 * g, {local_piece(local.id, 0), both});
         }},
        {"map_view: piece 0 must name exactly one of region_id and local_id, got region_id -1 and local_id -1",
         [&] { t.map_view(g, {neither}); }},
        {"map_view: piece 0: rank must be in [0, 1), got 1", [&] { t.map_view(g, {region_piece(1, 0)}); }},
        {"map_view: piece 0: rank must be in [0, 1), got -1", [&] { t.map_view(g, {region_piece(-1, 0)}); }},
        {"map_view: piece 0: region_id 999 is not a live region of this transport",
         [&] {
             ViewPiece p = region_piece(0, 0);
             p.region_id = 999;
             t.map_view(g, {p});
         }},
        {"map_view: piece 0: local_id " + std::to_string(released_id) + " is not live local memory of this transport",
         [&] { t.map_view(g, {local_piece(released_id, 0)}); }},
        {"map_view: piece 1: offset must be a multiple of the granularity (" + G + "), got " + std::to_string(g + 64),
         [&] {
             t.map_view(4 * g, {local_piece(local.id, 0), region_piece(0, g + 64)});
         }},
        {"map_view: piece 1 (" + G + " bytes at offset " + std::to_string(2 * g) + ") ends past the view's " +
             std::to_string(2 * g) + " bytes",
         [&] {
             t.map_view(2 * g, {local_piece(local.id, 0), region_piece(0, 2 * g)});
         }},
        {"map_view: piece 0 (" + G + " bytes at offset " + std::to_string(3 * g) + ") ends past the view's " +
             std::to_string(2 * g) + " bytes",
         [&] { t.map_view(2 * g, {local_piece(local.id, 3 * g)}); }},
        {"map_view: piece 1 (" + G + " bytes at offset " + G + ") overlaps piece 0 (" + G + " bytes at offset " + G +
             ")",
         [&] {
             t.map_view(2 * g, {region_piece(0, g), local_piece(local.id, g)});
         }},
        {"allocate_local: bytes must be in [1, " + std::to_string(SIZE_MAX - g) + "], got 0",
         [&] { t.allocate_local(0); }},
    };
    for (const auto& [want, call] : cases) {
        const std::string got = error_message(call);
        VIEW_CHECK(got == want, "got '", got, "', expected '", want, "'");
    }
    // The same pieces without the mistakes map.
    MappedView view = t.map_view(2 * g, {region_piece(0, g), local_piece(local.id, 0)});
    VIEW_CHECK(view.base != nullptr, "the good view did not map");
    t.unmap_view(view);
    if (auto* ipc = dynamic_cast<IpcTransport*>(&t)) *live_views_after = ipc->num_live_views();
    t.release_local(local);
    t.release(region);
    return "";
}

class SoloBootstrap final : public Bootstrap {
  public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    std::vector<std::string> all_gather(const std::string& blob) override { return {blob}; }
};

TEST(TransportViews, BadRequestsGiveOneLineErrorsOnBothTransports) {
    LocalHostWorld world(1, 10.0);
    int live = -1;
    EXPECT_EQ(check_bad_views(*world.transport(0), &live), "");
    std::unique_ptr<Transport> ipc = make_ipc_transport(std::make_shared<SoloBootstrap>(), MemoryKind::kHost, 10.0);
    EXPECT_EQ(check_bad_views(*ipc, &live), "");
    EXPECT_EQ(live, 0) << "a refused map_view left a view behind";
    EXPECT_EQ(static_cast<IpcTransport&>(*ipc).num_live_locals(), 0);
}

TEST(TransportViews, HostTransportsHaveNoDeviceToBind) {
    LocalHostWorld world(1, 10.0);
    const std::shared_ptr<Transport> local = world.transport(0);
    std::unique_ptr<Transport> ipc = make_ipc_transport(std::make_shared<SoloBootstrap>(), MemoryKind::kHost, 10.0);
    for (Transport* t : {local.get(), ipc.get()}) {
        EXPECT_EQ(t->device(), -1) << t->name();
        EXPECT_EQ(t->bind_device(), nullptr) << t->name();
        EXPECT_EQ(t->granularity(), host_memory::page_size()) << t->name();
    }
}

TEST(TransportViews, LocalMemoryAndViewCyclesLeakNoDescriptorsOrMappings) {
    LocalHostWorld world(1, 10.0);
    std::shared_ptr<Transport> t = world.transport(0);
    const size_t g = t->granularity();
    SymmetricRegion region = t->allocate(g);
    auto cycle = [&] {
        LocalMemory local = t->allocate_local(5 * g);
        ViewPiece a, b;
        a.local_id = local.id;
        b.region_id = region.id;
        b.offset = local.bytes;
        MappedView view = t->map_view(local.bytes + region.mapped_bytes, {a, b});
        t->unmap_view(view);
        t->release_local(local);
    };
    cycle();
    const int fds = count_open_fds(), mappings = count_mappings("");
    for (int i = 0; i < 50; ++i) cycle();
    EXPECT_EQ(count_open_fds(), fds);
    EXPECT_EQ(count_mappings(""), mappings);
    t->release(region);
}

}  // namespace
}  // namespace flatep
