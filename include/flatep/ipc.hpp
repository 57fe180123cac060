// Multi-process world (design §7): one process per rank. A Bootstrap (small all-gathers) comes from a fork launcher,
// a socket rendezvous, or the caller (torch.distributed from Python); the `ipc` transport built on it shares
// symmetric regions between the processes by passing file descriptors over Unix-domain sockets (SCM_RIGHTS):
// memfds for host memory, CUDA VMM POSIX-fd handles for device memory.
//
//   std::vector<int> codes = flatep::run_forked(4, [](int rank, std::shared_ptr<flatep::Bootstrap> boot) {
//       auto transport = flatep::make_ipc_transport(boot, flatep::MemoryKind::kHost);
//       flatep::SymmetricRegion region = transport->allocate(1 << 20);   // peers[p]: rank p's region, mapped here
//       ...
//       return 0;   // the child's exit code
//   });
//
// Security: the transport's sockets live in the abstract namespace under a random per-job nonce shared through
// the bootstrap; every connection is checked with SO_PEERCRED against the pid and uid each rank announced through
// the bootstrap, and anything else is refused and logged (FLATEP_LOG_WARN).
//
// Failure: every blocking call has a timeout. A rank that dies or stops calling makes every other rank's next
// collective throw flatep::Error(kTimeout) naming it ("rank 2 (pid 4242)"), within the timeout.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flatep/transport.hpp"

namespace flatep {

struct ForkOptions {
    double timeout_s =
        0;  // the children's bootstrap timeout per collective, seconds in (0, 86400]; 0: FLATEP_TIMEOUT_S
    double deadline_s = 0;  // the parent kills children still running after this many seconds, in (0, 86400];
                            // 0: 3*timeout + 10
};

// Exit code of a child whose function threw (the error text goes to stderr, prefixed with the rank).
inline constexpr int kForkExitError = 70;

// Forks num_ranks children; child r runs fn(r, bootstrap) and exits with its return value (fn's return value, or
// kForkExitError when it threw). The bootstrap is a full mesh of socketpairs created by the parent. Returns the
// exit codes by rank: 128 + signal for a child killed by a signal (SIGKILL when the parent's deadline passed).
// Call it before the parent process initialises CUDA (a forked child cannot use its parent's CUDA state).
std::vector<int> run_forked(int num_ranks, const std::function<int(int rank, std::shared_ptr<Bootstrap>)>& fn,
                            const ForkOptions& options = {});

// Socket rendezvous for separately launched processes of one user: rank r listens on the abstract socket
// "flatep-rdv-<job_id>-<r>", connects to every lower rank and accepts every higher rank (SO_PEERCRED: same uid).
// job_id: 1..64 characters of [A-Za-z0-9._-], unique among the machine's running jobs. timeout_s: seconds in
// (0, 86400], or 0: FLATEP_TIMEOUT_S (anything else is a kInvalidArgument error).
std::shared_ptr<Bootstrap> make_socket_bootstrap(const std::string& job_id, int rank, int num_ranks,
                                                 double timeout_s = 0);
// The same from FLATEP_JOB_ID, FLATEP_RANK and FLATEP_NUM_RANKS.
std::shared_ptr<Bootstrap> make_socket_bootstrap_from_env(double timeout_s = 0);

// Collective over the bootstrap's ranks. kHost: memfd regions (CPU backend); kDevice: CUDA VMM regions on CUDA device
// `device` (-1: the device of the calling thread's current CUDA context, device 0 when none is current; requires a
// build with CUDA), whose primary context the transport retains and binds for every driver call it makes, on any
// thread (Transport::device). timeout_s: seconds in (0, 86400], or 0: FLATEP_TIMEOUT_S; it bounds every collective
// of the transport. same_process: the ranks may be threads of one process (virtual ranks for benchmarks and tests);
// otherwise two ranks with one pid are an error.
std::unique_ptr<Transport> make_ipc_transport(std::shared_ptr<Bootstrap> bootstrap, MemoryKind kind,
                                              double timeout_s = 0, bool same_process = false, int device = -1);

// Virtual ranks: R ranks as threads of one process, each with the ipc transport over an in-process all-gather -- the
// world flatep.virtual builds in Python, for tests, benchmarks and tools on one machine. Collective set-up runs on R
// threads inside the call. kHost: the CPU backend (each rank's ops block its thread, so run every rank on its own
// thread: run_threads). kDevice: the ranks' memory on the CUDA devices `devices` in equal consecutive blocks (rank r
// on devices[r * D / R]; empty: every rank on the current context's device); a device op never blocks the host, so
// one thread may enqueue every rank's ops, each rank on its own stream, whose kernels then wait for each other on the
// GPU (give each rank an SM budget, Launch::num_sms, that lets all of them run at once). timeout_s as
// make_ipc_transport's (0: FLATEP_TIMEOUT_S), also the all-gather's bound.
std::vector<std::shared_ptr<Transport>> make_virtual_ranks(int num_ranks, MemoryKind kind, double timeout_s = 0,
                                                           const std::vector<int>& devices = {});

// Runs fn(rank) for every rank in [0, num_ranks), each on its own thread, all at once, and waits for all of them.
// When some threw, rethrows the exception of the lowest such rank (after every thread ended).
void run_threads(int num_ranks, const std::function<void(int rank)>& fn);

}  // namespace flatep
