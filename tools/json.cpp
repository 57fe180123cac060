// JSON writer of the tools (the reader is header-only, see json.hpp).
#include "json.hpp"

#include <cmath>

namespace flatep::json {

void Writer::newline(int depth) {
    out_ += '\n';
    out_.append(size_t(depth) * 2, ' ');
}

// Separator and indentation before a value (or a key, for objects).
void Writer::before_value(bool is_container) {
    if (after_key_) {
        after_key_ = false;
        return;
    }
    if (stack_.empty()) return;
    Frame& f = stack_.back();
    if (f.count > 0) out_ += compact_ ? "," : (f.object || is_container ? "," : ", ");
    if (!compact_ && (f.object || is_container)) newline(int(stack_.size()));
    if (is_container) f.has_container = true;
    ++f.count;
}

void Writer::begin_object() {
    before_value(true);
    out_ += '{';
    stack_.push_back(Frame{true, 0, false});
}

void Writer::end_object() {
    const Frame f = stack_.back();
    stack_.pop_back();
    if (!compact_ && f.count > 0) newline(int(stack_.size()));
    out_ += '}';
}

void Writer::begin_array() {
    before_value(true);
    out_ += '[';
    stack_.push_back(Frame{false, 0, false});
}

void Writer::end_array() {
    const Frame f = stack_.back();
    stack_.pop_back();
    if (!compact_ && f.has_container) newline(int(stack_.size()));
    out_ += ']';
}

void Writer::key(std::string_view name) {
    before_value(false);
    write_string(name);
    out_ += compact_ ? ":" : ": ";
    after_key_ = true;
}

void Writer::value(int64_t v) {
    before_value(false);
    out_ += std::to_string(v);
}

void Writer::value(double v) {
    before_value(false);
    if (!std::isfinite(v)) {
        out_ += "null";
        return;
    }
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof(buf), v);
    out_.append(buf, res.ptr);
}

void Writer::value(bool v) {
    before_value(false);
    out_ += v ? "true" : "false";
}

void Writer::null() {
    before_value(false);
    out_ += "null";
}

void Writer::value(std::string_view v) {
    before_value(false);
    write_string(v);
}

void Writer::write_string(std::string_view v) {
    static const char* hex = "0123456789abcdef";
    out_ += '"';
    for (const char c : v) {
        const unsigned char u = static_cast<unsigned char>(c);
        switch (c) {
            case '"':
                out_ += "\\\"";
                break;
            case '\\':
                out_ += "\\\\";
                break;
            case '\n':
                out_ += "\\n";
                break;
            case '\t':
                out_ += "\\t";
                break;
            case '\r':
                out_ += "\\r";
                break;
            default:
                if (u < 0x20) {
                    out_ += "\\u00";
                    out_ += hex[u >> 4];
                    out_ += hex[u & 15];
                } else {
                    out_ += c;
                }
        }
    }
    out_ += '"';
}

}  // namespace flatep::json
