#include "serve/connection_deadlines.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <functional>
#include <list>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include <httplib.h>

namespace {
// The descriptor accept() last returned on this thread: httplib's listen thread accepts a connection and then
// enqueues its task, so the queue (same thread) finds the connection's descriptor here.
thread_local int tl_accepted = -1;
}  // namespace

// Wraps the C library's accept (resolved past this definition: libc's, or a sanitizer's in front of it), for every
// caller in the process; it only remembers the result per thread.
extern "C" int accept(int fd, sockaddr* __restrict addr, socklen_t* __restrict len) {
  using Accept = int (*)(int, sockaddr*, socklen_t*);
  static const Accept real = reinterpret_cast<Accept>(dlsym(RTLD_NEXT, "accept"));
  if (!real) {
    errno = ENOSYS;
    return -1;
  }
  const int s = real(fd, addr, len);
  if (s >= 0) tl_accepted = s;
  return s;
}

namespace hs::serve {

using Clock = std::chrono::steady_clock;

struct ConnectionDeadlines::State {
  struct Entry {
    int fd;  // a duplicate of the connection's descriptor, closed only after the entry is gone (never reused while
             // the watchdog may shut it down)
    Clock::time_point due;
    bool armed;
  };
  const std::chrono::milliseconds limit;
  std::mutex mu;
  std::condition_variable cv;
  std::list<Entry> entries;
  bool stopping = false;
  std::atomic<uint64_t> dropped{0};
  std::thread watchdog;

  explicit State(std::chrono::milliseconds l) : limit(l) {}
  std::list<Entry>::iterator add(int fd) {
    std::lock_guard<std::mutex> lk(mu);
    return entries.insert(entries.end(), Entry{fd, Clock::now() + limit, true});
  }
  void remove(std::list<Entry>::iterator it) {
    std::lock_guard<std::mutex> lk(mu);
    entries.erase(it);
  }
  void arm(std::list<Entry>::iterator it, bool on) {
    std::lock_guard<std::mutex> lk(mu);
    it->armed = on;
    it->due = Clock::now() + limit;
  }
  void watch() {
    // A tenth of the limit between looks (10-250 ms): a connection is dropped at most that late.
    const auto tick = std::clamp<std::chrono::milliseconds>(limit / 10, std::chrono::milliseconds(10),
                                                            std::chrono::milliseconds(250));
    std::unique_lock<std::mutex> lk(mu);
    while (!stopping) {
      cv.wait_for(lk, tick);
      const Clock::time_point now = Clock::now();
      for (Entry& e : entries)
        if (e.armed && e.due <= now) {
          e.armed = false;
          ::shutdown(e.fd, SHUT_RDWR);
          dropped.fetch_add(1, std::memory_order_relaxed);
        }
    }
  }
};

namespace {

// The connection the current pool thread serves.
struct Current {
  ConnectionDeadlines::State* state = nullptr;
  std::list<ConnectionDeadlines::State::Entry>::iterator it;
};
thread_local Current tl_current;

class WatchedQueue final : public httplib::TaskQueue {
 public:
  WatchedQueue(std::shared_ptr<ConnectionDeadlines::State> s, httplib::TaskQueue* inner) : s_(std::move(s)), inner_(inner) {}
  void enqueue(std::function<void()> fn) override {
    const int fd = std::exchange(tl_accepted, -1);
    const int dup = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;  // none (out of descriptors): served unwatched
    if (dup < 0) return inner_->enqueue(std::move(fn));
    inner_->enqueue([s = s_, dup, fn = std::move(fn)] {
      struct Leave {
        ConnectionDeadlines::State* s;
        std::list<ConnectionDeadlines::State::Entry>::iterator it;
        int fd;
        ~Leave() {
          tl_current = {};
          s->remove(it);
          ::close(fd);
        }
      } leave{s.get(), s->add(dup), dup};
      tl_current = {s.get(), leave.it};
      fn();
    });
  }
  void shutdown() override { inner_->shutdown(); }
  void on_idle() override { inner_->on_idle(); }

 private:
  std::shared_ptr<ConnectionDeadlines::State> s_;
  std::unique_ptr<httplib::TaskQueue> inner_;
};

}  // namespace

ConnectionDeadlines::ConnectionDeadlines(std::chrono::milliseconds limit) : s_(std::make_shared<State>(limit)) {
  if (limit.count() <= 0) throw std::invalid_argument("the request deadline must be positive");
  s_->watchdog = std::thread([s = s_.get()] { s->watch(); });
}

ConnectionDeadlines::~ConnectionDeadlines() {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->stopping = true;
  }
  s_->cv.notify_all();
  s_->watchdog.join();
}

httplib::TaskQueue* ConnectionDeadlines::queue(httplib::TaskQueue* inner) { return new WatchedQueue(s_, inner); }

void ConnectionDeadlines::request_read() {
  if (tl_current.state) tl_current.state->arm(tl_current.it, false);
}

void ConnectionDeadlines::response_written() {
  if (tl_current.state) tl_current.state->arm(tl_current.it, true);
}

uint64_t ConnectionDeadlines::dropped() const { return s_->dropped.load(std::memory_order_relaxed); }

}  // namespace hs::serve
