#include "transport/bootstrap_mesh.hpp"

#include <unistd.h>

#include <cstring>

#include "common/check.hpp"
#include "common/env.hpp"

namespace flatep::transport {

MeshBootstrap::MeshBootstrap(int rank, int size, std::vector<ipc::Fd> sockets, double timeout_s, std::string what)
    : rank_(rank), size_(size), sockets_(std::move(sockets)), timeout_s_(timeout_s), what_(std::move(what)) {
    FLATEP_CHECK(size >= 1 && size <= kMaxRanks, what_, ": num_ranks must be in [1, ", kMaxRanks, "], got ", size);
    FLATEP_CHECK(rank >= 0 && rank < size, what_, ": rank ", rank, " outside [0, ", size, ")");
    FLATEP_CHECK(static_cast<int>(sockets_.size()) == size, what_, ": ", sockets_.size(), " sockets for ", size,
                 " ranks");
    env::check_timeout(what_, "timeout_s", timeout_s);
    for (const ipc::Fd& fd : sockets_) raw_sockets_.push_back(fd.get());
    pids_.assign(size, 0);
    pids_[rank] = ::getpid();
    const int32_t my_pid = static_cast<int32_t>(::getpid());
    const std::vector<std::string> all =
        all_gather(std::string(reinterpret_cast<const char*>(&my_pid), sizeof(my_pid)));
    for (int r = 0; r < size; ++r) {
        int32_t pid = 0;
        FLATEP_CHECK_RUNTIME(all[r].size() == sizeof(pid), what_, ": rank ", r, " sent a malformed pid");
        std::memcpy(&pid, all[r].data(), sizeof(pid));
        pids_[r] = pid;
    }
}

std::string MeshBootstrap::name_peer(int rank) const {
    return pids_[rank] > 0 ? detail::concat("rank ", rank, " (pid ", pids_[rank], ")") : detail::concat("rank ", rank);
}

std::vector<std::string> MeshBootstrap::all_gather(const std::string& blob) {
    const uint32_t call_idx = num_calls_++;
    std::vector<std::string> result(size_);
    if (size_ > 1) {
        std::vector<ipc::Message> out(size_);
        for (int p = 0; p < size_; ++p)
            if (p != rank_) out[p].payload = blob;
        std::vector<ipc::Message> in =
            ipc::exchange(raw_sockets_, rank_, out, call_idx, timeout_s_,
                          detail::concat(what_, " all_gather #", call_idx, " on rank ", rank_),
                          [this](int peer) { return name_peer(peer); });
        for (int p = 0; p < size_; ++p) {
            ipc::close_quietly(in[p].fd);  // a bootstrap message carries no descriptor
            result[p] = std::move(in[p].payload);
        }
    }
    result[rank_] = blob;
    return result;
}

}  // namespace flatep::transport
