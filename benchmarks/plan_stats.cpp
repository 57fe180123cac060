// flatep-plan-stats: quality and host time of the planners (one-donor greedy vs the default balanced planner) on
// generated routings over a maxvio sweep. Prints a table and writes CSV.
//
//   flatep-plan-stats [--R 8] [--E 384] [--S 8192] [--K 8] [--align 128] [--capacity-factor 1.0]
//                     [--maxvio 0.2,1,10,20] [--seeds 3] [--repeats 21] [--csv plan_stats.csv]
//
// sigma for each target maxvio is found once (routing::sigma_for_maxvio with seed 1) and every seed then draws
// its own routing with that sigma; the realised maxvio of each draw is reported next to the target.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "routing/routing.hpp"

namespace {

struct Options {
    flatep::Config config;
    std::vector<double> maxvio{0.2, 1.0, 10.0, 20.0};
    int seeds = 3;
    int repeats = 21;
    std::string csv = "plan_stats.csv";
};

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr, "flatep-plan-stats: error: %s\n", message.c_str());
    std::exit(1);
}

Options parse(int argc, char** argv) {
    Options o;
    o.config.num_ranks = 8;
    o.config.num_experts = 384;
    o.config.num_tokens = 8192;
    o.config.topk = 8;
    o.config.hidden = 8;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--help" || flag == "-h") {
            std::printf(
                "usage: flatep-plan-stats [--R n] [--E n] [--S n] [--K n] [--align n] [--capacity-factor f]\n"
                "                         [--maxvio a,b,..] [--seeds n] [--repeats n] [--csv path]\n");
            std::exit(0);
        }
        if (i + 1 >= argc) usage_error("option " + flag + " needs a value");
        const std::string value = argv[++i];
        char* end = nullptr;
        auto as_int = [&]() {
            const long v = std::strtol(value.c_str(), &end, 10);
            if (*end != '\0' || v < 0 || v > (1L << 30)) usage_error("bad integer for " + flag + ": " + value);
            return int(v);
        };
        if (flag == "--R") {
            o.config.num_ranks = as_int();
        } else if (flag == "--E") {
            o.config.num_experts = as_int();
        } else if (flag == "--S") {
            o.config.num_tokens = as_int();
        } else if (flag == "--K") {
            o.config.topk = as_int();
        } else if (flag == "--align") {
            o.config.align = as_int();
        } else if (flag == "--seeds") {
            o.seeds = std::max(1, as_int());
        } else if (flag == "--repeats") {
            o.repeats = std::max(1, as_int());
        } else if (flag == "--capacity-factor") {
            o.config.capacity_factor = std::strtod(value.c_str(), &end);
            if (*end != '\0') usage_error("bad number for --capacity-factor: " + value);
        } else if (flag == "--maxvio") {
            o.maxvio.clear();
            std::stringstream ss(value);
            std::string item;
            while (std::getline(ss, item, ',')) {
                o.maxvio.push_back(std::strtod(item.c_str(), &end));
                if (*end != '\0') usage_error("bad number in --maxvio: " + item);
            }
        } else if (flag == "--csv") {
            o.csv = value;
        } else {
            usage_error("unknown option " + flag);
        }
    }
    return o;
}

struct Row {
    std::string planner;
    double maxvio_target, maxvio_real;
    uint64_t seed;
    double max_load_before;  // multiple of S*K
    int makespan, total_replicas, max_in, max_out;
    int64_t entries_moved, entries_total;
    double local_fraction;
    double time_us;
};

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options o = parse(argc, argv);
        const flatep::Layout l = flatep::make_layout(o.config);
        const int R = l.num_ranks, E = l.num_experts;
        const double sk = double(l.num_entries());
        std::vector<Row> rows;
        for (double target : o.maxvio) {
            const double sigma = flatep::routing::sigma_for_maxvio(target, R, E, l.num_tokens, l.topk, 1);
            for (int si = 0; si < o.seeds; ++si) {
                const uint64_t seed = uint64_t(si) + 1;
                const std::vector<int32_t> counts =
                    flatep::routing::generate_counts(R, E, l.num_tokens, l.topk, sigma, seed);
                const double real = flatep::routing::maxvio(counts.data(), R, E);
                for (flatep::PlannerKind kind : {flatep::PlannerKind::kGreedy, flatep::PlannerKind::kBalanced}) {
                    flatep::HostPlan plan(l);
                    std::copy(counts.begin(), counts.end(), plan.view.tpe_all);
                    std::vector<double> times;
                    for (int rep = 0; rep < o.repeats; ++rep) {
                        const auto t0 = std::chrono::steady_clock::now();
                        flatep::plan_counts(l, kind, plan.view);
                        const auto t1 = std::chrono::steady_clock::now();
                        times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
                    }
                    std::sort(times.begin(), times.end());
                    const std::string bad = flatep::check_plan(l, plan.view);
                    if (!bad.empty()) {
                        std::fprintf(stderr, "flatep-plan-stats: error: invalid %s plan (maxvio %g seed %llu): %s\n",
                                     flatep::planner_name(kind), target, (unsigned long long)seed, bad.c_str());
                        return 1;
                    }
                    const flatep::PlanStats& st = *plan.view.stats;
                    rows.push_back(Row{flatep::planner_name(kind), target, real, seed, st.max_load_before / sk,
                                       st.makespan, st.total_replicas, st.max_replicas_in, st.max_replicas_out,
                                       st.entries_moved, st.entries_total,
                                       st.entries_total ? double(st.entries_on_source) / double(st.entries_total) : 1,
                                       times[times.size() / 2]});
                }
            }
        }
        std::printf("planner statistics: R=%d E=%d S=%d K=%d align=%d capacity_factor=%g (C=%d), %d seeds per maxvio\n",
                    R, E, l.num_tokens, l.topk, l.align, o.config.capacity_factor, l.capacity, o.seeds);
        std::printf("%-9s %6s %6s %4s %9s %3s %8s %6s %7s %11s %7s %9s\n", "planner", "maxvio", "real", "seed",
                    "maxload", "P", "replicas", "in/out", "", "moved", "local", "time_us");
        for (const Row& r : rows)
            std::printf("%-9s %6.1f %6.2f %4llu %8.3fx %3d %8d %3d/%-3d %7s %11lld %7.4f %9.1f\n", r.planner.c_str(),
                        r.maxvio_target, r.maxvio_real, (unsigned long long)r.seed, r.max_load_before, r.makespan,
                        r.total_replicas, r.max_in, r.max_out, "", (long long)r.entries_moved, r.local_fraction,
                        r.time_us);
        // Per-maxvio summary: balanced vs greedy (means over seeds).
        std::printf("\nsummary (mean over seeds): P and replicas, balanced vs greedy\n");
        std::printf("%6s %9s %9s %12s %12s %14s %14s\n", "maxvio", "P_greedy", "P_flatep", "rep_greedy", "rep_flatep",
                    "moved_greedy", "moved_flatep");
        for (double target : o.maxvio) {
            double pg = 0, pb = 0, rg = 0, rb = 0, mg = 0, mb = 0;
            int n = 0;
            for (const Row& r : rows) {
                if (r.maxvio_target != target) continue;
                const bool g = r.planner == "greedy";
                (g ? pg : pb) += r.makespan;
                (g ? rg : rb) += r.total_replicas;
                (g ? mg : mb) += double(r.entries_moved);
                n += g;
            }
            std::printf("%6.1f %9.2f %9.2f %12.2f %12.2f %14.0f %14.0f\n", target, pg / n, pb / n, rg / n, rb / n,
                        mg / n, mb / n);
        }
        std::ofstream csv(o.csv);
        if (!csv) usage_error("cannot write " + o.csv);
        csv << "planner,R,E,S,K,capacity_factor,maxvio_target,maxvio_real,seed,max_load_before_x,makespan,"
               "total_replicas,max_replicas_in,max_replicas_out,entries_moved,entries_total,local_fraction,"
               "host_time_us\n";
        for (const Row& r : rows)
            csv << r.planner << ',' << R << ',' << E << ',' << l.num_tokens << ',' << l.topk << ','
                << o.config.capacity_factor << ',' << r.maxvio_target << ',' << r.maxvio_real << ',' << r.seed << ','
                << r.max_load_before << ',' << r.makespan << ',' << r.total_replicas << ',' << r.max_in << ','
                << r.max_out << ',' << r.entries_moved << ',' << r.entries_total << ',' << r.local_fraction << ','
                << r.time_us << '\n';
        std::printf("\nwrote %s\n", o.csv.c_str());
    } catch (const flatep::Error& e) {
        std::fprintf(stderr, "flatep-plan-stats: error: %s\n", e.message().c_str());
        return 1;
    }
    return 0;
}
