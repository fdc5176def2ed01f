// Ordered progress for collectives: one worker thread runs queued collectives in issue order.
// A synchronous call (asyncOp=false) with nothing queued or running runs inline on the caller's
// thread, skipping the hand-off; anything else waits its turn, so order is always preserved.
// A task submitted from inside a running task (a future callback that issues a collective and
// waits for it, as torch's PowerSGD hook does) runs right there, after everything queued before it:
// handing it to the worker would deadlock, since the worker is the thread waiting.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace tdx {

class CollectiveQueue {
 public:
  CollectiveQueue();
  ~CollectiveQueue();

  // Runs `task` now if `inlineOk` and the queue is idle, else queues it for the worker.
  void submit(std::function<void()> task, bool inlineOk);

  // The calling thread's turn to run a synchronous task itself, as submit(task, true) would run
  // it inline, without handing the task over: held (true) when the queue was idle, or when this
  // thread is the one running tasks (what was queued before then runs first); the queue is idle
  // again when the Turn ends. Not held: the task must be submitted.
  class Turn {
   public:
    explicit operator bool() const { return queue_ != nullptr; }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    ~Turn() {
      if (queue_ && !reentrant_) queue_->release();
    }

   private:
    friend class CollectiveQueue;
    Turn(CollectiveQueue* queue, bool reentrant) : queue_(queue), reentrant_(reentrant) {}
    CollectiveQueue* queue_;
    bool reentrant_;
  };
  Turn turn();
  // Stops the worker after the tasks already queued. Idempotent.
  void stop();

 private:
  void loop();
  // Runs what is queued, on this thread, which is the one running tasks (lock held on entry and exit).
  void drain(std::unique_lock<std::mutex>& lock);
  // Ends an inline run: the queue is idle, the worker takes what was queued meanwhile.
  void release();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  std::thread::id runner_;  // the thread running tasks while busy_
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tdx
