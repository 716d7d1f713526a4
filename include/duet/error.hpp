// The one exception hierarchy of duet: every run-time failure is a duet::Error.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace duet {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Shapes that a layer or operation cannot accept.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// An index or axis outside a tensor.
class IndexError : public Error {
 public:
  using Error::Error;
};

// An argument whose value is invalid (negative size, unknown option, ...).
class ValueError : public Error {
 public:
  using Error::Error;
};

// A feature used where the current mode cannot honour it (e.g. hooks inside a graph).
class ModeError : public Error {
 public:
  using Error::Error;
};

// Reading or writing a file failed; FormatError when the bytes themselves are wrong.
class IOError : public Error {
 public:
  using Error::Error;
};

// A compilation the recompilation contract forbids: one form more than a jitted function's
// JitConfig::max_compiled_forms, or any compilation after duet::freeze_compiles(). Not a
// ModeError: the call itself is valid, the program has said it may not compile again.
class RecompileError : public Error {
 public:
  using Error::Error;
};

class FormatError : public IOError {
 public:
  using IOError::IOError;
};

// Rethrows the duet::Error being handled with "where: " before its message, as the same type
// when it is a ShapeError, IndexError or ValueError (any other as it is), and as it is when
// its message begins with `where` already. Called only inside a handler.
[[noreturn]] inline void rethrow_at(const std::string& where) {
  const auto located = [&where](const Error& e) {
    const std::string_view what = e.what();
    return what.starts_with(where) ? std::string(what) : where + ": " + std::string(what);
  };
  try {
    throw;
  } catch (const ShapeError& e) {
    throw ShapeError(located(e));
  } catch (const IndexError& e) {
    throw IndexError(located(e));
  } catch (const ValueError& e) {
    throw ValueError(located(e));
  }
}

}  // namespace duet
