// Socket rendezvous: ranks launched separately find each other through abstract Unix sockets named from a job id.
#include <memory>

#include "common/check.hpp"
#include "common/env.hpp"
#include "flatep/ipc.hpp"
#include "transport/bootstrap_mesh.hpp"

namespace flatep {

std::shared_ptr<Bootstrap> make_socket_bootstrap(const std::string& job_id, int rank, int num_ranks, double timeout_s) {
    FLATEP_CHECK(!job_id.empty() && job_id.size() <= 64, "socket rendezvous: job_id must be 1..64 characters, got '",
                 job_id, "'");
    for (const char c : job_id) {
        const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                        c == '_' || c == '-';
        FLATEP_CHECK(ok, "socket rendezvous: job_id may only hold [A-Za-z0-9._-], got '", job_id, "'");
    }
    FLATEP_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "socket rendezvous: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", num_ranks);
    FLATEP_CHECK(rank >= 0 && rank < num_ranks, "socket rendezvous: rank ", rank, " outside [0, ", num_ranks, ")");
    timeout_s = env::resolve_timeout("socket rendezvous", timeout_s);

    transport::ipc::MeshSpec spec;
    spec.name_prefix = "flatep-rdv-" + job_id;
    spec.token = job_id;
    spec.rank = rank;
    spec.size = num_ranks;
    spec.timeout_s = timeout_s;
    spec.what = "socket rendezvous '" + job_id + "'";
    transport::ipc::Fd listener = transport::ipc::listen_abstract(transport::ipc::mesh_socket_name(spec, rank), 128);
    std::vector<transport::ipc::Fd> sockets = transport::ipc::build_mesh(spec, listener.get(), nullptr);
    listener.reset();
    return std::make_shared<transport::MeshBootstrap>(rank, num_ranks, std::move(sockets), timeout_s, spec.what);
}

std::shared_ptr<Bootstrap> make_socket_bootstrap_from_env(double timeout_s) {
    const std::string job_id = env::job_id();
    const std::string rank = env::rank_text();
    const std::string num_ranks = env::num_ranks_text();
    FLATEP_CHECK(!job_id.empty() && !rank.empty() && !num_ranks.empty(),
                 "socket rendezvous: set FLATEP_JOB_ID, FLATEP_RANK and FLATEP_NUM_RANKS (got '", job_id, "', '", rank,
                 "', '", num_ranks, "')");
    auto parse = [](const std::string& name, const std::string& text) {
        size_t used = 0;
        int value = -1;
        try {
            value = std::stoi(text, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        FLATEP_CHECK(used == text.size() && value >= 0, name, " must be a non-negative integer, got '", text, "'");
        return value;
    };
    return make_socket_bootstrap(job_id, parse("FLATEP_RANK", rank), parse("FLATEP_NUM_RANKS", num_ranks), timeout_s);
}

}  // namespace flatep
