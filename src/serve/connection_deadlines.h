// A deadline on the whole of each request a connection sends, not only on each read.
//
// cpp-httplib bounds every read and write by its timeouts (serve --timeout), so a client that sends one byte every
// few seconds keeps its connection thread for as long as it likes, and enough such clients hold the whole pool
// (every later connection waits in its queue). The library (Debian's 0.11) gives no hook on the sockets it accepts:
// this module learns each one's descriptor by wrapping the C library's accept() (the library calls it on its listen
// thread, then hands the connection to the task queue: ConnectionDeadlines::queue wraps that queue), and a watchdog
// thread shuts a connection down (SHUT_RDWR: the blocked poll wakes, the read sees the end, httplib closes it) when
// its request has not fully arrived in time.
//
// A connection's clock runs from the moment a pool thread takes it, stops when a handler starts (the request line,
// headers and body have all been read by then: request_read()), and starts again when the answer has been written
// (response_written(), from the server's logger), for the next request on a kept-alive connection. So a streamed
// answer of any length is never cut, and an idle kept-alive connection is closed at the deadline at the latest.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>

namespace httplib {
class TaskQueue;
}

namespace hs::serve {

class ConnectionDeadlines {
 public:
  // Every request must arrive within `limit` (> 0).
  explicit ConnectionDeadlines(std::chrono::milliseconds limit);
  ~ConnectionDeadlines();  // stops the watchdog; the queues it made must be gone (the server has stopped)
  ConnectionDeadlines(const ConnectionDeadlines&) = delete;
  ConnectionDeadlines& operator=(const ConnectionDeadlines&) = delete;

  // A task queue running `inner`'s threads whose connection tasks are watched (takes ownership of inner).
  httplib::TaskQueue* queue(httplib::TaskQueue* inner);

  // On a pool thread, about the connection it serves (no-ops elsewhere): the request is in (stop the clock), the
  // answer is out (start it again).
  static void request_read();
  static void response_written();

  // Connections shut down because a request did not arrive in time.
  uint64_t dropped() const;

  struct State;

 private:
  std::shared_ptr<State> s_;
};

}  // namespace hs::serve
