// FlatEP public error type. Every failure the library reports is a flatep::Error carrying a category,
// the source location that raised it and a one-line message that names the offending argument and value.
#pragma once

#include <stdexcept>
#include <string>

namespace flatep {

enum class ErrorCategory {
    kInvalidArgument,  // bad user input (maps to Python ValueError)
    kRuntime,          // a failure at run time: CUDA, OS, transport (maps to Python RuntimeError)
    kTimeout,          // a peer did not arrive within the configured time (RuntimeError)
    kMismatch,         // ranks disagree on configuration, or a stale plan was used (ValueError)
};

const char* category_name(ErrorCategory category);

class Error : public std::runtime_error {
  public:
    Error(ErrorCategory category, const char* file, int line, const std::string& message);

    ErrorCategory category() const { return category_; }
    const std::string& message() const { return message_; }  // without the location prefix
    const char* file() const { return file_; }
    int line() const { return line_; }

  private:
    ErrorCategory category_;
    const char* file_;
    int line_;
    std::string message_;
};

}  // namespace flatep
