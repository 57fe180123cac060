// The failure paths of the socket plumbing (src/transport/ipc_socket.cpp): system calls that fail, are interrupted
// or come back short (injected with fault_injection.hpp on the calling thread), and peers that speak the wire
// format wrongly (a fake peer in this process writes the bytes itself). Each test checks the exact outcome.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "flatep/error.hpp"
#include "transport/ipc_socket.hpp"
#include "unit/faults/fault_injection.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

namespace ipc = transport::ipc;
using testing::Outcome;
using testing::outcome_of;
using testing::faults::Armed;
using testing::faults::Call;
using testing::faults::errno_text;
using testing::faults::Fault;

constexpr int kRuntime = int(ErrorCategory::kRuntime);
constexpr int kTimeout = int(ErrorCategory::kTimeout);
constexpr int kMismatch = int(ErrorCategory::kMismatch);

// The wire format of ipc_socket.cpp, written here by hand for the fake peers.
constexpr uint32_t kFrameMagic = 0x46455046u;
constexpr uint32_t kHelloMagic = 0x46455048u;
struct FrameHeader {
    uint32_t magic;
    uint32_t tag;
    uint64_t num_bytes;
};
struct Hello {
    uint32_t magic;
    int32_t rank;
    int32_t size;
    int32_t pid;
    uint32_t uid;
    char token[64];
};

std::string unique_name() {
    static std::atomic<int> counter{0};
    return "faults-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

std::string rank_name(int peer) { return "rank " + std::to_string(peer); }

// A connected nonblocking pair: first is this rank's end, second the fake peer's.
std::pair<ipc::Fd, ipc::Fd> socket_pair() {
    int fds[2] = {-1, -1};
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
    return {ipc::Fd(fds[0]), ipc::Fd(fds[1])};
}

void write_bytes(int fd, const void* data, size_t n) { ASSERT_EQ(::write(fd, data, n), ssize_t(n)); }

void write_frame(int fd, uint32_t magic, uint32_t tag, const std::string& payload, uint64_t claimed = UINT64_MAX) {
    const FrameHeader h{magic, tag, claimed == UINT64_MAX ? payload.size() : claimed};
    write_bytes(fd, &h, sizeof(h));
    if (!payload.empty()) write_bytes(fd, payload.data(), payload.size());
}

// Sends `data` with `fds` attached in one SCM_RIGHTS message.
void send_with_fds(int fd, const void* data, size_t n, const std::vector<int>& fds) {
    iovec iov{const_cast<void*>(data), n};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
    ASSERT_EQ(::sendmsg(fd, &msg, MSG_NOSIGNAL), ssize_t(n));
}

// Reads a whole frame the exchange sent to the fake peer; returns its payload.
std::string read_frame(int fd, uint32_t want_tag) {
    FrameHeader h{};
    std::string bytes;
    char chunk[4096];
    for (;;) {
        const ssize_t n = ::read(fd, chunk, sizeof(chunk));
        if (n > 0) {
            bytes.append(chunk, size_t(n));
            if (bytes.size() >= sizeof(h)) {
                std::memcpy(&h, bytes.data(), sizeof(h));
                if (bytes.size() == sizeof(h) + h.num_bytes) break;
            }
            continue;
        }
        if (n < 0 && errno == EAGAIN) {
            pollfd p{fd, POLLIN, 0};
            ::poll(&p, 1, 1000);
            continue;
        }
        ADD_FAILURE() << "the fake peer's socket closed";
        return {};
    }
    EXPECT_EQ(h.magic, kFrameMagic);
    EXPECT_EQ(h.tag, want_tag);
    return bytes.substr(sizeof(h));
}

// exchange between this rank (0) and one fake peer (1) under tag 7.
std::vector<ipc::Message> exchange_with(int fd, const std::string& payload, double timeout_s = 5.0) {
    return ipc::exchange({-1, fd}, 0, {ipc::Message{}, ipc::Message{payload, -1}}, 7, timeout_s, "all_gather #1",
                         rank_name);
}

// ----- the small wrappers -------------------------------------------------------------------------------------

TEST(SocketFaults, InjectedFaultsReachTheLibraryAndSocketFailureNamesTheCall) {
    Armed armed({Fault{Call::kSocket, 0, 1, EMFILE}});
    const Outcome o = outcome_of([] { ipc::listen_abstract(unique_name(), 4); });
    EXPECT_EQ(o.message, "socket(AF_UNIX) failed: " + errno_text(EMFILE));
    EXPECT_EQ(o.category, kRuntime);
    EXPECT_EQ(armed.hits(), 1);
    // Spent: the next listener comes up.
    EXPECT_TRUE(ipc::listen_abstract(unique_name(), 4).valid());
    EXPECT_EQ(armed.hits(), 1);
}

TEST(SocketFaults, BindAndListenFailuresNameTheCallAndATakenNameSaysSo) {
    const std::string name = unique_name();
    {
        Armed armed({Fault{Call::kBind, 0, 1, EACCES}});
        const Outcome o = outcome_of([&] { ipc::listen_abstract(name, 4); });
        EXPECT_EQ(o.message, "bind('@" + name + "') failed: " + errno_text(EACCES));
        EXPECT_EQ(o.category, kRuntime);
        EXPECT_EQ(armed.hits(), 1);
    }
    {
        Armed armed({Fault{Call::kListen, 0, 1, EADDRINUSE}});
        const Outcome o = outcome_of([&] { ipc::listen_abstract(name, 4); });
        EXPECT_EQ(o.message, "listen failed: " + errno_text(EADDRINUSE));
        EXPECT_EQ(o.category, kRuntime);
        EXPECT_EQ(armed.hits(), 1);
    }
    // The failed attempts released the name: it binds now, and a second bind of it is refused.
    ipc::Fd held = ipc::listen_abstract(name, 4);
    ASSERT_TRUE(held.valid());
    const Outcome o = outcome_of([&] { ipc::listen_abstract(name, 4); });
    EXPECT_EQ(o.message, "socket name '@" + name + "' is already in use: another job with the same id is running");
    EXPECT_EQ(o.category, kRuntime);
}

TEST(SocketFaults, GetrandomRetriesAnInterruptionAndShortReadsAndNamesAFailure) {
    {
        Armed armed({Fault{Call::kGetrandom, 0, 1, EINTR}, Fault{Call::kGetrandom, 0, 2, 0, 3}});
        const std::string hex = ipc::random_hex(8);
        EXPECT_EQ(hex.size(), 16u);
        EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos);
        EXPECT_EQ(armed.hits(0), 1);
        EXPECT_EQ(armed.hits(1), 2);  // 3 + 3 + 2 bytes
    }
    Armed armed({Fault{Call::kGetrandom, 0, 1, ENOSYS}});
    const Outcome o = outcome_of([] { ipc::random_hex(8); });
    EXPECT_EQ(o.message, "getrandom failed: " + errno_text(ENOSYS));
    EXPECT_EQ(o.category, kRuntime);
    EXPECT_EQ(armed.hits(), 1);
}

TEST(SocketFaults, PeerCredentialsFailureNamesTheCall) {
    auto [a, b] = socket_pair();
    EXPECT_EQ(ipc::peer_credentials(a.get()).pid, getpid());
    Armed armed({Fault{Call::kGetsockopt, 0, 1, ENOTSOCK}});
    const Outcome o = outcome_of([&] { ipc::peer_credentials(a.get()); });
    EXPECT_EQ(o.message, "getsockopt(SO_PEERCRED) failed: " + errno_text(ENOTSOCK));
    EXPECT_EQ(o.category, kRuntime);
    EXPECT_EQ(armed.hits(), 1);
}

TEST(SocketFaults, CloseFailureIsLoggedExceptEintrAndTheDescriptorIsGone) {
    auto [a, b] = socket_pair();
    const int fd_a = a.release(), fd_b = b.release();
    ::testing::internal::CaptureStderr();
    {
        Armed armed({Fault{Call::kClose, 0, 1, EIO, 0, true}, Fault{Call::kClose, 0, 1, EINTR, 0, true}});
        ipc::close_quietly(fd_a);
        ipc::close_quietly(fd_b);
        EXPECT_EQ(armed.hits(0), 1);
        EXPECT_EQ(armed.hits(1), 1);
    }
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(log, "[flatep warning] close(" + std::to_string(fd_a) + ") failed: " + errno_text(EIO) + "\n");
    EXPECT_EQ(::fcntl(fd_a, F_GETFD), -1);
    EXPECT_EQ(::fcntl(fd_b, F_GETFD), -1);
}

TEST(SocketFaults, FdMoveAssignedToItselfKeepsItsDescriptor) {
    auto [a, b] = socket_pair();
    const int fd = a.get();
    ipc::Fd& same = a;
    a = std::move(same);
    EXPECT_EQ(a.get(), fd);
    EXPECT_EQ(::fcntl(fd, F_GETFD) >= 0, true);
}

// ----- exchange ------------------------------------------------------------------------------------------------

TEST(ExchangeFaults, InterruptedAndWouldBlockCallsAreRetriedAndTheResultIsExact) {
    auto [a, b] = socket_pair();
    write_frame(b.get(), kFrameMagic, 7, "from rank 1");
    Armed armed({Fault{Call::kPoll, 0, 1, EINTR}, Fault{Call::kSendmsg, 0, 1, EINTR},
                 Fault{Call::kSendmsg, 0, 1, EAGAIN}, Fault{Call::kRecvmsg, 0, 1, EINTR},
                 Fault{Call::kRecvmsg, 0, 1, EAGAIN}});
    const std::vector<ipc::Message> in = exchange_with(a.get(), "from rank 0");
    ASSERT_EQ(in.size(), 2u);
    EXPECT_EQ(in[1].payload, "from rank 1");
    EXPECT_EQ(in[1].fd, -1);
    EXPECT_EQ(read_frame(b.get(), 7), "from rank 0");
    for (size_t i = 0; i < 5; ++i) EXPECT_EQ(armed.hits(i), 1) << i;
}

TEST(ExchangeFaults, ShortSendsAndReceivesComplete) {
    auto [a, b] = socket_pair();
    std::string mine(1000, '\0'), theirs(777, '\0');
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = char(i * 7);
    for (size_t i = 0; i < theirs.size(); ++i) theirs[i] = char(i * 13 + 1);
    write_frame(b.get(), kFrameMagic, 7, theirs);
    Armed armed({Fault{Call::kSendmsg, 0, -1, 0, 5}, Fault{Call::kRecvmsg, 0, -1, 0, 3}});
    const std::vector<ipc::Message> in = exchange_with(a.get(), mine);
    EXPECT_EQ(in[1].payload, theirs);
    EXPECT_EQ(read_frame(b.get(), 7), mine);
    EXPECT_EQ(armed.hits(0), int((16 + 1000 + 4) / 5));
    EXPECT_GE(armed.hits(1), int((16 + 777) / 3));
}

TEST(ExchangeFaults, PollFailureNamesTheCall) {
    auto [a, b] = socket_pair();
    Armed armed({Fault{Call::kPoll, 0, 1, ENOMEM}});
    const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
    EXPECT_EQ(o.message, "poll failed: " + errno_text(ENOMEM));
    EXPECT_EQ(o.category, kRuntime);
    EXPECT_EQ(armed.hits(), 1);
}

TEST(ExchangeFaults, AFailedReceiveIsAPeerThatLeft) {
    auto [a, b] = socket_pair();
    write_frame(b.get(), kFrameMagic, 7, "from rank 1");
    Armed armed({Fault{Call::kRecvmsg, 0, 1, ECONNRESET}});
    const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
    EXPECT_EQ(o.message, "all_gather #1: rank 1 left the job (connection closed) without arriving");
    EXPECT_EQ(o.category, kTimeout);
    EXPECT_EQ(armed.hits(), 1);
}

TEST(ExchangeFaults, AFailedSendStillReturnsWhatThePeerDelivered) {
    // A send that fails (the peer closed its read side) is the peer's loss, reported on its side; this rank has
    // every message and returns them.
    auto [a, b] = socket_pair();
    write_frame(b.get(), kFrameMagic, 7, "from rank 1");
    Armed armed({Fault{Call::kSendmsg, 0, 1, EPIPE}});
    const std::vector<ipc::Message> in = exchange_with(a.get(), "x");
    EXPECT_EQ(in[1].payload, "from rank 1");
    EXPECT_EQ(armed.hits(), 1);
}

TEST(ExchangeFaults, AHangUpAfterOneDirectionFinishedEndsOnlyTheOther) {
    {  // the peer's frame came, then it hung up before taking ours: this rank still returns what it got
        auto [a, b] = socket_pair();
        write_frame(b.get(), kFrameMagic, 7, "from rank 1");
        b.reset();
        Armed armed({Fault{Call::kSendmsg, 0, 1, EAGAIN}});
        const std::vector<ipc::Message> in = exchange_with(a.get(), "x");
        EXPECT_EQ(in[1].payload, "from rank 1");
        EXPECT_EQ(armed.hits(), 1);
    }
    {  // the send failed first, then the peer hung up without a frame: it left
        auto [a, b] = socket_pair();
        b.reset();
        Armed armed({Fault{Call::kSendmsg, 0, 1, EPIPE}, Fault{Call::kRecvmsg, 0, 1, EAGAIN}});
        const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
        EXPECT_EQ(o.message, "all_gather #1: rank 1 left the job (connection closed) without arriving");
        EXPECT_EQ(o.category, kTimeout);
        EXPECT_EQ(armed.hits(0), 1);
        EXPECT_EQ(armed.hits(1), 1);
    }
    {  // this rank's frame went out, then the peer hung up before sending one
        auto [a, b] = socket_pair();
        Armed armed({Fault{Call::kRecvmsg, 0, 1, EAGAIN}});
        std::thread closer;
        const Outcome o = outcome_of([&] {
            // The hang-up comes after the first poll round: the frame is read by the fake first, then it closes.
            closer = std::thread([&b = b] {
                read_frame(b.get(), 7);
                b.reset();
            });
            exchange_with(a.get(), "x");
        });
        closer.join();
        EXPECT_EQ(o.message, "all_gather #1: rank 1 left the job (connection closed) without arriving");
        EXPECT_EQ(armed.hits(), 1);
    }
}

TEST(ExchangeFaults, MalformedFramesAreAMismatchNamingThePeer) {
    struct Row {
        uint32_t magic;
        uint32_t tag;
        uint64_t claimed;
        std::string want;
        int category;
    };
    const std::vector<Row> rows = {
        {0x12345678u, 7, 0, "all_gather #1: rank 1 sent a malformed message (this rank is in #7)", kMismatch},
        {kFrameMagic, 7, (uint64_t{1} << 32) + 1, "all_gather #1: rank 1 sent a malformed message (this rank is in #7)",
         kMismatch},
        {kFrameMagic, 9, 0, "all_gather #1: rank 1 is in collective #9 (this rank is in #7)", kMismatch},
    };
    for (const Row& row : rows) {
        auto [a, b] = socket_pair();
        write_frame(b.get(), row.magic, row.tag, "", row.claimed);
        const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
        EXPECT_EQ(o.message, row.want);
        EXPECT_EQ(o.category, row.category);
    }
}

TEST(ExchangeFaults, APeerClosingMidFrameLeftAndASilentOneTimesOut) {
    {
        auto [a, b] = socket_pair();
        const FrameHeader h{kFrameMagic, 7, 100};
        write_bytes(b.get(), &h, sizeof(h));
        write_bytes(b.get(), "partial", 7);
        b.reset();
        const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
        EXPECT_EQ(o.message, "all_gather #1: rank 1 left the job (connection closed) without arriving");
        EXPECT_EQ(o.category, kTimeout);
    }
    // Peer 1 left, peers 2 and 4 are in other collectives, peers 3 and 5 say nothing: one message names them all.
    std::vector<std::pair<ipc::Fd, ipc::Fd>> pairs;
    for (int p = 0; p < 6; ++p) pairs.push_back(socket_pair());
    pairs[1].second.reset();
    write_frame(pairs[2].second.get(), kFrameMagic, 9, "");
    write_frame(pairs[4].second.get(), kFrameMagic, 8, "");
    std::vector<int> sockets = {-1};
    for (int p = 1; p < 6; ++p) sockets.push_back(pairs[size_t(p)].first.get());
    std::vector<ipc::Message> out(6);
    const Outcome o = outcome_of([&] { ipc::exchange(sockets, 0, out, 7, 0.05, "all_gather #1", rank_name); });
    EXPECT_EQ(o.message,
              "all_gather #1: rank 3, rank 5 did not arrive within 0.05 s; rank 1 left the job (connection closed) "
              "without arriving; rank 2 is in collective #9, rank 4 is in collective #8 (this rank is in #7)");
    EXPECT_EQ(o.category, kTimeout);
}

TEST(ExchangeFaults, APeerThatDeliversButStopsReadingTimesOut) {
    auto [a, b] = socket_pair();
    write_frame(b.get(), kFrameMagic, 7, "from rank 1");
    const std::string big(8 << 20, 'b');  // more than the socket buffers hold
    const Outcome o = outcome_of([&] { exchange_with(a.get(), big, 0.05); });
    EXPECT_EQ(o.message, "all_gather #1: rank 1 did not arrive within 0.05 s");
    EXPECT_EQ(o.category, kTimeout);
}

TEST(ExchangeFaults, ADescriptorAfterTheFirstChunkOrTooManyDescriptorsAreMalformed) {
    int extra[2] = {-1, -1};
    ASSERT_EQ(::pipe(extra), 0);
    {
        auto [a, b] = socket_pair();
        const FrameHeader h{kFrameMagic, 7, 4};
        send_with_fds(b.get(), &h, sizeof(h), {extra[0]});
        send_with_fds(b.get(), "abcd", 4, {extra[1]});
        const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
        EXPECT_EQ(o.message, "all_gather #1: rank 1 sent a malformed message (this rank is in #7)");
        EXPECT_EQ(o.category, kMismatch);
    }
    {
        auto [a, b] = socket_pair();
        const FrameHeader h{kFrameMagic, 7, 0};
        send_with_fds(b.get(), &h, sizeof(h), {extra[0], extra[1], extra[0], extra[1], extra[0], extra[1]});
        const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
        EXPECT_EQ(o.message, "all_gather #1: rank 1 sent a malformed message (this rank is in #7)");
        EXPECT_EQ(o.category, kMismatch);
    }
    {  // the descriptor comes with the payload, not with the header
        auto [a, b] = socket_pair();
        const FrameHeader h{kFrameMagic, 7, 4};
        write_bytes(b.get(), &h, sizeof(h));
        send_with_fds(b.get(), "abcd", 4, {extra[0]});
        const Outcome o = outcome_of([&] { exchange_with(a.get(), "x"); });
        EXPECT_EQ(o.message, "all_gather #1: rank 1 sent a malformed message (this rank is in #7)");
        EXPECT_EQ(o.category, kMismatch);
    }
    ::close(extra[0]);
    ::close(extra[1]);
}

TEST(ExchangeFaults, ControlMessagesOtherThanDescriptorsAreSkipped) {
    // With SO_PASSCRED every message comes with the sender's credentials (SCM_CREDENTIALS): not a descriptor.
    auto [a, b] = socket_pair();
    const int on = 1;
    ASSERT_EQ(::setsockopt(a.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof(on)), 0);
    write_frame(b.get(), kFrameMagic, 7, "from rank 1");
    const std::vector<ipc::Message> in = exchange_with(a.get(), "from rank 0");
    EXPECT_EQ(in[1].payload, "from rank 1");
    EXPECT_EQ(in[1].fd, -1);
    EXPECT_EQ(read_frame(b.get(), 7), "from rank 0");
}

// ----- build_mesh ----------------------------------------------------------------------------------------------

ipc::MeshSpec mesh_spec(const std::string& prefix, int rank, int size, double timeout_s = 5.0) {
    ipc::MeshSpec s;
    s.name_prefix = prefix;
    s.token = "token-" + prefix;
    s.rank = rank;
    s.size = size;
    s.timeout_s = timeout_s;
    s.what = "mesh";
    return s;
}

Hello hello_of(const ipc::MeshSpec& spec, int rank) {
    Hello h{};
    h.magic = kHelloMagic;
    h.rank = rank;
    h.size = spec.size;
    h.pid = getpid();
    h.uid = getuid();
    std::memcpy(h.token, spec.token.data(), spec.token.size());
    return h;
}

// A fake rank 0: listens on the spec's name and answers the first connection with `reply` (nothing when null),
// then holds it open (or closes it) until the test ends.
class FakeListener {
  public:
    FakeListener(const ipc::MeshSpec& spec, const Hello* reply, bool close_at_once = false)
        : listener_(ipc::listen_abstract(ipc::mesh_socket_name(spec, 0), 4)) {
        const Hello copy = reply != nullptr ? *reply : Hello{};
        const bool answer = reply != nullptr;
        thread_ = std::thread([this, copy, answer, close_at_once] {
            pollfd p{listener_.get(), POLLIN, 0};
            if (::poll(&p, 1, 5000) != 1) return;
            conn_.reset(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
            if (close_at_once) conn_.reset();
            if (answer) ::write(conn_.get(), &copy, sizeof(copy));
        });
    }
    ~FakeListener() { thread_.join(); }

  private:
    ipc::Fd listener_;
    ipc::Fd conn_;
    std::thread thread_;
};

Outcome join_as_rank_1(const ipc::MeshSpec& spec) {
    return outcome_of([&] {
        ipc::Fd mine = ipc::listen_abstract(ipc::mesh_socket_name(spec, 1), 4);
        ipc::build_mesh(spec, mine.get(), nullptr);
    });
}

TEST(MeshFaults, ABadReplyFromTheListenerNamesTheProblem) {
    struct Row {
        std::function<void(Hello&)> spoil;
        std::string problem;
    };
    const std::vector<Row> rows = {
        {[](Hello& h) { h.magic = 1; }, "bad hello magic"},
        {[](Hello& h) { h.token[0] = '!'; }, "wrong job token"},
        {[](Hello& h) { h.size = 3; }, "job size 3 != 2"},
        {[](Hello& h) { h.pid = 1; }, "hello pid 1 != SO_PEERCRED pid " + std::to_string(getpid())},
        {[](Hello& h) { h.rank = 1; }, "claims rank 1, expected rank 0"},
    };
    for (const Row& row : rows) {
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        Hello reply = hello_of(spec, 0);
        row.spoil(reply);
        FakeListener fake(spec, &reply);
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: the listener on '@" + ipc::mesh_socket_name(spec, 0) + "' (pid " +
                                 std::to_string(getpid()) + ") is not rank 0: " + row.problem);
        EXPECT_EQ(o.category, kRuntime);
    }
}

TEST(MeshFaults, AListenerThatClosesOrNeverAnswersIsNamed) {
    {
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        FakeListener fake(spec, nullptr, true);
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: rank 0 on '@" + ipc::mesh_socket_name(spec, 0) +
                                 "' closed the connection (refused our credentials or exited)");
        EXPECT_EQ(o.category, kRuntime);
    }
    {
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2, 0.1);
        FakeListener fake(spec, nullptr);
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: rank 0 did not answer on '@" + ipc::mesh_socket_name(spec, 0) + "' within 0.1 s");
        EXPECT_EQ(o.category, kTimeout);
    }
}

TEST(MeshFaults, TheConnectingSideRetriesInterruptionsAndNamesFailures) {
    {  // send and recv interrupted, recv would block, poll interrupted: the mesh still forms
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        const Hello reply = hello_of(spec, 0);
        FakeListener fake(spec, &reply);
        Armed armed({Fault{Call::kSend, 0, 1, EINTR}, Fault{Call::kSend, 0, 1, EAGAIN},
                     Fault{Call::kRecv, 0, 1, EAGAIN}, Fault{Call::kPoll, 0, 1, EINTR},
                     Fault{Call::kConnect, 0, 1, EINTR}, Fault{Call::kConnect, 0, 1, ENOENT},
                     Fault{Call::kConnect, 0, 1, EAGAIN}});
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "(no error)");
        for (size_t i = 0; i < 7; ++i) EXPECT_EQ(armed.hits(i), 1) << i;
    }
    {  // a failed poll while waiting for the reply: the connection counts as closed
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        FakeListener fake(spec, nullptr);
        Armed armed({Fault{Call::kRecv, 0, 1, EAGAIN}, Fault{Call::kPoll, 0, 1, EBADF}});
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: rank 0 on '@" + ipc::mesh_socket_name(spec, 0) +
                                 "' closed the connection (refused our credentials or exited)");
        EXPECT_EQ(armed.hits(1), 1);
    }
    {  // a failed send of the hello
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        FakeListener fake(spec, nullptr);
        Armed armed({Fault{Call::kSend, 0, 1, EPIPE}});
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: rank 0 on '@" + ipc::mesh_socket_name(spec, 0) +
                                 "' closed the connection (refused our credentials or exited)");
        EXPECT_EQ(armed.hits(), 1);
    }
    {  // connect fails for a reason other than "not listening yet"
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        Armed armed({Fault{Call::kConnect, 0, 1, EACCES}});
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: connect('@" + ipc::mesh_socket_name(spec, 0) + "') failed: " + errno_text(EACCES));
        EXPECT_EQ(o.category, kRuntime);
    }
    {  // no socket for the connection
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        ipc::Fd mine = ipc::listen_abstract(ipc::mesh_socket_name(spec, 1), 4);
        Armed armed({Fault{Call::kSocket, 0, 1, ENFILE}});
        const Outcome o = outcome_of([&] { ipc::build_mesh(spec, mine.get(), nullptr); });
        EXPECT_EQ(o.message, "socket(AF_UNIX) failed: " + errno_text(ENFILE));
        EXPECT_EQ(o.category, kRuntime);
        EXPECT_EQ(armed.hits(), 1);
    }
    {  // nobody listens
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2, 0.05);
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: rank 0 did not listen on '@" + ipc::mesh_socket_name(spec, 0) + "' within 0.05 s");
        EXPECT_EQ(o.category, kTimeout);
    }
    {  // the listener is not the expected process
        ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        const pid_t other = getpid() + 100000;
        spec.expected_pids = {other, getpid()};
        FakeListener fake(spec, nullptr, true);
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: '@" + ipc::mesh_socket_name(spec, 0) + "' is held by pid " +
                                 std::to_string(getpid()) + " uid " + std::to_string(getuid()) + ", not rank 0 (pid " +
                                 std::to_string(other) + ") of uid " + std::to_string(getuid()) +
                                 "; refusing to join it");
        EXPECT_EQ(o.category, kRuntime);
    }
    {  // the listener's uid is not ours
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 1, 2);
        FakeListener fake(spec, nullptr, true);
        Armed armed({Fault{Call::kGetsockopt, 0, 1, 0, 0, false, 1}});
        const Outcome o = join_as_rank_1(spec);
        EXPECT_EQ(o.message, "mesh: '@" + ipc::mesh_socket_name(spec, 0) + "' is held by pid " +
                                 std::to_string(getpid()) + " uid " + std::to_string(getuid() + 1) +
                                 ", not rank 0 of uid " + std::to_string(getuid()) + "; refusing to join it");
        EXPECT_EQ(armed.hits(), 1);
    }
}

// A fake higher rank: connects to rank 0's listener and writes `bytes` (closing at once when `close_at_once`).
ipc::Fd connect_and_write(const ipc::MeshSpec& spec, const void* bytes, size_t n, bool close_at_once = false) {
    ipc::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = ipc::mesh_socket_name(spec, 0);
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    const auto length = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    EXPECT_EQ(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), length), 0);
    if (n > 0) EXPECT_EQ(::write(fd.get(), bytes, n), ssize_t(n));
    if (close_at_once) fd.reset();
    return fd;
}

// Rank 0 accepts the queued connections (made before it runs, so no thread is needed); returns the outcome, the
// refused count and the warnings it logged.
struct AcceptResult {
    Outcome outcome;
    int refused = 0;
    std::string log;
    bool rank1_joined = false;
};

AcceptResult accept_as_rank_0(const ipc::MeshSpec& spec, const ipc::Fd& listener) {
    AcceptResult r;
    ::testing::internal::CaptureStderr();
    r.outcome = outcome_of([&] {
        const std::vector<ipc::Fd> sockets = ipc::build_mesh(spec, listener.get(), &r.refused);
        r.rank1_joined = sockets.size() > 1 && sockets[1].valid();
    });
    r.log = ::testing::internal::GetCapturedStderr();
    return r;
}

std::string refusal(const ipc::MeshSpec& spec, const std::string& reason, uid_t uid = getuid()) {
    return "[flatep warning] mesh: refused a connection on '@" + ipc::mesh_socket_name(spec, 0) + "' from pid " +
           std::to_string(getpid()) + " uid " + std::to_string(uid) + ": " + reason + "\n";
}

TEST(MeshFaults, TheAcceptingSideRefusesBadHellosAndStillTakesTheGoodOne) {
    const ipc::MeshSpec spec = mesh_spec(unique_name(), 0, 3);
    const ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, 0), 16);
    Hello bad_magic = hello_of(spec, 1), not_pending = hello_of(spec, 1), good1 = hello_of(spec, 1),
          good2 = hello_of(spec, 2);
    bad_magic.magic = 0;
    std::vector<ipc::Fd> fakes;
    fakes.push_back(connect_and_write(spec, nullptr, 0, true));  // no hello
    fakes.push_back(connect_and_write(spec, &bad_magic, sizeof(Hello)));
    fakes.push_back(connect_and_write(spec, &good1, sizeof(Hello)));
    fakes.push_back(connect_and_write(spec, &not_pending, sizeof(Hello)));  // rank 1 again: already joined
    fakes.push_back(connect_and_write(spec, &good2, sizeof(Hello)));
    // An interrupted poll and a failed accept are retried.
    Armed armed(
        {Fault{Call::kPoll, 0, 1, EINTR}, Fault{Call::kAccept4, 0, 1, EMFILE}, Fault{Call::kRecv, 0, 1, EINTR}});
    const AcceptResult r = accept_as_rank_0(spec, listener);
    EXPECT_EQ(r.outcome.message, "(no error)");
    EXPECT_TRUE(r.rank1_joined);
    EXPECT_EQ(r.refused, 3);
    EXPECT_EQ(r.log, refusal(spec, "no hello") + refusal(spec, "bad hello magic") +
                         refusal(spec, "claims rank 1, which is not a rank still expected here"));
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(armed.hits(i), 1) << i;
}

TEST(MeshFaults, TheAcceptingSideChecksUidAndExpectedPids) {
    {  // a foreign uid, then no peer: the timeout names the missing rank
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 0, 2, 0.2);
        const ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, 0), 4);
        const Hello h = hello_of(spec, 1);
        ipc::Fd fake = connect_and_write(spec, &h, sizeof(h));
        Armed armed({Fault{Call::kGetsockopt, 0, 1, 0, 0, false, 5}});
        const AcceptResult r = accept_as_rank_0(spec, listener);
        EXPECT_EQ(r.outcome.message,
                  "mesh: rank 1 did not connect to '@" + ipc::mesh_socket_name(spec, 0) + "' within 0.2 s");
        EXPECT_EQ(r.outcome.category, kTimeout);
        EXPECT_EQ(r.refused, 1);
        EXPECT_EQ(
            r.log,
            refusal(spec, "uid " + std::to_string(getuid() + 5) + " is not this job's uid " + std::to_string(getuid()),
                    getuid() + 5));
    }
    {  // without a counter the refusal is only logged
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 0, 2, 0.05);
        const ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, 0), 4);
        ipc::Fd fake = connect_and_write(spec, nullptr, 0, true);
        ::testing::internal::CaptureStderr();
        const Outcome o = outcome_of([&] { ipc::build_mesh(spec, listener.get(), nullptr); });
        EXPECT_EQ(::testing::internal::GetCapturedStderr(), refusal(spec, "no hello"));
        EXPECT_EQ(o.category, kTimeout);
    }
    {  // expected pids: a pid not among them; a wrong rank for this pid; a rank whose pid is another's
        ipc::MeshSpec spec = mesh_spec(unique_name(), 0, 4, 0.2);
        const pid_t other = getpid() + 100000;
        spec.expected_pids = {getpid(), getpid(), other, other};
        ipc::MeshSpec only_other = spec;
        only_other.expected_pids = {getpid(), other, other, other};
        const ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, 0), 16);
        const Hello claims2 = hello_of(spec, 2);
        std::vector<ipc::Fd> fakes;
        fakes.push_back(connect_and_write(spec, &claims2, sizeof(Hello)));
        const AcceptResult r = accept_as_rank_0(spec, listener);
        EXPECT_EQ(r.refused, 1);
        EXPECT_EQ(r.log, refusal(spec, "claims rank 2, expected rank 1"));
        EXPECT_EQ(r.outcome.message, "mesh: rank 1 (pid " + std::to_string(getpid()) + "), rank 2 (pid " +
                                         std::to_string(other) + "), rank 3 (pid " + std::to_string(other) +
                                         ") did not connect to '@" + ipc::mesh_socket_name(spec, 0) + "' within 0.2 s");
        fakes.clear();
        const Hello claims1 = hello_of(only_other, 1);
        fakes.push_back(connect_and_write(only_other, &claims1, sizeof(Hello)));
        const AcceptResult r2 = accept_as_rank_0(only_other, listener);
        EXPECT_EQ(r2.refused, 1);
        EXPECT_EQ(r2.log, refusal(only_other, "not a rank of this job (pid not among the expected peers)"));
    }
    {  // two pending ranks share this pid: the hello's rank is checked against its expected pid
        ipc::MeshSpec spec = mesh_spec(unique_name(), 0, 4, 0.2);
        const pid_t other = getpid() + 100000;
        spec.expected_pids = {getpid(), getpid(), getpid(), other};
        const ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, 0), 16);
        const Hello claims3 = hello_of(spec, 3);
        ipc::Fd fake = connect_and_write(spec, &claims3, sizeof(Hello));
        const AcceptResult r = accept_as_rank_0(spec, listener);
        EXPECT_EQ(r.refused, 1);
        EXPECT_EQ(r.log, refusal(spec, "claims rank 3, whose pid is " + std::to_string(other)));
    }
    {  // the reply cannot be sent
        const ipc::MeshSpec spec = mesh_spec(unique_name(), 0, 2, 0.2);
        const ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, 0), 4);
        const Hello h = hello_of(spec, 1);
        ipc::Fd fake = connect_and_write(spec, &h, sizeof(h));
        Armed armed({Fault{Call::kSend, 0, 1, EPIPE}});
        const AcceptResult r = accept_as_rank_0(spec, listener);
        EXPECT_EQ(r.refused, 1);
        EXPECT_EQ(r.log, refusal(spec, "closed before our reply"));
        EXPECT_EQ(r.outcome.category, kTimeout);
        EXPECT_EQ(armed.hits(), 1);
    }
}

}  // namespace
}  // namespace flatep
