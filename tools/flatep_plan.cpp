// flatep-plan: computes the FlatEP plan of a count matrix and prints it as JSON.
//
//   flatep-plan [--planner greedy|balanced] [--allow-partial] [--compact] [FILE]
//
// Reads {"R":..,"E":..,"S":..,"K":..,"align":..,"capacity_factor":..,"tpe":[[...],...]} from FILE or stdin (see
// plan_request.hpp). Prints the config echo, the planner, alloc[R][E], keep[R][E], group_row[R][E],
// slot_expert[R][epn], cu_seqlens[R][2*epn] and stats. Any invalid input or option exits 1 with exactly one line
// on stderr: "flatep-plan: error: <message>"; so does an input that is not a readable file (a directory, a missing
// or unreadable file) or larger than kMaxInputBytes. It never aborts, and its memory stays bounded (plan_request.hpp).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "flatep/error.hpp"
#include "json.hpp"
#include "layout/layout.hpp"
#include "plan_request.hpp"
#include "planner/planner.hpp"

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

void write_matrix(flatep::json::Writer& w, const char* name, const int32_t* data, int rows, int cols) {
    w.key(name);
    w.begin_array();
    for (int r = 0; r < rows; ++r) {
        w.begin_array();
        for (int c = 0; c < cols; ++c) w.value(int64_t(data[int64_t(r) * cols + c]));
        w.end_array();
    }
    w.end_array();
}

void write_vector(flatep::json::Writer& w, const char* name, const int32_t* data, int n) {
    w.key(name);
    w.begin_array();
    for (int i = 0; i < n; ++i) w.value(int64_t(data[i]));
    w.end_array();
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
    "usage: flatep-plan [--planner greedy|balanced] [--allow-partial] [--compact] [FILE]\n"
    "Reads a count matrix as JSON {\"R\",\"E\",\"S\",\"K\",\"align\"?,\"capacity_factor\"?,\"tpe\"} from FILE or\n"
    "stdin and prints the FlatEP plan as JSON.\n";

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
            if (i + 1 >= argc) fail("option --planner needs a value (greedy or balanced)");
            const std::string v = argv[++i];
            if (v == "greedy") {
                kind = flatep::PlannerKind::kGreedy;
            } else if (v == "balanced") {
                kind = flatep::PlannerKind::kBalanced;
            } else {
                fail("unknown planner \"" + flatep::json::printable(v) + "\" (expected greedy or balanced)");
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
        const flatep::Layout l = flatep::make_layout(c);
        flatep::HostPlan plan(l);
        std::copy(req.tpe.begin(), req.tpe.end(), plan.view.tpe_all);
        flatep::plan_counts(l, kind, plan.view);
        const std::string bad = flatep::check_plan(l, plan.view);
        if (!bad.empty()) fail("internal error: the plan violates its invariants: " + bad);

        const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
        flatep::json::Writer w(compact);
        w.begin_object();
        w.key("R");
        w.value(R);
        w.key("E");
        w.value(E);
        w.key("S");
        w.value(l.num_tokens);
        w.key("K");
        w.value(l.topk);
        w.key("align");
        w.value(l.align);
        w.key("capacity_factor");
        w.value(c.capacity_factor);
        w.key("capacity");
        w.value(l.capacity);
        w.key("experts_per_rank");
        w.value(epn);
        w.key("num_recv_rows");
        w.value(l.num_recv_rows);
        w.key("exact");
        w.value(l.exact);
        w.key("planner");
        w.value(flatep::planner_name(kind));
        write_matrix(w, "alloc", plan.view.alloc, R, E);
        write_matrix(w, "keep", plan.view.keep, R, E);
        write_matrix(w, "group_row", plan.view.group_row, R, E);
        write_matrix(w, "slot_expert", plan.view.slot_expert, R, epn);
        write_matrix(w, "cu_seqlens", plan.view.cu_seqlens, R, 2 * epn);
        const flatep::PlanStats& st = *plan.view.stats;
        w.key("stats");
        w.begin_object();
        w.key("entries_total");
        w.value(st.entries_total);
        w.key("entries_moved");
        w.value(st.entries_moved);
        w.key("entries_on_source");
        w.value(st.entries_on_source);
        w.key("max_load_before");
        w.value(st.max_load_before);
        w.key("max_load_after");
        w.value(st.max_load_after);
        w.key("min_load_after");
        w.value(st.min_load_after);
        w.key("total_replicas");
        w.value(st.total_replicas);
        w.key("makespan");
        w.value(st.makespan);
        w.key("max_replicas_in");
        w.value(st.max_replicas_in);
        w.key("max_replicas_out");
        w.value(st.max_replicas_out);
        write_vector(w, "loads_before", st.loads_before, R);
        write_vector(w, "loads_after", st.loads_after, R);
        write_vector(w, "replicas_in", st.replicas_in, R);
        write_vector(w, "replicas_out", st.replicas_out, R);
        w.end_object();
        w.end_object();
        std::fwrite(w.str().data(), 1, w.str().size(), stdout);
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
