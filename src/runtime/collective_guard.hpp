// Poisoning of a Buffer or ExpertPools after a failed cross-rank wait (sync/sync.hpp): once any rank's wait
// failed (timeout, ranks in different ops or steps, a peer that gave up), the barrier sequence of that object can no
// longer be trusted on any rank, so every later op raises until the user builds a new one on every rank. The
// failing rank stores its flag word with the abort bit for its peers, so each peer fails at its next wait on it and is
// poisoned too.
//
// The CPU backend learns of a failure synchronously (the barrier throws inside the op). A device backend learns of
// it from the host-mapped sync::WaitRecord, which enter() reads at every op's entry without synchronising: the op that
// the GPU was running when it failed returned long ago, so the error is raised by the first op the host enqueues
// after the GPU recorded it (at once, inside that op, with FLATEP_DEBUG=1, which synchronises after every op).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "sync/barrier_host.hpp"
#include "sync/sync.hpp"

namespace flatep {

// Where a rank's host collectives of one Buffer / ExpertPools meet: this rank's flag array (what every peer stored
// for it) and its epoch. A guard registers its site so that a timeout in one object can look at the rank's other
// objects on the same transport: a peer that is ahead of this rank there waits in that object, i.e. the ranks called
// different Buffers (or pools), and the message names what the peer is doing.
struct CollectiveSite {
    const void* transport = nullptr;
    const uint64_t* flags = nullptr;  // this rank's flag array (flags[p]: what peer p stored)
    const uint64_t* epoch = nullptr;  // this rank's barrier epoch in that object
};

class CollectiveGuard {
  public:
    explicit CollectiveGuard(const char* what) : what_(what) {}  // "Buffer" or "ExpertPools", for messages
    ~CollectiveGuard() { set_site({}); }
    CollectiveGuard(const CollectiveGuard&) = delete;
    CollectiveGuard& operator=(const CollectiveGuard&) = delete;

    // Host objects: registers where this object's barriers meet (an empty site unregisters).
    void set_site(const CollectiveSite& site) {
        std::lock_guard<std::mutex> lock(registry_mutex());
        std::erase(registry(), this);
        site_ = site;
        if (site.flags != nullptr) registry().push_back(this);
    }

    // At the entry of every op. device_failure: the device's sync::WaitRecord text ("" when none, and on the CPU
    // backend). Throws the failure itself the first time (and poisons), then a kRuntime "unusable" error at every later
    // call.
    void enter(const char* op, const std::string& device_failure, int32_t device_code) {
        if (reason_.empty() && !device_failure.empty()) {
            reason_ = device_failure;
            FLATEP_THROW(sync::host::wait_failure_category(device_code), op, ": ", device_failure);
        }
        if (!reason_.empty()) {
            FLATEP_THROW(ErrorCategory::kRuntime, op, ": this ", what_,
                         " is unusable after an earlier cross-rank failure (", reason_,
                         "); destroy it and build a new one on every rank");
        }
    }

    // Runs the body of a host collective op. A wait that failed inside it left a fatal code in the status words
    // (status: this rank's, may be null): that poisons, and the error goes on to the caller (a timeout with what the
    // peer is doing instead, when it waits in another object of this rank on the same transport).
    template <typename Body>
    void run(const int32_t* status, Body&& body) {
        try {
            body();
        } catch (const Error& e) {
            if (status == nullptr || !sync::status_is_fatal(load(status[sync::kStatusCode]))) throw;
            const std::string elsewhere =
                e.category() == ErrorCategory::kTimeout ? peer_elsewhere(load(status[sync::kStatusPeer])) : "";
            if (elsewhere.empty()) {
                if (reason_.empty()) reason_ = e.message();
                throw;
            }
            if (reason_.empty()) reason_ = e.message() + "; " + elsewhere;
            FLATEP_THROW(ErrorCategory::kTimeout, e.message(), "; ", elsewhere);
        }
    }

    bool poisoned() const { return !reason_.empty(); }
    const std::string& reason() const { return reason_; }

  private:
    template <typename T>
    static T load(const T& word) {
        return std::atomic_ref<T>(const_cast<T&>(word)).load(std::memory_order_acquire);
    }

    // "peer p was in <op> of another Buffer ..." when peer p is ahead of this rank in another registered
    // object of this rank on the same transport (so it waits there, for this rank); "" otherwise.
    std::string peer_elsewhere(int peer) const {
        std::lock_guard<std::mutex> lock(registry_mutex());
        if (peer < 0 || peer >= kMaxRanks || site_.flags == nullptr) return "";
        for (const CollectiveGuard* other : registry()) {
            if (other == this || other->site_.transport != site_.transport) continue;
            const uint64_t word = load(other->site_.flags[peer]);
            // Ahead of this rank there (an abort word too: the peer timed out waiting there itself).
            if (sync::flag_epoch(word) <= *other->site_.epoch) continue;
            return detail::concat("peer ", peer, " was in ", sync::op_name(sync::OpId(sync::flag_op(word))),
                                  " of another ", other->what_, " on this transport (step ", word & sync::kFlagStepMask,
                                  " mod 2^16): every rank must call the same objects in the same order");
        }
        return "";
    }
    static std::vector<const CollectiveGuard*>& registry() {
        static std::vector<const CollectiveGuard*> all;
        return all;
    }
    static std::mutex& registry_mutex() {
        static std::mutex mutex;
        return mutex;
    }

    const char* what_;
    std::string reason_;  // the first failure's text; empty while usable
    CollectiveSite site_;
};

}  // namespace flatep
