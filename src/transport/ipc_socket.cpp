#include "transport/ipc_socket.hpp"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <thread>

#include "common/check.hpp"
#include "common/log.hpp"

namespace flatep::transport::ipc {

namespace {

constexpr uint32_t kFrameMagic = 0x46455046u;  // "FPEF"
constexpr uint32_t kHelloMagic = 0x46455048u;  // "HPEF"
constexpr size_t kTokenBytes = 64;
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 32;

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
    char token[kTokenBytes];
};

int millis_until(Deadline deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left + 1, 1 << 30));
}

std::string format_seconds(double seconds) { return detail::concat(seconds); }  // as given (shortest round-trip)

sockaddr_un abstract_address(const std::string& name, socklen_t* length) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    FLATEP_CHECK(!name.empty() && name.size() + 1 < sizeof(addr.sun_path), "socket name must be 1..",
                 sizeof(addr.sun_path) - 2, " bytes, got '", name, "'");
    addr.sun_path[0] = '\0';  // abstract namespace: no file, gone when the last descriptor closes
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return addr;
}

enum class IoStatus { kOk, kClosed, kTimeout };

// Sends or receives exactly `num_bytes` on a nonblocking socket before the deadline.
IoStatus transfer_all(int fd, void* data, size_t num_bytes, Deadline deadline, bool sending) {
    auto* bytes = static_cast<uint8_t*>(data);
    size_t done = 0;
    while (done < num_bytes) {
        const ssize_t n = sending ? ::send(fd, bytes + done, num_bytes - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                                  : ::recv(fd, bytes + done, num_bytes - done, MSG_DONTWAIT);
        if (n > 0) {
            done += static_cast<size_t>(n);
            continue;
        }
        if (n == 0) return IoStatus::kClosed;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return IoStatus::kClosed;
        pollfd pfd{fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0};
        const int ms = millis_until(deadline);
        if (ms == 0) return IoStatus::kTimeout;
        if (::poll(&pfd, 1, ms) < 0 && errno != EINTR) return IoStatus::kClosed;
    }
    return IoStatus::kOk;
}

Hello make_hello(const MeshSpec& spec) {
    Hello hello{};
    hello.magic = kHelloMagic;
    hello.rank = spec.rank;
    hello.size = spec.size;
    hello.pid = static_cast<int32_t>(::getpid());
    hello.uid = static_cast<uint32_t>(::getuid());
    std::memcpy(hello.token, spec.token.data(), spec.token.size());
    return hello;
}

// Empty string when the hello is acceptable for `expected_rank` (-1: any rank in the pending set).
std::string check_hello(const Hello& hello, const MeshSpec& spec, const PeerCredentials& cred, int expected_rank,
                        const std::set<int>* pending) {
    const Hello mine = make_hello(spec);
    if (hello.magic != kHelloMagic) return "bad hello magic";
    if (std::memcmp(hello.token, mine.token, kTokenBytes) != 0) return "wrong job token";
    if (hello.size != spec.size) return detail::concat("job size ", hello.size, " != ", spec.size);
    if (hello.pid != static_cast<int32_t>(cred.pid))
        return detail::concat("hello pid ", hello.pid, " != SO_PEERCRED pid ", cred.pid);
    if (expected_rank >= 0 && hello.rank != expected_rank)
        return detail::concat("claims rank ", hello.rank, ", expected rank ", expected_rank);
    if (pending != nullptr && pending->count(hello.rank) == 0)
        return detail::concat("claims rank ", hello.rank, ", which is not a rank still expected here");
    return {};
}

}  // namespace

Deadline deadline_after(double seconds) {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void close_quietly(int fd) noexcept {
    if (fd < 0) return;
    if (::close(fd) != 0 && errno != EINTR) FLATEP_LOG_WARN("close(", fd, ") failed: ", detail::errno_text());
}

Fd& Fd::operator=(Fd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
}

void Fd::reset(int fd) noexcept {
    close_quietly(fd_);
    fd_ = fd;
}

PeerCredentials peer_credentials(int socket_fd) {
    ucred cred{};
    socklen_t length = sizeof(cred);
    FLATEP_SYS_CHECK(::getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) == 0, "getsockopt(SO_PEERCRED)");
    return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

Fd listen_abstract(const std::string& name, int backlog) {
    socklen_t length = 0;
    const sockaddr_un addr = abstract_address(name, &length);
    Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    FLATEP_SYS_CHECK(fd.valid(), "socket(AF_UNIX)");
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
        if (errno == EADDRINUSE)
            FLATEP_THROW(ErrorCategory::kRuntime, "socket name '@", name,
                         "' is already in use: another job with the same id is running");
        FLATEP_SYS_CHECK(false, detail::concat("bind('@", name, "')"));
    }
    FLATEP_SYS_CHECK(::listen(fd.get(), backlog) == 0, "listen");
    return fd;
}

std::string random_hex(size_t num_bytes) {
    std::vector<uint8_t> bytes(num_bytes);
    size_t done = 0;
    while (done < num_bytes) {
        const ssize_t n = ::getrandom(bytes.data() + done, num_bytes - done, 0);
        if (n < 0 && errno == EINTR) continue;
        FLATEP_SYS_CHECK(n > 0, "getrandom");
        done += static_cast<size_t>(n);
    }
    static const char kDigits[] = "0123456789abcdef";
    std::string text;
    for (const uint8_t b : bytes) {
        text.push_back(kDigits[b >> 4]);
        text.push_back(kDigits[b & 15]);
    }
    return text;
}

std::vector<Message> exchange(const std::vector<int>& sockets, int self, const std::vector<Message>& out, uint32_t tag,
                              double timeout_s, const std::string& what, const PeerNamer& name_peer) {
    const Deadline deadline = deadline_after(timeout_s);
    const int num_peers = static_cast<int>(sockets.size());
    FLATEP_CHECK(static_cast<int>(out.size()) == num_peers, "exchange: ", out.size(), " messages for ", num_peers,
                 " ranks");
    enum class RecvStatus { kPending, kDone, kClosed, kBadTag, kBadMessage };
    struct PeerState {
        std::string send_bytes;
        size_t send_offset = 0;
        bool send_done = true;
        bool send_failed = false;
        FrameHeader header{};
        size_t recv_got = 0;  // bytes of header + payload received
        RecvStatus recv = RecvStatus::kDone;
        uint32_t bad_tag = 0;
    };
    std::vector<PeerState> state(num_peers);
    std::vector<Message> in(num_peers);
    for (int p = 0; p < num_peers; ++p) {
        if (p == self) continue;
        FLATEP_CHECK(sockets[p] >= 0, what, ": no connection to ", name_peer(p));
        FrameHeader header{kFrameMagic, tag, out[p].payload.size()};
        state[p].send_bytes.assign(reinterpret_cast<const char*>(&header), sizeof(header));
        state[p].send_bytes += out[p].payload;
        state[p].send_done = false;
        state[p].recv = RecvStatus::kPending;
    }

    auto do_send = [&](int p) {
        PeerState& s = state[p];
        while (s.send_offset < s.send_bytes.size()) {
            iovec iov{s.send_bytes.data() + s.send_offset, s.send_bytes.size() - s.send_offset};
            msghdr msg{};
            msg.msg_iov = &iov;
            msg.msg_iovlen = 1;
            alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
            if (s.send_offset == 0 && out[p].fd >= 0) {
                msg.msg_control = control;
                msg.msg_controllen = sizeof(control);
                cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
                cmsg->cmsg_level = SOL_SOCKET;
                cmsg->cmsg_type = SCM_RIGHTS;
                cmsg->cmsg_len = CMSG_LEN(sizeof(int));
                std::memcpy(CMSG_DATA(cmsg), &out[p].fd, sizeof(int));
            }
            const ssize_t n = ::sendmsg(sockets[p], &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN || errno == EWOULDBLOCK) return;
                s.send_failed = true;
                return;
            }
            s.send_offset += static_cast<size_t>(n);
        }
        s.send_done = true;
    };

    auto do_recv = [&](int p) {
        PeerState& s = state[p];
        while (s.recv == RecvStatus::kPending) {
            const bool in_header = s.recv_got < sizeof(FrameHeader);
            iovec iov{};
            if (in_header) {
                iov = {reinterpret_cast<char*>(&s.header) + s.recv_got, sizeof(FrameHeader) - s.recv_got};
            } else {
                const size_t offset = s.recv_got - sizeof(FrameHeader);
                iov = {in[p].payload.data() + offset, in[p].payload.size() - offset};
            }
            msghdr msg{};
            msg.msg_iov = &iov;
            msg.msg_iovlen = 1;
            alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
            msg.msg_control = control;
            msg.msg_controllen = sizeof(control);
            const ssize_t n = ::recvmsg(sockets[p], &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
            if (n < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN || errno == EWOULDBLOCK) return;
                s.recv = RecvStatus::kClosed;
                return;
            }
            if (n == 0) {
                s.recv = RecvStatus::kClosed;
                return;
            }
            for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
                if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
                const size_t num_fds = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < num_fds; ++i) {
                    int fd = -1;
                    std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
                    if (in[p].fd < 0 && s.recv_got == 0) {
                        in[p].fd = fd;
                    } else {
                        close_quietly(fd);
                        s.recv = RecvStatus::kBadMessage;
                    }
                }
            }
            if ((msg.msg_flags & MSG_CTRUNC) != 0) s.recv = RecvStatus::kBadMessage;
            s.recv_got += static_cast<size_t>(n);
            if (s.recv != RecvStatus::kPending) return;
            if (in_header && s.recv_got == sizeof(FrameHeader)) {
                if (s.header.magic != kFrameMagic || s.header.num_bytes > kMaxPayloadBytes) {
                    s.recv = RecvStatus::kBadMessage;
                    return;
                }
                if (s.header.tag != tag) {
                    s.bad_tag = s.header.tag;
                    s.recv = RecvStatus::kBadTag;
                    return;
                }
                in[p].payload.resize(s.header.num_bytes);
            }
            if (s.recv_got == sizeof(FrameHeader) + s.header.num_bytes) s.recv = RecvStatus::kDone;
        }
    };

    std::vector<pollfd> pfds;
    std::vector<int> pfd_peer;
    for (;;) {
        pfds.clear();
        pfd_peer.clear();
        for (int p = 0; p < num_peers; ++p) {
            if (p == self) continue;
            PeerState& s = state[p];
            short events = 0;
            if (!s.send_done && !s.send_failed) events |= POLLOUT;
            if (s.recv == RecvStatus::kPending) events |= POLLIN;
            if (events == 0) continue;
            pfds.push_back(pollfd{sockets[p], events, 0});
            pfd_peer.push_back(p);
        }
        if (pfds.empty()) break;
        const int ms = millis_until(deadline);
        if (ms == 0) break;
        const int ready = ::poll(pfds.data(), pfds.size(), ms);
        if (ready < 0) {
            if (errno == EINTR) continue;
            FLATEP_SYS_CHECK(false, "poll");
        }
        for (size_t i = 0; i < pfds.size(); ++i) {
            const int p = pfd_peer[i];
            const short revents = pfds[i].revents;
            if ((revents & (POLLIN | POLLHUP | POLLERR)) != 0 && state[p].recv == RecvStatus::kPending) do_recv(p);
            if ((revents & (POLLOUT | POLLHUP | POLLERR)) != 0 && !state[p].send_done && !state[p].send_failed)
                do_send(p);
        }
    }

    std::string timed_out, left, mismatched;
    auto append = [](std::string& list, const std::string& item) { list += (list.empty() ? "" : ", ") + item; };
    for (int p = 0; p < num_peers; ++p) {
        if (p == self) continue;
        const PeerState& s = state[p];
        switch (s.recv) {
            case RecvStatus::kDone:
                // The peer delivered; a send still pending at the deadline means it stopped reading.
                if (!s.send_done && !s.send_failed) append(timed_out, name_peer(p));
                break;
            case RecvStatus::kPending:
                append(timed_out, name_peer(p));
                break;
            case RecvStatus::kClosed:
                append(left, name_peer(p));
                break;
            case RecvStatus::kBadTag:
                append(mismatched, detail::concat(name_peer(p), " is in collective #", s.bad_tag));
                break;
            case RecvStatus::kBadMessage:
                append(mismatched, detail::concat(name_peer(p), " sent a malformed message"));
                break;
        }
    }
    if (timed_out.empty() && left.empty() && mismatched.empty()) return in;
    for (Message& m : in) close_quietly(m.fd);
    std::string text = what + ":";
    if (!timed_out.empty())
        text += detail::concat(" ", timed_out, " did not arrive within ", format_seconds(timeout_s), " s;");
    if (!left.empty()) text += detail::concat(" ", left, " left the job (connection closed) without arriving;");
    if (!mismatched.empty()) text += detail::concat(" ", mismatched, " (this rank is in #", tag, ");");
    text.pop_back();
    if (timed_out.empty() && left.empty()) FLATEP_THROW(ErrorCategory::kMismatch, text);
    FLATEP_THROW(ErrorCategory::kTimeout, text);
}

std::string mesh_socket_name(const MeshSpec& spec, int rank) { return detail::concat(spec.name_prefix, "-", rank); }

std::vector<Fd> build_mesh(const MeshSpec& spec, int listener, int* num_refused) {
    FLATEP_CHECK(spec.size >= 1 && spec.rank >= 0 && spec.rank < spec.size, spec.what, ": rank ", spec.rank,
                 " outside [0, ", spec.size, ")");
    FLATEP_CHECK(spec.token.size() <= kTokenBytes, spec.what, ": token longer than ", kTokenBytes, " bytes");
    FLATEP_CHECK(spec.expected_pids.empty() || static_cast<int>(spec.expected_pids.size()) == spec.size, spec.what,
                 ": ", spec.expected_pids.size(), " expected pids for ", spec.size, " ranks");
    const Deadline deadline = deadline_after(spec.timeout_s);
    const uid_t my_uid = ::getuid();
    auto name_rank = [&](int r) {
        return spec.expected_pids.empty() ? detail::concat("rank ", r)
                                          : detail::concat("rank ", r, " (pid ", spec.expected_pids[r], ")");
    };
    std::vector<Fd> sockets(spec.size);
    Hello mine = make_hello(spec);

    // Lower ranks: connect (they may not listen yet; retry until the deadline), check the listener's credentials
    // before sending the token, then check its reply.
    for (int peer = 0; peer < spec.rank; ++peer) {
        const std::string name = mesh_socket_name(spec, peer);
        socklen_t length = 0;
        const sockaddr_un addr = abstract_address(name, &length);
        Fd fd;
        for (;;) {
            fd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
            FLATEP_SYS_CHECK(fd.valid(), "socket(AF_UNIX)");
            if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), length) == 0) break;
            if (errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN && errno != EINTR)
                FLATEP_SYS_CHECK(false, detail::concat(spec.what, ": connect('@", name, "')"));
            if (Clock::now() >= deadline)
                FLATEP_THROW(ErrorCategory::kTimeout, spec.what, ": ", name_rank(peer), " did not listen on '@", name,
                             "' within ", format_seconds(spec.timeout_s), " s");
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        const PeerCredentials cred = peer_credentials(fd.get());
        const bool pid_ok = spec.expected_pids.empty() || cred.pid == spec.expected_pids[peer];
        if (cred.uid != my_uid || !pid_ok)
            FLATEP_THROW(ErrorCategory::kRuntime, spec.what, ": '@", name, "' is held by pid ", cred.pid, " uid ",
                         cred.uid, ", not ", name_rank(peer), " of uid ", my_uid, "; refusing to join it");
        const IoStatus sent = transfer_all(fd.get(), &mine, sizeof(mine), deadline, true);
        Hello reply{};
        const IoStatus got =
            sent == IoStatus::kOk ? transfer_all(fd.get(), &reply, sizeof(reply), deadline, false) : sent;
        if (got == IoStatus::kTimeout)
            FLATEP_THROW(ErrorCategory::kTimeout, spec.what, ": ", name_rank(peer), " did not answer on '@", name,
                         "' within ", format_seconds(spec.timeout_s), " s");
        if (got == IoStatus::kClosed)
            FLATEP_THROW(ErrorCategory::kRuntime, spec.what, ": ", name_rank(peer), " on '@", name,
                         "' closed the connection (refused our credentials or exited)");
        const std::string problem = check_hello(reply, spec, cred, peer, nullptr);
        if (!problem.empty())
            FLATEP_THROW(ErrorCategory::kRuntime, spec.what, ": the listener on '@", name, "' (pid ", cred.pid,
                         ") is not ", name_rank(peer), ": ", problem);
        sockets[peer] = std::move(fd);
    }

    // Higher ranks: accept, check SO_PEERCRED before reading anything, then the hello; refuse everything else.
    std::set<int> pending;
    for (int r = spec.rank + 1; r < spec.size; ++r) pending.insert(r);
    const std::string my_name = mesh_socket_name(spec, spec.rank);
    auto refuse = [&](Fd& fd, const PeerCredentials& cred, const std::string& reason) {
        FLATEP_LOG_WARN(spec.what, ": refused a connection on '@", my_name, "' from pid ", cred.pid, " uid ", cred.uid,
                        ": ", reason);
        fd.reset();
        if (num_refused != nullptr) ++*num_refused;
    };
    while (!pending.empty()) {
        const int ms = millis_until(deadline);
        if (ms == 0) {
            std::string missing;
            for (const int r : pending) missing += (missing.empty() ? "" : ", ") + name_rank(r);
            FLATEP_THROW(ErrorCategory::kTimeout, spec.what, ": ", missing, " did not connect to '@", my_name,
                         "' within ", format_seconds(spec.timeout_s), " s");
        }
        pollfd pfd{listener, POLLIN, 0};
        if (::poll(&pfd, 1, ms) <= 0) continue;
        Fd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!fd.valid()) continue;
        const PeerCredentials cred = peer_credentials(fd.get());
        if (cred.uid != my_uid) {
            refuse(fd, cred, detail::concat("uid ", cred.uid, " is not this job's uid ", my_uid));
            continue;
        }
        int expected_rank = -1;  // -1 after the pid check: several pending ranks share this pid (threads)
        if (!spec.expected_pids.empty()) {
            int matches = 0;
            for (const int r : pending)
                if (spec.expected_pids[r] == cred.pid) {
                    expected_rank = r;
                    ++matches;
                }
            if (matches == 0) {
                refuse(fd, cred, "not a rank of this job (pid not among the expected peers)");
                continue;
            }
            if (matches > 1) expected_rank = -1;
        }
        Hello hello{};
        const Deadline hello_deadline = std::min(deadline, deadline_after(2.0));
        if (transfer_all(fd.get(), &hello, sizeof(hello), hello_deadline, false) != IoStatus::kOk) {
            refuse(fd, cred, "no hello");
            continue;
        }
        std::string problem = check_hello(hello, spec, cred, expected_rank, &pending);
        if (problem.empty() && !spec.expected_pids.empty() && spec.expected_pids[hello.rank] != cred.pid)
            problem = detail::concat("claims rank ", hello.rank, ", whose pid is ", spec.expected_pids[hello.rank]);
        if (!problem.empty()) {
            refuse(fd, cred, problem);
            continue;
        }
        if (transfer_all(fd.get(), &mine, sizeof(mine), deadline, true) != IoStatus::kOk) {
            refuse(fd, cred, "closed before our reply");
            continue;
        }
        pending.erase(hello.rank);
        sockets[hello.rank] = std::move(fd);
    }
    return sockets;
}

}  // namespace flatep::transport::ipc
