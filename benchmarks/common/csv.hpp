// CSV output of the benchmark drivers: a header of named columns, then rows with exactly that many cells.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "internal/api.hpp"

namespace flatep::bench {

// v with `decimals` digits after the point ("%.*f"); fixed(v) alone is "%g".
inline std::string fixed(double v, int decimals) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
    return buf;
}

class CsvWriter {
  public:
    // Opens path for writing (append: after what the file holds; the header only when it was empty or absent) and
    // writes the header. Throws (flatep::Error) when the file cannot be opened.
    CsvWriter(const std::string& path, std::vector<std::string> columns, bool append = false)
        : path_(path), columns_(std::move(columns)) {
        bool fresh = true;
        if (append) {
            if (FILE* f = std::fopen(path.c_str(), "r")) {
                std::fseek(f, 0, SEEK_END);
                fresh = std::ftell(f) <= 0;
                std::fclose(f);
            }
        }
        file_ = std::fopen(path.c_str(), append ? "a" : "w");
        FLATEP_CHECK_RUNTIME(file_ != nullptr, "cannot write the CSV file ", path);
        if (fresh) write_line(columns_);
    }
    ~CsvWriter() {
        if (file_ != nullptr) std::fclose(file_);
    }
    CsvWriter(const CsvWriter&) = delete;
    CsvWriter& operator=(const CsvWriter&) = delete;

    // One row: one value per column (strings as they are, integers in full, doubles as "%g"; use fixed() for a
    // set number of decimals). Flushed at once, so a crashed run keeps its rows.
    template <typename... T>
    void row(const T&... values) {
        std::vector<std::string> cells;
        (cells.push_back(cell(values)), ...);
        FLATEP_CHECK(cells.size() == columns_.size(), "CSV ", path_, ": a row of ", cells.size(), " cells for ",
                     columns_.size(), " columns");
        write_line(cells);
    }
    const std::string& path() const { return path_; }

  private:
    static std::string cell(const std::string& v) { return v; }
    static std::string cell(const char* v) { return v; }
    template <typename T>
    static std::string cell(const T& v) {
        if constexpr (std::is_floating_point_v<T>) {
            char buf[64];
            std::snprintf(buf, sizeof buf, "%g", double(v));
            return buf;
        } else {
            return std::to_string(v);
        }
    }
    // Cells holding a comma, quote or newline are quoted (RFC 4180).
    void write_line(const std::vector<std::string>& cells) {
        std::string line;
        for (size_t i = 0; i < cells.size(); ++i) {
            const std::string& c = cells[i];
            if (i) line += ',';
            if (c.find_first_of(",\"\n") == std::string::npos) {
                line += c;
                continue;
            }
            line += '"';
            for (char ch : c) line += ch == '"' ? std::string("\"\"") : std::string(1, ch);
            line += '"';
        }
        line += '\n';
        FLATEP_CHECK_RUNTIME(std::fputs(line.c_str(), file_) >= 0 && std::fflush(file_) == 0, "cannot write ", path_);
    }

    std::string path_;
    std::vector<std::string> columns_;
    FILE* file_ = nullptr;
};

}  // namespace flatep::bench
