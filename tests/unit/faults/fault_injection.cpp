#include "unit/faults/fault_injection.hpp"

#include <dlfcn.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace flatep::testing::faults {
namespace {

thread_local std::vector<Fault>* armed = nullptr;

// The first armed fault of this call that is due (its skip spent, times left); later faults do not see the call.
Fault* due(Call call) {
    if (armed == nullptr) return nullptr;
    Fault* hit = nullptr;
    for (Fault& f : *armed) {
        if (f.call != call || hit != nullptr) continue;
        if (f.skip > 0) {
            --f.skip;
            continue;
        }
        if (f.times == 0) continue;
        if (f.times > 0) --f.times;
        ++f.hits;
        hit = &f;
    }
    return hit;
}

template <class F>
F real(const char* name) {
    void* p = dlsym(RTLD_NEXT, name);
    if (p == nullptr) std::abort();
    return reinterpret_cast<F>(p);
}

size_t capped(const Fault* f, size_t n) {
    return f != nullptr && f->max_bytes > 0 && f->max_bytes < n ? f->max_bytes : n;
}

int fail(int error) {
    errno = error;
    return -1;
}

}  // namespace

Armed::Armed(std::vector<Fault> faults) : faults_(std::move(faults)), previous_(armed) { armed = &faults_; }
Armed::~Armed() { armed = previous_; }

}  // namespace flatep::testing::faults

using flatep::testing::faults::Call;
using flatep::testing::faults::Fault;
namespace fi = flatep::testing::faults;

extern "C" {

int socket(int domain, int type, int protocol) {
    static auto fn = fi::real<int (*)(int, int, int)>("socket");
    if (Fault* f = fi::due(Call::kSocket); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(domain, type, protocol);
}

int socketpair(int domain, int type, int protocol, int fds[2]) {
    static auto fn = fi::real<int (*)(int, int, int, int*)>("socketpair");
    if (Fault* f = fi::due(Call::kSocketpair); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(domain, type, protocol, fds);
}

pid_t fork() {
    static auto fn = fi::real<pid_t (*)()>("fork");
    if (Fault* f = fi::due(Call::kFork); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn();
}

int ftruncate(int fd, off_t length) {
    static auto fn = fi::real<int (*)(int, off_t)>("ftruncate");
    if (Fault* f = fi::due(Call::kFtruncate); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fd, length);
}

int bind(int fd, const sockaddr* addr, socklen_t length) {
    static auto fn = fi::real<int (*)(int, const sockaddr*, socklen_t)>("bind");
    if (Fault* f = fi::due(Call::kBind); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fd, addr, length);
}

int listen(int fd, int backlog) {
    static auto fn = fi::real<int (*)(int, int)>("listen");
    if (Fault* f = fi::due(Call::kListen); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fd, backlog);
}

int connect(int fd, const sockaddr* addr, socklen_t length) {
    static auto fn = fi::real<int (*)(int, const sockaddr*, socklen_t)>("connect");
    if (Fault* f = fi::due(Call::kConnect); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fd, addr, length);
}

int accept4(int fd, sockaddr* addr, socklen_t* length, int flags) {
    static auto fn = fi::real<int (*)(int, sockaddr*, socklen_t*, int)>("accept4");
    if (Fault* f = fi::due(Call::kAccept4); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fd, addr, length, flags);
}

int getsockopt(int fd, int level, int name, void* value, socklen_t* length) {
    static auto fn = fi::real<int (*)(int, int, int, void*, socklen_t*)>("getsockopt");
    Fault* f = fi::due(Call::kGetsockopt);
    if (f != nullptr && f->error != 0) return fi::fail(f->error);
    const int rc = fn(fd, level, name, value, length);
    if (rc == 0 && f != nullptr && level == SOL_SOCKET && name == SO_PEERCRED)
        static_cast<ucred*>(value)->uid += f->uid_delta;
    return rc;
}

ssize_t getrandom(void* buffer, size_t length, unsigned flags) {
    static auto fn = fi::real<ssize_t (*)(void*, size_t, unsigned)>("getrandom");
    Fault* f = fi::due(Call::kGetrandom);
    if (f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(buffer, fi::capped(f, length), flags);
}

int poll(pollfd* fds, nfds_t count, int timeout) {
    static auto fn = fi::real<int (*)(pollfd*, nfds_t, int)>("poll");
    if (Fault* f = fi::due(Call::kPoll); f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fds, count, timeout);
}

ssize_t send(int fd, const void* data, size_t length, int flags) {
    static auto fn = fi::real<ssize_t (*)(int, const void*, size_t, int)>("send");
    Fault* f = fi::due(Call::kSend);
    if (f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fd, data, fi::capped(f, length), flags);
}

ssize_t recv(int fd, void* data, size_t length, int flags) {
    static auto fn = fi::real<ssize_t (*)(int, void*, size_t, int)>("recv");
    Fault* f = fi::due(Call::kRecv);
    if (f != nullptr && f->error != 0) return fi::fail(f->error);
    return fn(fd, data, fi::capped(f, length), flags);
}

ssize_t sendmsg(int fd, const msghdr* msg, int flags) {
    static auto fn = fi::real<ssize_t (*)(int, const msghdr*, int)>("sendmsg");
    Fault* f = fi::due(Call::kSendmsg);
    if (f != nullptr && f->error != 0) return fi::fail(f->error);
    if (f == nullptr || f->max_bytes == 0 || msg->msg_iovlen != 1) return fn(fd, msg, flags);
    msghdr shorter = *msg;
    iovec iov = msg->msg_iov[0];
    iov.iov_len = fi::capped(f, iov.iov_len);
    shorter.msg_iov = &iov;
    return fn(fd, &shorter, flags);
}

ssize_t recvmsg(int fd, msghdr* msg, int flags) {
    static auto fn = fi::real<ssize_t (*)(int, msghdr*, int)>("recvmsg");
    Fault* f = fi::due(Call::kRecvmsg);
    if (f != nullptr && f->error != 0) return fi::fail(f->error);
    if (f == nullptr || f->max_bytes == 0 || msg->msg_iovlen != 1) return fn(fd, msg, flags);
    iovec* original = msg->msg_iov;
    iovec iov = original[0];
    iov.iov_len = fi::capped(f, iov.iov_len);
    msg->msg_iov = &iov;
    const ssize_t n = fn(fd, msg, flags);
    msg->msg_iov = original;
    return n;
}

int close(int fd) {
    static auto fn = fi::real<int (*)(int)>("close");
    Fault* f = fi::due(Call::kClose);
    if (f == nullptr || f->error == 0) return fn(fd);
    if (f->real_first) fn(fd);
    return fi::fail(f->error);
}

}  // extern "C"
