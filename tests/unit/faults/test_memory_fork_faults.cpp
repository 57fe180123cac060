// The failure paths of host memory (memfd, mmap, munmap, close, fcntl), of the ipc memory on top of it, of
// run_forked's set-up and reaping, and of the ipc transport's announcement round: each system call made to fail
// (with an argument the kernel refuses, or injected with fault_injection.hpp) gives one exact error.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flatep/error.hpp"
#include "flatep/ipc.hpp"
#include "transport/host_memory.hpp"
#include "transport/ipc_memory.hpp"
#include "transport/ipc_transport.hpp"
#include "unit/faults/fault_injection.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

namespace host_memory = transport::host_memory;
using testing::Outcome;
using testing::outcome_of;
using testing::faults::Armed;
using testing::faults::Call;
using testing::faults::errno_text;
using testing::faults::Fault;

constexpr int kRuntime = int(ErrorCategory::kRuntime);
constexpr int kMismatch = int(ErrorCategory::kMismatch);

std::string pointer_text(const void* p) {
    std::ostringstream s;
    s << p;
    return s.str();
}

TEST(HostMemoryFaults, EveryFailingCallIsNamedWithItsArguments) {
    const size_t page = host_memory::page_size();
    const std::string long_name(300, 'n');  // memfd_create takes at most 249 bytes
    struct Row {
        std::function<void()> call;
        std::string want;
    };
    const std::vector<Row> rows = {
        {[&] { host_memory::create(page, long_name.c_str()); },
         "memfd_create(" + long_name + ") failed: " + errno_text(EINVAL)},
        {[&] { host_memory::map(-1, page); },
         "mmap(fd -1, " + std::to_string(page) + " bytes) failed: " + errno_text(EBADF)},
        {[&] { host_memory::reserve(size_t{1} << 62); },
         "mmap(PROT_NONE reserve of " + std::to_string(size_t{1} << 62) + " bytes) failed: " + errno_text(ENOMEM)},
        {[&] { host_memory::dup_fd(-1); }, "fcntl(F_DUPFD_CLOEXEC of fd -1) failed: " + errno_text(EBADF)},
    };
    for (const Row& row : rows) {
        const Outcome o = outcome_of(row.call);
        EXPECT_EQ(o.message, row.want);
        EXPECT_EQ(o.category, kRuntime) << row.want;
    }
    // MAP_FIXED of a bad descriptor inside a reserved range.
    uint8_t* range = static_cast<uint8_t*>(host_memory::reserve(page));
    const Outcome fixed = outcome_of([&] { host_memory::map_fixed(range, -1, page); });
    EXPECT_EQ(fixed.message, "mmap(MAP_FIXED at " + pointer_text(range) + ", fd -1, " + std::to_string(page) +
                                 " bytes) failed: " + errno_text(EBADF));
    EXPECT_EQ(fixed.category, kRuntime);
    host_memory::unmap(range, page);
}

TEST(HostMemoryFaults, AFailedFtruncateClosesTheMemfdAndNamesIt) {
    const size_t page = host_memory::page_size();
    const int next_fd = ::dup(0);
    ::close(next_fd);
    Armed armed({Fault{Call::kFtruncate, 0, 1, EFBIG}});
    const Outcome o = outcome_of([&] { host_memory::create(page, "ft"); });
    EXPECT_EQ(o.message, "ftruncate(memfd ft, " + std::to_string(page) + " bytes) failed: " + errno_text(EFBIG));
    EXPECT_EQ(o.category, kRuntime);
    EXPECT_EQ(armed.hits(), 1);
    EXPECT_EQ(::fcntl(next_fd, F_GETFD), -1);  // the memfd took the lowest free number and was closed again
}

TEST(HostMemoryFaults, UnmapAndCloseFailuresAreLoggedNotThrown) {
    const size_t page = host_memory::page_size();
    uint8_t* range = static_cast<uint8_t*>(host_memory::reserve(2 * page));
    ::testing::internal::CaptureStderr();
    host_memory::unmap(range + 1, page);  // not page aligned: EINVAL
    host_memory::close_fd(1 << 20);       // no such descriptor: EBADF
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(log, "[flatep warning] munmap(" + pointer_text(range + 1) + ", " + std::to_string(page) +
                       " bytes) failed: " + errno_text(EINVAL) + "\n[flatep warning] close(fd " +
                       std::to_string(1 << 20) + ") failed: " + errno_text(EBADF) + "\n");
    host_memory::unmap(range, 2 * page);
    // No-ops: nothing to unmap or close, nothing logged.
    ::testing::internal::CaptureStderr();
    host_memory::unmap(nullptr, page);
    host_memory::unmap(range, 0);
    host_memory::close_fd(-1);
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST(HostIpcMemoryFaults, APeerFdThatIsBadOrTooShortOrAViewWithoutMemfdIsRefused) {
    auto memory = transport::make_host_ipc_memory();
    const size_t page = host_memory::page_size();
    const Outcome bad = outcome_of([&] { memory->map_peer(-1, page); });
    EXPECT_EQ(bad.message, "fstat(peer memfd) failed: " + errno_text(EBADF));
    EXPECT_EQ(bad.category, kRuntime);
    const int fd = host_memory::create(page, "short");
    const Outcome shorter = outcome_of([&] { memory->map_peer(fd, 2 * page); });
    EXPECT_EQ(shorter.message,
              "ipc: a peer's memfd holds " + std::to_string(page) + " bytes, expected " + std::to_string(2 * page));
    EXPECT_EQ(shorter.category, kRuntime);
    host_memory::close_fd(fd);
    uint8_t* range = memory->reserve(page);
    const Outcome no_fd = outcome_of([&] { memory->map_at(range, transport::IpcMapping{}); });
    EXPECT_EQ(no_fd.message, "host memory view: the memory has no memfd to map");
    EXPECT_EQ(no_fd.category, kRuntime);
    memory->free_range(range, page, {});
}

TEST(ForkFaults, AFailedSocketpairOrForkCleansUpAndNamesTheRanks) {
    const auto fn = [](int, std::shared_ptr<Bootstrap>) { return 0; };
    {
        Armed armed({Fault{Call::kSocketpair, 1, 1, EMFILE}});
        const Outcome o = outcome_of([&] { run_forked(3, fn); });
        EXPECT_EQ(o.message, "run_forked: socketpair for ranks 0 and 2 failed: " + errno_text(EMFILE));
        EXPECT_EQ(o.category, kRuntime);
        EXPECT_EQ(armed.hits(), 1);
    }
    {
        // The first child waits to be killed; the parent reaps it before throwing.
        const auto waits = [](int, std::shared_ptr<Bootstrap>) {
            ::pause();
            return 0;
        };
        Armed armed({Fault{Call::kFork, 1, 1, EAGAIN}});
        const Outcome o = outcome_of([&] { run_forked(2, waits); });
        EXPECT_EQ(o.message, "run_forked: fork of rank 1 failed: " + errno_text(EAGAIN));
        EXPECT_EQ(o.category, kRuntime);
        EXPECT_EQ(armed.hits(), 1);
    }
    EXPECT_EQ(run_forked(2, fn), (std::vector<int>{0, 0}));
}

TEST(ForkFaults, AChildKilledByASignalOrPastTheDeadlineReportsTheSignal) {
    const auto by_signal = [](int rank, std::shared_ptr<Bootstrap>) {
        if (rank == 1) ::raise(SIGTERM);
        return 3;
    };
    EXPECT_EQ(run_forked(2, by_signal), (std::vector<int>{3, 128 + SIGTERM}));
    const auto stalls = [](int rank, std::shared_ptr<Bootstrap>) {
        if (rank == 0) ::pause();
        return 0;
    };
    ForkOptions options;
    options.deadline_s = 0.2;
    ::testing::internal::CaptureStderr();
    const std::vector<int> codes = run_forked(2, stalls, options);
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(codes, (std::vector<int>{128 + SIGKILL, 0}));
    EXPECT_NE(log.find("run_forked: rank 0 (pid "), std::string::npos) << log;
    EXPECT_NE(log.find(") still running after 0.2 s: killing it"), std::string::npos) << log;
}

// A bootstrap that returns given blobs: rank 0 of `size` in a world whose other ranks announce what the test says.
class ScriptedBootstrap final : public Bootstrap {
  public:
    ScriptedBootstrap(int size, std::function<std::vector<std::string>(const std::string&)> answer)
        : size_(size), answer_(std::move(answer)) {}
    int rank() const override { return 0; }
    int size() const override { return size_; }
    std::vector<std::string> all_gather(const std::string& blob) override { return answer_(blob); }

  private:
    int size_;
    std::function<std::vector<std::string>(const std::string&)> answer_;
};

TEST(IpcTransportFaults, MalformedAnnouncementsAreRefused) {
    struct Row {
        std::function<std::vector<std::string>(const std::string&)> answer;
        std::string want;
        int category;
    };
    const auto with_peer = [](std::function<void(std::string&)> spoil) {
        return [spoil](const std::string& mine) {
            std::string peer = mine;
            spoil(peer);
            return std::vector<std::string>{mine, peer};
        };
    };
    const std::vector<Row> rows = {
        {[](const std::string& mine) { return std::vector<std::string>{mine}; },
         "ipc transport: bootstrap returned 1 blobs for 2 ranks", kRuntime},
        {with_peer([](std::string& p) { p.resize(3); }), "ipc transport: rank 1 announced 3 bytes, expected 48",
         kRuntime},
        {with_peer([](std::string& p) { p[0] ^= 1; }), "ipc transport: rank 1 sent a malformed announcement", kRuntime},
        {with_peer([](std::string& p) { p[4] = 1; }),
         "ipc transport: rank 1 uses memory kind 1, rank 0 uses 0 (0 host, 1 device)", kMismatch},
    };
    for (const Row& row : rows) {
        const Outcome o = outcome_of([&] {
            transport::IpcTransport t(std::make_shared<ScriptedBootstrap>(2, row.answer),
                                      transport::make_host_ipc_memory(), transport::IpcOptions{});
        });
        EXPECT_EQ(o.message, row.want);
        EXPECT_EQ(o.category, row.category) << row.want;
    }
}

}  // namespace
}  // namespace flatep
