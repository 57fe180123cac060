// Environment variables. Each FLATEP_* variable is declared here once and listed in the README.
#pragma once

#include <string>

namespace flatep::env {

// Every timeout is a finite number of seconds in (0, kMaxTimeoutSeconds]: one day, far above any wait a healthy job
// makes, and small enough that a deadline computed from it never overflows a clock.
inline constexpr double kMaxTimeoutSeconds = 86400.0;

// FLATEP_TIMEOUT_S: seconds any cross-rank wait may take before it fails with a timeout error (default 100); a value
// outside (0, kMaxTimeoutSeconds] is an error naming the variable and its text.
double timeout_seconds();
// Returns `seconds` when it is a finite number in (0, kMaxTimeoutSeconds]; otherwise throws kInvalidArgument
// "<what>: <name> must be ..., got <seconds>". NaN and infinity are errors, never "no timeout".
double check_timeout(const std::string& what, const char* name, double seconds);
// The timeout a constructor runs with: FLATEP_TIMEOUT_S when `seconds` is 0 (the API's default argument), else
// check_timeout(what, "timeout_s", seconds) -- so a negative value is an error, never the default.
double resolve_timeout(const std::string& what, double seconds);
// FLATEP_DEBUG: 1 = check the device status word after every op (reports bad expert ids at once) and the layout
// invariants (layout/invariants.hpp: read once per process there).
bool debug();
// FLATEP_NUM_SMS: the SM budget objects start with (Buffer::num_sms, ExpertPools::num_sms): the most thread blocks
// one GPU launch of an op uses (0 = no cap; default 0). Set it when several ranks' kernels share one GPU.
int num_sms();
// The largest SM budget accepted (flatep::kMaxNumSms, include/flatep/launch.hpp).
inline constexpr int kMaxNumSms = 1 << 20;
// Returns `num_sms` when it is in [0, kMaxNumSms]; otherwise throws kInvalidArgument
// "<what>: num_sms (the most thread blocks one launch uses, 0 = no cap) must be in [0, 1048576], got <num_sms>".
int check_num_sms(const char* what, long long num_sms);
// FLATEP_LOG_LEVEL: 0 quiet, 1 warnings (default), 2 info, 3 debug.
int log_level();
// Socket rendezvous of separately launched ranks (flatep::make_socket_bootstrap_from_env, include/flatep/ipc.hpp):
// FLATEP_JOB_ID: the job's name, 1..64 characters of [A-Za-z0-9._-], unique among the machine's running jobs.
// FLATEP_RANK: this process's rank; FLATEP_NUM_RANKS: the number of ranks. Each returns "" when unset.
std::string job_id();
std::string rank_text();
std::string num_ranks_text();

// Raw access used by the functions above; exposed for tests. Returns fallback when unset or empty.
std::string get(const char* name, const std::string& fallback);

}  // namespace flatep::env
