// Poisoning of a Buffer or ExpertPools after a failed cross-rank wait (transport/sync.hpp): once any rank's wait
// failed (timeout, ranks in different ops or steps, a peer that gave up), the barrier sequence of that object can no
// longer be trusted on any rank, so every later op raises until the user builds a new one on every rank. The
// failing rank stores its flag word with the abort bit for its peers, so each peer fails at its next wait on it and is
// poisoned too.
//
// The CPU backend learns of a failure synchronously (the barrier throws inside the op). A device backend learns of
// it from the host-mapped WaitRecord, which enter() reads at every op's entry without synchronising: the op that
// the GPU was running when it failed returned long ago, so the error is raised by the first op the host enqueues
// after the GPU recorded it (at once, inside that op, with FLATEP_DEBUG=1, which synchronises after every op).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/check.hpp"
#include "transport/sync.hpp"

namespace flatep {

class CollectiveGuard {
  public:
    explicit CollectiveGuard(const char* what) : what_(what) {}  // "Buffer" or "ExpertPools", for messages

    // At the entry of every op. device_failure: the device's WaitRecord text ("" when none, and on the CPU backend).
    // Throws the failure itself the first time (and poisons), then a kRuntime "unusable" error at every later call.
    void enter(const char* op, const std::string& device_failure, int32_t device_code) {
        if (reason_.empty() && !device_failure.empty()) {
            reason_ = device_failure;
            FLATEP_THROW(device_code == kStatusTimeout    ? ErrorCategory::kTimeout
                         : device_code == kStatusMismatch ? ErrorCategory::kMismatch
                                                          : ErrorCategory::kRuntime,
                         op, ": ", device_failure);
        }
        if (!reason_.empty()) {
            FLATEP_THROW(ErrorCategory::kRuntime, op, ": this ", what_,
                         " is unusable after an earlier cross-rank failure (", reason_,
                         "); destroy it and build a new one on every rank");
        }
    }

    // Runs the body of a host collective op. A wait that failed inside it left a fatal code in the status words
    // (status: this rank's, may be null): that poisons, and the error goes on to the caller.
    template <typename Body>
    void run(const int32_t* status, Body&& body) {
        try {
            body();
        } catch (const Error& e) {
            if (status != nullptr &&
                status_is_fatal(
                    std::atomic_ref<int32_t>(*const_cast<int32_t*>(status)).load(std::memory_order_acquire))) {
                if (reason_.empty()) reason_ = e.message();
            }
            throw;
        }
    }

    bool poisoned() const { return !reason_.empty(); }
    const std::string& reason() const { return reason_; }

  private:
    const char* what_;
    std::string reason_;  // the first failure's text; empty while usable
};

}  // namespace flatep
