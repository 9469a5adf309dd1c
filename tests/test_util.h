// Helpers the tests share: seeded random inputs, storage-type casts, the closeness measures the kernel tests
// assert with, central finite differences, thread-count control, scratch directories and files, exception
// messages.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <stdexcept>
#include <system_error>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/dtype.h"

namespace hs::test {

// A shell command's exit code and its stdout and stderr together (-1: it could not be started or did not exit).
struct CliRun {
  int rc = -1;
  std::string out;
};
inline CliRun run_command(const std::string& cmd) {
  CliRun r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The source tree the test program was built from, and the hybridscan program built beside it. Read at run time
// from the build directory's CMakeCache.txt next to the test program rather than compiled in, so that the tests'
// objects are the same in every clone of the repository and the compiler cache serves them (CMakeLists.txt).
inline std::string build_dir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("cannot read /proc/self/exe: " + ec.message());
  return exe.parent_path().string();
}
inline const std::string& source_dir() {
  static const std::string dir = [] {
    const std::string cache = build_dir() + "/CMakeCache.txt";
    std::ifstream in(cache);
    const std::string key = "CMAKE_HOME_DIRECTORY:INTERNAL=";
    for (std::string line; std::getline(in, line);)
      if (line.rfind(key, 0) == 0) return line.substr(key.size());
    throw std::runtime_error("no " + key + " in " + cache + ": run the test program from its build directory");
  }();
  return dir;
}
inline const std::string& binary() {
  static const std::string path = build_dir() + "/hybridscan";
  return path;
}

// n draws from N(mean, stddev^2) by a generator seeded with `seed`.
inline std::vector<float> randn(size_t n, uint32_t seed, float stddev = 1.0f, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(mean, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// n draws from N(0, stddev^2), continuing the caller's generator.
inline std::vector<float> randn(size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// v (float or double) in the storage type T, through fp32 (rounded to nearest even for bf16).
template <typename T, typename S>
std::vector<T> cast(const std::vector<S>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_f32<T>(static_cast<float>(v[i]));
  return out;
}

// v (float, bf16 or double) in double, exactly.
template <typename T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(to_f32(v[i]));
  return out;
}

// ||a - b|| / ||b||, the relative-RMS error the kernel tests bound (flash-linear-attention style); a is float,
// bf16 or double. ||b||^2 is floored at den_floor so that an all-zero reference does not divide by zero.
template <typename A>
double rel_rms(const std::vector<A>& a, const std::vector<double>& b, double den_floor = 1e-300) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = static_cast<double>(to_f32(a[i])) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, den_floor));
}

// |got - want| <= atol + rtol * |want| elementwise (and equal sizes); reports the first offender.
template <typename A, typename B>
::testing::AssertionResult close(const std::vector<A>& got, const std::vector<B>& want, double rtol, double atol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(to_f32(got[i])), w = static_cast<double>(to_f32(want[i]));
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w)))
      return ::testing::AssertionFailure() << "element " << i << ": " << g << " vs " << w;
  }
  return ::testing::AssertionSuccess();
}

// Checks grad, the analytic gradient of loss() with respect to p, against central differences
// (loss(p + h e_i) - loss(p - h e_i)) / 2h, element by element: |grad[i] - fd| <= atol + rtol * |fd|. loss() must
// read p (it is perturbed in place and restored). Each test states why its h and tolerances fit its loss.
template <typename Loss>
void expect_grad_matches_fd(std::vector<double>& p, const std::vector<double>& grad, Loss&& loss, const char* what,
                            double rtol, double atol, double h = 1e-6) {
  ASSERT_EQ(p.size(), grad.size()) << what;
  for (size_t i = 0; i < p.size(); ++i) {
    const double save = p[i];
    p[i] = save + h;
    const double lp = loss();
    p[i] = save - h;
    const double lm = loss();
    p[i] = save;
    const double fd = (lp - lm) / (2 * h);
    EXPECT_NEAR(grad[i], fd, atol + rtol * std::abs(fd)) << what << "[" << i << "]";
  }
}

// Runs f with n OpenMP threads, restores the previous setting and returns f's result.
template <typename F>
auto with_threads(int n, F&& f) {
  const int prev = omp_get_max_threads();
  omp_set_num_threads(n);
  if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
    f();
    omp_set_num_threads(prev);
  } else {
    auto result = f();
    omp_set_num_threads(prev);
    return result;
  }
}

// A scratch directory, unique per process and instance, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("hs_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }
  // File names directly inside, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::filesystem::path path_;
};

// The message of the exception f throws, or "(no exception)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

// The whole file (empty if it cannot be read).
inline std::vector<std::byte> read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto* b = reinterpret_cast<const std::byte*>(s.data());
  return {b, b + s.size()};
}

}  // namespace hs::test
