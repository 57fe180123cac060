// A test-only fault injector for the system calls of the transport. The test binary defines the libc functions
// below (send, recvmsg, poll, socket, ...); each forwards to the real one (dlsym(RTLD_NEXT)) unless a fault armed
// on the calling thread matches it. Faults are thread-local, so a fake peer on another thread sees the real calls.
// Every fault counts the calls it changed, so a test can check that its fault was reached.
#pragma once
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

namespace flatep::testing::faults {

enum class Call {
    kSocket,
    kSocketpair,
    kBind,
    kListen,
    kConnect,
    kAccept4,
    kGetsockopt,
    kGetrandom,
    kPoll,
    kSend,
    kRecv,
    kSendmsg,
    kRecvmsg,
    kClose,
    kFork,
    kFtruncate
};

struct Fault {
    Call call;
    int skip = 0;             // calls of `call` let through before the fault starts
    int times = 1;            // calls changed after that (-1: every call)
    int error = 0;            // fail with this errno (return -1); 0: do not fail
    size_t max_bytes = 0;     // with error 0: cap the length of a send/recv/sendmsg/recvmsg/getrandom (a short I/O)
    bool real_first = false;  // fail after running the real call (close: the descriptor is still closed)
    unsigned uid_delta = 0;   // getsockopt(SO_PEERCRED) with error 0: add this to the uid it reports
    int hits = 0;             // calls changed so far
};

// Arms faults on this thread for its lifetime; hits(i) is the count of fault i.
class Armed {
  public:
    explicit Armed(std::vector<Fault> faults);
    ~Armed();
    Armed(const Armed&) = delete;
    Armed& operator=(const Armed&) = delete;
    int hits(size_t i = 0) const { return faults_[i].hits; }

  private:
    std::vector<Fault> faults_;
    std::vector<Fault>* previous_;
};

// The text the library's errors give for a failed call with this errno (strerror and the number), as the tests
// expect it: written out here, not taken from the library.
inline std::string errno_text(int error) {
    return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")";
}

}  // namespace flatep::testing::faults
