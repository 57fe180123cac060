// flatep-plan: computes the FlatEP plan of a count matrix and prints it as JSON.
//
//   flatep-plan [--planner greedy|balanced|owner] [--allow-partial] [--compact] [FILE]
//
// Reads {"R":..,"E":..,"S":..,"K":..,"align":..,"capacity_factor":..,"num_slots":..,"view_stride":..,
// "tpe":[[...],...]} from FILE or stdin (see plan_request.hpp). Prints the config echo (with the layout's B, Q, whether
// it serves and its number of groups G), the planner, alloc[R][E], keep[R][E], group_row[R][E], slot_expert[R][epn],
// cu_seqlens[R][G] and stats. Any invalid input or option exits 1 with exactly one line
// on stderr: "flatep-plan: error: <message>"; so does an input that is not a readable file (a directory, a missing
// or unreadable file) or larger than kMaxInputBytes. It never aborts, and its memory stays bounded (plan_request.hpp).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "flatep/error.hpp"
#include "internal/api.hpp"
#include "json.hpp"
#include "plan_request.hpp"

namespace {

// File paths are the user's own text: quote them whole in errors (up to a Linux PATH_MAX).
constexpr size_t kMaxPathBytes = 4096;
// The largest input read: a request of plan_request.hpp's kMaxRequestCounts counts takes about 12 MB written out.
constexpr size_t kMaxInputBytes = size_t(32) << 20;

[[noreturn]] void fail(const std::string& message) {
    // One line, whatever the message holds.
    std::string line = message;
    for (char& c : line)
        if (c == '\n' || c == '\r') c = ' ';
    std::fprintf(stderr, "flatep-plan: error: %s\n", line.c_str());
    std::exit(1);
}

using Json = nlohmann::ordered_json;  // members in the order written

Json matrix(const int32_t* data, int rows, int cols) {
    Json m = Json::array();
    for (int r = 0; r < rows; ++r)
        m.push_back(std::vector<int32_t>(data + int64_t(r) * cols, data + int64_t(r + 1) * cols));
    return m;
}

// Indented JSON whose arrays of scalars stay on one line, so that a matrix reads as one row per line.
void write_indented(std::string& out, const Json& v, int depth) {
    if (v.is_array() && std::none_of(v.begin(), v.end(), [](const Json& x) { return x.is_structured(); })) {
        out += '[';
        for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i].dump();
        out += ']';
        return;
    }
    if (!v.is_structured() || v.empty()) {
        out += v.dump();
        return;
    }
    out += v.is_object() ? '{' : '[';
    for (auto it = v.begin(); it != v.end(); ++it) {
        out += it == v.begin() ? "\n" : ",\n";
        out.append(size_t(depth + 1) * 2, ' ');
        if (v.is_object()) out += Json(it.key()).dump() + ": ";
        write_indented(out, *it, depth + 1);
    }
    out += '\n';
    out.append(size_t(depth) * 2, ' ');
    out += v.is_object() ? '}' : ']';
}

const std::string kInputLimit = "flatep-plan's input limit of " + std::to_string(kMaxInputBytes) + " bytes (32 MiB)";

// The whole input of `path` ("" or "-": stdin) into `text`; "" or the one-line error. A regular file's size is
// checked before it is read; any other input is read up to one byte past the limit.
std::string read_input(const std::string& path, std::string& text) {
    const bool from_stdin = path.empty() || path == "-";
    const std::string name = from_stdin ? "stdin" : flatep::json::printable(path, kMaxPathBytes);
    const int fd = from_stdin ? STDIN_FILENO : ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return "cannot open " + name + ": " + std::strerror(errno);
    struct CloseAtExit {
        int fd;
        bool owned;
        ~CloseAtExit() {
            if (owned) ::close(fd);
        }
    } guard{fd, !from_stdin};
    struct stat st {};
    if (::fstat(fd, &st) != 0) return "cannot read " + name + ": " + std::strerror(errno);
    if (S_ISDIR(st.st_mode)) return name + " is a directory, not a request file";
    if (S_ISREG(st.st_mode) && uint64_t(st.st_size) > kMaxInputBytes)
        return name + " is " + std::to_string(st.st_size) + " bytes, above " + kInputLimit;
    char chunk[1 << 16];
    for (;;) {
        const ssize_t n = ::read(fd, chunk, sizeof(chunk));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return "cannot read " + name + ": " + std::strerror(errno);
        if (n == 0) return "";
        text.append(chunk, size_t(n));
        if (text.size() > kMaxInputBytes) return name + " holds more than " + kInputLimit;
    }
}

const char* kUsage =
    "usage: flatep-plan [--planner greedy|balanced|owner] [--allow-partial] [--compact] [FILE]\n"
    "Reads a count matrix as JSON {\"R\",\"E\",\"S\",\"K\",\"align\"?,\"capacity_factor\"?,\"num_slots\"?,\n"
    "\"view_stride\"?,\"tpe\"} from FILE or stdin and prints the FlatEP plan as JSON.\n";

}  // namespace

int main(int argc, char** argv) {
    flatep::PlannerKind kind = flatep::PlannerKind::kBalanced;
    bool allow_partial = false, compact = false;
    std::string path;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--help" || arg == "-h") {
            std::fputs(kUsage, stdout);
            return 0;
        } else if (arg == "--planner") {
            if (i + 1 >= argc) fail("option --planner needs a value (greedy, balanced or owner)");
            const std::string v = argv[++i];
            if (v == "greedy") {
                kind = flatep::PlannerKind::kGreedy;
            } else if (v == "balanced") {
                kind = flatep::PlannerKind::kBalanced;
            } else if (v == "owner") {
                kind = flatep::PlannerKind::kOwner;
            } else {
                fail("unknown planner \"" + flatep::json::printable(v) + "\" (expected greedy, balanced or owner)");
            }
        } else if (arg == "--allow-partial") {
            allow_partial = true;
        } else if (arg == "--compact") {
            compact = true;
        } else if (arg.size() > 1 && arg[0] == '-') {
            fail("unknown option " + flatep::json::printable(arg));
        } else if (!path.empty()) {
            fail("more than one input file given");
        } else {
            path = arg;
        }
    }
    try {
        std::string text;
        const std::string read_error = read_input(path, text);
        if (!read_error.empty()) fail(read_error);
        flatep::PlanRequest req;
        const std::string err = flatep::parse_plan_request(text, allow_partial, req);
        if (!err.empty()) fail(err);
        const flatep::Config& c = req.config;
        const flatep::Layout l = flatep::make_layout(c, kind, req.view);  // the owner planner: capacity R*S*K
        flatep::planner::HostPlan plan(l);
        std::copy(req.tpe.begin(), req.tpe.end(), plan.view.tpe_all);
        flatep::planner::plan_counts(l, kind, plan.view);
        const std::string bad = flatep::planner::check_plan(l, plan.view);
        if (!bad.empty()) fail("internal error: the plan violates its invariants: " + bad);

        const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
        const flatep::PlanStats& st = *plan.view.stats;
        const Json stats = {
            {"entries_total", st.entries_total},
            {"entries_moved", st.entries_moved},
            {"entries_on_source", st.entries_on_source},
            {"max_load_before", st.max_load_before},
            {"max_load_after", st.max_load_after},
            {"min_load_after", st.min_load_after},
            {"total_replicas", st.total_replicas},
            {"makespan", st.makespan},
            {"max_replicas_in", st.max_replicas_in},
            {"max_replicas_out", st.max_replicas_out},
            {"loads_before", std::vector<int32_t>(st.loads_before, st.loads_before + R)},
            {"loads_after", std::vector<int32_t>(st.loads_after, st.loads_after + R)},
            {"replicas_in", std::vector<int32_t>(st.replicas_in, st.replicas_in + R)},
            {"replicas_out", std::vector<int32_t>(st.replicas_out, st.replicas_out + R)},
        };
        const Json out = {
            {"R", R},
            {"E", E},
            {"S", l.num_tokens},
            {"K", l.topk},
            {"align", l.align},
            {"capacity_factor", c.capacity_factor},
            {"capacity", l.capacity},
            {"experts_per_rank", epn},
            {"num_recv_rows", l.num_recv_rows},
            {"exact", l.exact},
            {"num_slots", l.num_slots},
            {"view_stride", l.view_stride},
            {"serving", l.serving},
            {"num_groups", l.num_groups()},
            {"planner", flatep::planner_name(kind)},
            {"alloc", matrix(plan.view.alloc, R, E)},
            {"keep", matrix(plan.view.keep, R, E)},
            {"group_row", matrix(plan.view.group_row, R, E)},
            {"slot_expert", matrix(plan.view.slot_expert, R, epn)},
            {"cu_seqlens", matrix(plan.view.cu_seqlens, R, l.num_groups())},
            {"stats", stats},
        };
        std::string printed = compact ? out.dump() : "";
        if (!compact) write_indented(printed, out, 0);
        std::fwrite(printed.data(), 1, printed.size(), stdout);
        std::fputc('\n', stdout);
        if (std::fflush(stdout) != 0) fail("cannot write the output");
    } catch (const flatep::Error& e) {
        fail(e.message());
    } catch (const std::bad_alloc&) {
        fail("out of memory");
    } catch (const std::exception& e) {
        fail(e.what());
    } catch (...) {
        fail("internal error: an unknown exception");
    }
    return 0;
}
