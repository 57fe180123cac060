// The ipc transport's allocate round against a fake rank 1: a thread of this process that joins the mesh with
// ipc::build_mesh and answers each allocate with a message the test writes (a wrong size, another allocation's
// sizes, no descriptor, a too short memfd), then a good one. Each bad answer gives one exact error and leaves the
// transport working; release refuses a region that is not its own.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flatep/error.hpp"
#include "transport/host_memory.hpp"
#include "transport/ipc_socket.hpp"
#include "transport/ipc_transport.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

namespace ipc = transport::ipc;
namespace host_memory = transport::host_memory;
using testing::Outcome;
using testing::outcome_of;

// The announcement of ipc_transport.cpp: the nonce of rank 0 names the job's sockets.
constexpr size_t kNonceOffset = 16;
constexpr size_t kNonceChars = 32;
struct AllocateMessage {
    uint64_t bytes;
    uint64_t mapped_bytes;
};

// Rank 0's bootstrap: rank 1 announces what rank 0 did (same pid and kind); at the barrier the fake rank 1 starts
// joining the mesh.
class FakeWorldBootstrap final : public Bootstrap {
  public:
    explicit FakeWorldBootstrap(std::function<void(const std::string& nonce)> at_barrier)
        : at_barrier_(std::move(at_barrier)) {}
    int rank() const override { return 0; }
    int size() const override { return 2; }
    std::vector<std::string> all_gather(const std::string& blob) override {
        if (blob.empty()) {
            at_barrier_(nonce_);
            return {blob, blob};
        }
        nonce_ = blob.substr(kNonceOffset, kNonceChars);
        return {blob, blob};
    }

  private:
    std::function<void(const std::string&)> at_barrier_;
    std::string nonce_;
};

// One scripted answer of rank 1 to allocate #id.
struct Answer {
    std::string payload;
    int fd = -1;
};

TEST(IpcTransportFaults, BadAllocateRepliesAreRefusedAndTheTransportGoesOn) {
    const size_t page = host_memory::page_size();
    const pid_t me = getpid();
    const std::string peer = "rank 1 (pid " + std::to_string(me) + ")";
    auto message = [](uint64_t bytes, uint64_t mapped) {
        const AllocateMessage m{bytes, mapped};
        return std::string(reinterpret_cast<const char*>(&m), sizeof(m));
    };
    const int short_fd = host_memory::create(page, "short");
    const int good_fd = host_memory::create(2 * page, "good");
    const std::vector<Answer> answers = {
        {"abc", good_fd},
        {message(3 * page, 3 * page), good_fd},
        {message(2 * page, 3 * page), good_fd},
        {message(2 * page, 2 * page), -1},
        {message(2 * page, 2 * page), short_fd},
        {message(2 * page, 2 * page), good_fd},
    };

    std::thread fake;
    std::promise<void> done;
    auto start_fake = [&](const std::string& nonce) {
        fake = std::thread([&, nonce] {
            try {
                ipc::MeshSpec spec;
                spec.name_prefix = "flatep-" + nonce;
                spec.token = spec.name_prefix;
                spec.rank = 1;
                spec.size = 2;
                spec.expected_pids = {me, me};
                spec.timeout_s = 10;
                spec.what = "fake rank 1";
                ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, 1), 4);
                std::vector<ipc::Fd> sockets = ipc::build_mesh(spec, listener.get(), nullptr);
                const std::vector<int> raw = {sockets[0].get(), -1};
                for (size_t i = 0; i < answers.size(); ++i) {
                    std::vector<ipc::Message> out(2);
                    out[0] = ipc::Message{answers[i].payload, answers[i].fd};
                    const auto in = ipc::exchange(raw, 1, out, uint32_t(i + 1), 10, "fake allocate",
                                                  [](int p) { return "rank " + std::to_string(p); });
                    ipc::close_quietly(in[0].fd);
                }
                done.set_value();
            } catch (...) {
                done.set_exception(std::current_exception());
            }
        });
    };
    {
        transport::IpcOptions options;
        options.timeout_s = 10;
        options.same_process = true;
        transport::IpcTransport t(std::make_shared<FakeWorldBootstrap>(start_fake), transport::make_host_ipc_memory(),
                                  options);
        const std::vector<std::pair<std::string, int>> wants = {
            {"ipc allocate #1: " + peer + " sent a malformed message", int(ErrorCategory::kRuntime)},
            {"ipc allocate #2: " + peer + " allocates " + std::to_string(3 * page) + " bytes (mapped " +
                 std::to_string(3 * page) + "), rank 0 allocates " + std::to_string(2 * page) + " (mapped " +
                 std::to_string(2 * page) + ")",
             int(ErrorCategory::kMismatch)},
            {"ipc allocate #3: " + peer + " allocates " + std::to_string(2 * page) + " bytes (mapped " +
                 std::to_string(3 * page) + "), rank 0 allocates " + std::to_string(2 * page) + " (mapped " +
                 std::to_string(2 * page) + ")",
             int(ErrorCategory::kMismatch)},
            {"ipc allocate #4: " + peer + " sent no descriptor", int(ErrorCategory::kRuntime)},
            {"ipc: a peer's memfd holds " + std::to_string(page) + " bytes, expected " + std::to_string(2 * page),
             int(ErrorCategory::kRuntime)},
        };
        for (const auto& [want, category] : wants) {
            const Outcome o = outcome_of([&] { t.allocate(2 * page); });
            EXPECT_EQ(o.message, want);
            EXPECT_EQ(o.category, category) << want;
        }
        // The sixth answer is right: rank 1's memory is mapped here.
        SymmetricRegion region = t.allocate(2 * page);
        EXPECT_EQ(region.id, 6);
        ASSERT_NE(region.peers[1], nullptr);
        ASSERT_NE(region.local, nullptr);
        done.get_future().get();
        fake.join();

        // A region of another id, one with the live id but another address, one with no id but an address: each
        // is refused with a warning; an empty one is ignored.
        SymmetricRegion stranger = region, moved = region, no_id = region, empty;
        stranger.id = 99;
        moved.local += page;
        no_id.id = -1;
        ::testing::internal::CaptureStderr();
        t.release(stranger);
        t.release(moved);
        t.release(no_id);
        t.release(empty);
        auto warning = [](int id) {
            return "[flatep warning] ipc release: region id " + std::to_string(id) +
                   " is not a live region of this transport (rank 0); ignored\n";
        };
        EXPECT_EQ(::testing::internal::GetCapturedStderr(), warning(99) + warning(6) + warning(-1));
        EXPECT_EQ(stranger.id, 99);
        // The live region is freed by the transport's destructor.
    }
    host_memory::close_fd(short_fd);
    host_memory::close_fd(good_fd);
}

}  // namespace
}  // namespace flatep
