// The one flag set of the C++ benchmark drivers (design §9). CLI11 parses; this header keeps it out of the drivers
// (and out of nvcc). Every driver takes the same names for the same things:
//
//   --preset NAME[,NAME..]       named sweeps (presets() below); a driver has its own default
//   --ranks --tokens --hidden --ffn --experts --topk --align --capacity-factor
//                                the shape: R, S, H, H', E, K, row alignment, capacity factor; a list a,b,.. sweeps
//                                (the cases are the product of the lists), a value replaces the preset's
//   --maxvio a,b,..  | --sigma a,b,..
//                                the routing's skew: target maxvios (the generator's sigma found by bisection) or
//                                the sigmas themselves (0: uniform); one replaces the other's preset values
//   --iters N --warmup N --csv PATH --memory-gib G
//
// and driver-specific flags on top (add()). An unknown flag, a missing or malformed value, or a value out of range
// ends the program with "PROGRAM: error: ..." on stderr and exit status 2; --help prints every flag and the presets.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flatep/config.hpp"

namespace flatep::bench {

// One point of a sweep.
struct Shape {
    int ranks = 8, tokens = 8192, hidden = 7168, ffn = 2048, experts = 384, topk = 8, align = 128;
    double capacity_factor = 1.0;

    Config config() const;      // not validated (see Flags::validated)
    std::string label() const;  // R8_S8192_E384_H7168_K8 (and _A.. / _F.. where not the defaults)
};

// The routing's skew: a target maxvio or the generator's sigma itself.
struct Skew {
    bool is_sigma = true;
    double value = 0;  // the sigma (is_sigma) or the target maxvio

    // The sigma to draw routings with at shape s: for a target, routing::sigma_for_maxvio's bisection (seed: its
    // routing seed) on the shape's R ranks, or on min(R, bisection_ranks) when that is > 0 (each try draws R*S
    // tokens: seconds at E=896; the popularity does not depend on R, more ranks only average the realised maxvio,
    // which every driver reports beside the target); else value.
    double sigma_for(const Shape& s, uint64_t seed, int bisection_ranks = 0) const;
    double maxvio_target() const { return is_sigma ? -1.0 : value; }  // CSV column: -1 when given as sigma
};

// A named sweep: the values of every list.
struct Preset {
    std::string name;
    std::string description;
    std::vector<int> ranks, tokens, hidden, ffn, experts, topk, align;
    std::vector<double> capacity_factor;
    std::vector<double> maxvio, sigma;  // one of the two is empty
};

// The presets every driver knows, by name:
//   moonep        MoonEP's config (design §9): R=8 S=8192 E=384 H=7168 K=8, maxvio 0.2,1,10,20
//   deepep        DeepEP's config: R=8 S=4096 E=256 H=7168 K=8, uniform routing (sigma 0)
//   moonep-sweep  MoonEP's own sweep (issue 22): S=8192 E=896, H 3584,7168, K 8,16, R 8,16,32,64, maxvio 1,5,20
//   k3            Kimi K3's shape on 8 ranks: R=8 S=8192 E=896 H=7168 K 8,16, maxvio 1,5,20
const std::vector<Preset>& presets();

// One case of a sweep: the preset it came from, its shape and skew.
struct Case {
    std::string preset;
    Shape shape;
    Skew skew;
};

class Flags {
  public:
    Flags(std::string program, std::string description);
    ~Flags();
    Flags(const Flags&) = delete;
    Flags& operator=(const Flags&) = delete;

    // The sweep: --preset, the shape lists, --maxvio / --sigma. default_presets: what runs without --preset.
    // ffn and align are the drivers' defaults where a preset does not set them (none of the presets above does).
    void add_sweep(std::vector<std::string> default_presets, int default_ffn = 2048);
    // One shape (a driver that runs one point): the same shape flags, one value each, defaults from *shape.
    void add_shape(Shape* shape);
    void add_timing(int* iters, int* warmup);  // --iters (>= 1) --warmup (>= 0)
    void add_csv(std::string* path);
    // --memory-gib G (>= 0): the device memory a driver checks its cases' estimates against (common/memory.hpp)
    // instead of the free bytes cudaMemGetInfo reports; 0, the default: those.
    void add_memory(double* gib);

    // Driver-specific flags (the current value is the default shown by --help). Lists take a,b,.. .
    void add(const std::string& name, int* value, const std::string& help, int min = INT32_MIN, int max = INT32_MAX);
    void add(const std::string& name, uint64_t* value, const std::string& help);
    void add(const std::string& name, double* value, const std::string& help);
    void add(const std::string& name, std::string* value, const std::string& help,
             const std::vector<std::string>& choices = {});
    void add(const std::string& name, std::vector<double>* value, const std::string& help);
    void add(const std::string& name, std::vector<int>* value, const std::string& help);
    void add(const std::string& name, std::vector<std::string>* value, const std::string& help,
             const std::vector<std::string>& choices = {});
    void add_switch(const std::string& name, bool* value, const std::string& help);  // no value: sets true

    // Parses argv (exits: 0 after --help, 2 on an error). Then:
    void parse(int argc, char** argv);
    bool given(const std::string& name) const;  // the flag was on the command line
    // add_sweep: the presets' cases, the command line's lists replacing theirs, in the order preset, ranks, experts,
    // hidden, topk, tokens, ffn, align, capacity factor, skew (the last varies fastest).
    std::vector<Case> cases() const;
    // The shape's Config, validated: an invalid one ends the program naming the shape and the field.
    Config validated(const Shape& shape) const;
    [[noreturn]] void fail(const std::string& message) const;  // "PROGRAM: error: message", exit 2

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace flatep::bench
